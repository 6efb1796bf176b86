"""The CI user's contract (issue #40): with --json, stdout is one JSON document on every path, of every command
that has --json, from a cold cache as from a warm one, and a failure's is {"error", "exit_code"}; without it, stdout
holds dstc's own lines only. What libraries print (NNCF's INFO lines, bit-width tables and progress bars,
OpenVINO's and ONNX Runtime's native output) goes to stderr. Each command runs in a child process, as CI runs it:
a library writing to the process's file descriptor 1 is seen there, not only one writing to sys.stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
MODEL = "r1-distill-qwen-tiny"
BASELINE = REPO / "baselines/deepseek-v3-tiny-onnxruntime-int4.json"
NNCF = "INFO:nncf:"  # NNCF's log lines, as NNCF 3.4 prints them
LIBRARIES = (NNCF, "Statistics of the bitwidth distribution", "Applying Weight Compression", "% all parameters")


def dstc(*args, cache: Path) -> subprocess.CompletedProcess:
    """``dstc ARGS`` in a child process with the stage and reference cache ``cache``."""
    return subprocess.run([sys.executable, "-m", "toolchain", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=540,
                          env={**os.environ, "PYTHONPATH": str(REPO), "DSTC_CACHE_DIR": str(cache)})


def document(proc: subprocess.CompletedProcess):
    """stdout as one JSON document: json.loads refuses anything beside it (whitespace aside)."""
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"stdout is not one JSON document ({e}):\n{proc.stdout[:3000]}\n--- stderr:\n"
                             f"{proc.stderr[-3000:]}") from None


def ok(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return document(proc)


def cold(tmp_path_factory) -> Path:
    """A stage and reference cache of its own: every stage and reference runs."""
    return tmp_path_factory.mktemp("cold-cache")


def write_recipe(path: Path, **sections) -> Path:
    """MODEL in INT4 for OpenVINO, quickly: NNCF runs (and prints), no parity, verification or smoke run."""
    path.write_text(yaml.safe_dump({"name": path.stem, "model": MODEL, "export": {"parity": []},
                                    "compress": {"scheme": "int4-grouped"},
                                    "compile": {"backend": "openvino", "verify": False, "smoke": False},
                                    **sections}))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`dstc build --json` of the quick recipe on a cold cache: (process, artifact, its cache)."""
    root = tmp_path_factory.mktemp("built")
    cache = cold(tmp_path_factory)
    proc = dstc("build", write_recipe(root / "quick.yaml"), "-o", root / "art", "--json", cache=cache)
    return proc, root / "art", cache


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`dstc export --json` on a cold cache: (process, export directory)."""
    out = tmp_path_factory.mktemp("exported") / "export"
    return dstc("export", MODEL, "-o", out, "--parity", "none", "--json", cache=cold(tmp_path_factory)), out


def test_build_json_cold_and_warm_is_one_manifest_and_nncf_prints_on_stderr(built):
    proc, artifact, cache = built
    manifest = ok(proc)
    assert manifest["schema"] == "dstc.manifest/1" and manifest["recipe"]["name"] == "quick"
    assert manifest == json.loads((artifact / "manifest.json").read_text())
    assert NNCF in proc.stderr and "Applying Weight Compression" in proc.stderr  # it ran, and printed there
    warm = dstc("build", artifact.parent / "quick.yaml", "-o", artifact, "--json", cache=cache)
    assert ok(warm)["stages"] == manifest["stages"]
    assert sorted(json.loads((artifact / "manifest.json").read_text())["provenance"]["cached_stages"]) == \
        ["compile", "compress", "export"]


@pytest.mark.slow
def test_plain_build_prints_the_summary_on_stdout_and_libraries_on_stderr(built, tmp_path):
    """Without --json, stdout is dstc's summary; NNCF's 50-odd lines went to stdout before (issue #40)."""
    _, artifact, _ = built
    proc = dstc("build", artifact.parent / "quick.yaml", "-o", tmp_path / "art", "--no-cache", cache=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert NNCF in proc.stderr
    assert not [line for line in LIBRARIES if line in proc.stdout], proc.stdout
    assert f"artifact {tmp_path / 'art'}" in proc.stdout and "quick:" in proc.stdout


def test_export_json_cold(exported):
    proc, out = exported
    report = ok(proc)
    assert report["source"]["spec"] == MODEL and report == json.loads((out / "export.json").read_text())


@pytest.mark.slow
def test_optimize_json_cold(exported, tmp_path):
    _, export = exported
    report = ok(dstc("optimize", export, "-o", tmp_path / "opt", "--backend", "openvino", "--no-parity", "--json",
                     cache=tmp_path / "cache"))
    assert report["target"] == "openvino" and report == json.loads((tmp_path / "opt/passes.json").read_text())


def test_compress_json_cold_and_plain(exported, tmp_path):
    _, export = exported
    proc = dstc("compress", export, "-o", tmp_path / "c", "--backend", "openvino", "--json", cache=tmp_path / "c1")
    report = ok(proc)
    assert report["scheme"] == "int4-grouped" and NNCF in proc.stderr
    plain = dstc("compress", export, "-o", tmp_path / "p", "--backend", "openvino", cache=tmp_path / "c2")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert NNCF in plain.stderr and not [line for line in LIBRARIES if line in plain.stdout], plain.stdout
    assert plain.stdout.startswith(f"int4-grouped for openvino -> {tmp_path / 'p'}: ")


def test_compile_json_cold(exported, tmp_path):
    _, export = exported
    report = ok(dstc("compile", export, "-o", tmp_path / "art", "--backend", "onnxruntime", "--no-verify",
                     "--no-smoke", "--json", cache=tmp_path / "cache"))
    assert report["backend"] == "onnxruntime" and report == json.loads((tmp_path / "art/compile.json").read_text())


def test_generate_json(built, tmp_path):
    _, artifact, _ = built
    record = ok(dstc("generate", artifact, "321+654=", "--raw", "--new-tokens", "3", "--json",
                     cache=tmp_path))
    assert record["new_tokens"] == 3 and len(record["tokens"]) == 3


@pytest.mark.slow
def test_eval_and_compare_json_cold(built, tmp_path):
    """eval with a cold reference cache, compare of two artifacts."""
    _, artifact, _ = built
    small = ["--no-latency", "--texts", "4", "--problems", "4", "--greedy-prompts", "0"]
    report = ok(dstc("eval", artifact, *small, "-o", tmp_path / "r", "--json", cache=tmp_path / "c1"))
    assert report == json.loads((tmp_path / "r/report.json").read_text())
    compared = ok(dstc("compare", artifact, artifact, *small, "--json", cache=tmp_path / "c2"))
    assert len(compared["reports"]) == 2 and compared["rows"]


def test_gate_json_passing_and_failing(tmp_path):
    """A failed gate exits 1 with its results still the one document."""
    passing = ok(dstc("gate", BASELINE, "--max-kl-mean", "1e9", "--json", cache=tmp_path))
    assert [g["passed"] for g in passing] == [True]
    failing = dstc("gate", BASELINE, "--max-kl-mean", "0", "--json", cache=tmp_path)
    assert failing.returncode == 1 and [g["passed"] for g in document(failing)] == [False]


@pytest.mark.parametrize("command", [["models", "list"], ["passes", "list"]])
def test_listings_json(tmp_path, command):
    rows = ok(dstc(*command, "--json", cache=tmp_path))
    assert rows and all("name" in row for row in rows)


@pytest.mark.parametrize("args, code, fragment", [
    (["build", "{missing}"], 2, "cannot read recipe"),
    (["export", "no-such-model", "-o", "{out}"], 2, "no-such-model"),
    (["gate", "{missing}", "--max-kl-mean", "1"], 2, "cannot read report"),
    (["generate", "{missing}", "hi"], 2, ""),
    (["eval", "{missing}", "--no-latency"], 2, ""),
    (["compress", "{missing}", "-o", "{out}", "--scheme", "int8-per-channel", "--awq"], 2, "awq"),
    (["gate", "{missing}", "--no-such-option"], 2, "No such option"),
])
def test_a_failure_prints_one_error_document(tmp_path, args, code, fragment):
    args = [a.format(missing=tmp_path / "missing", out=tmp_path / "out") for a in args]
    proc = dstc(*args, "--json", cache=tmp_path / "cache")
    assert proc.returncode == code, proc.stderr
    failure = document(proc)
    assert failure["exit_code"] == code and fragment in failure["error"]
    assert f"dstc: error: {failure['error']}" in proc.stderr  # the same line on stderr, for a human
    assert "Traceback" not in proc.stderr
