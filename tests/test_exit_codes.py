"""Every exit code of README's "Exit codes" table, each from a command that ends with it: what a CI job reads
(issue #40). Exit 5 (a crash in the smoke inference) is tests/verify/test_smoke.py's
test_dstc_build_exits_5_with_one_line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import run_cli

import toolchain.errors as errors
from toolchain.verify import parity

REPO = Path(__file__).resolve().parent.parent
BASELINE = REPO / "baselines/deepseek-v3-tiny-onnxruntime-int4.json"
MODEL = "r1-distill-qwen-tiny"


def _table_codes(path: str = "README.md", heading: str = "## Exit codes") -> list[int]:
    section = (REPO / path).read_text().split(f"{heading}\n", 1)[1]
    table = re.search(r"(?:^\|.*\n)+", section, flags=re.M)  # the section's first table
    assert table is not None
    return [int(m) for m in re.findall(r"^\| `(\d+)` \|", table.group(0), flags=re.M)]


def _error_classes(cls=errors.DstcError):
    yield cls
    for sub in cls.__subclasses__():
        yield from _error_classes(sub)


def test_the_readme_table_holds_every_code_dstc_exits_with():
    codes = _table_codes()
    assert codes == sorted(codes) and len(codes) == len(set(codes))
    assert _table_codes("docs/commands.md") == codes  # the whole table, every case of exit 2
    raised = {cls.exit_code for cls in _error_classes()}
    assert set(codes) == {0, *raised, errors.INTERNAL_ERROR_EXIT, errors.INTERRUPTED_EXIT} == \
        {0, 1, 2, 3, 4, 5, 6, 70, 130}


def test_0_and_1_a_gate_that_passes_and_one_that_fails(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--max-kl-mean", "1e9")
    assert code == 0, err
    code, out, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--max-kl-mean", "0")
    assert code == 1 and "FAIL" in out, err


def test_2_bad_input(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "export", "no-such-model", "-o", tmp_path / "out")
    assert code == 2 and err.count("dstc: error:") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_3_parity_failed_keeps_the_output(monkeypatch, capsys, tmp_path):
    """The real check against PyTorch, with a limit no graph meets."""
    monkeypatch.setitem(parity.TOLERANCES, "onnxruntime", -1.0)
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "export", MODEL, "-o", tmp_path / "out", "--parity", "onnxruntime",
                           "--new-tokens", "2")
    assert code == 3, err
    assert err.strip().splitlines()[-1].startswith("dstc: error: exported graph disagrees with PyTorch on onnxruntime")
    assert (tmp_path / "out/export.json").is_file()


def test_4_a_pass_that_fuses_less_than_expected(monkeypatch, capsys, tmp_path, stage_cache):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "r", "model": MODEL, "export": {"parity": []},
        "passes": {"target": "openvino", "expect": {"rotate-half-split": {"min": 999}}},
        "compile": {"backend": "openvino", "verify": False, "smoke": False}}))
    monkeypatch.setenv("DSTC_CACHE_DIR", str(stage_cache))
    code, _, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "art")
    assert code == 4, err
    assert "rotate-half-split" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (tmp_path / "art").exists()


def test_70_an_internal_error_keeps_its_traceback_and_asks_for_a_bug_report(monkeypatch, capsys):
    """A bug (here a listing that raises what no code expects) is neither bad input (2) nor a failed gate (1)."""
    import toolchain.models.catalog as catalog

    def broken():
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(catalog, "list_embedded", broken)
    for extra in ([], ["--json"]):
        code, out, err = run_cli(monkeypatch, capsys, "models", "list", *extra)
        assert code == errors.INTERNAL_ERROR_EXIT == 70
        assert "Traceback (most recent call last)" in err and "ZeroDivisionError: a bug" in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("dstc: internal error (ZeroDivisionError: a bug): a bug in dstc; please report it")
        if extra:
            assert json.loads(out) == {"error": last.removeprefix("dstc: "), "exit_code": 70}
        else:
            assert out == ""


def test_130_interrupted_leaves_nothing_and_says_so_in_json(tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-m", "toolchain", "export", MODEL, "-o", str(out), "--json"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO), "DSTC_CACHE_DIR": str(tmp_path / "c")})
    try:
        for line in child.stderr:  # interrupted once the export is under way
            if "[export]" in line:
                child.send_signal(signal.SIGINT)
                break
        stdout, stderr = child.communicate(timeout=300)
    finally:
        child.kill()
    assert child.returncode == errors.INTERRUPTED_EXIT == 130, stderr
    assert json.loads(stdout) == {"error": "interrupted", "exit_code": 130}
    assert "dstc: interrupted" in stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c"]
