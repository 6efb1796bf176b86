"""The base install serves: `dstc verify`, `generate`, `gate` and `serve` on built artifacts run with every module of
the `build` and `ray` extras absent (pyproject.toml); a command that needs one exits 2 with one line naming the
extra to install. The absence is made in child processes (and their own children, the server's engine process):
a sitecustomize puts None in sys.modules for each module, which is how Python sees a package that is not installed
(import raises ModuleNotFoundError, importlib.util.find_spec answers None). tests/test_wheel.py installs the
base for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import Server

from toolchain.extras import EXTRA_OF_MODULE

ROOT = Path(__file__).resolve().parent.parent
MODEL = "deepseek-v3-tiny"
BACKENDS = ("openvino", "onnxruntime")


@pytest.fixture(scope="module")
def absent(tmp_path_factory) -> dict:
    """The environment of a child process without the extras' modules."""
    site = tmp_path_factory.mktemp("absent")
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "for name in os.environ['DSTC_TEST_ABSENT'].split(','):\n"
        "    sys.modules[name] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
            "DSTC_TEST_ABSENT": ",".join(EXTRA_OF_MODULE)}


def _dstc(env: dict, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolchain", *map(str, args)], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_blocking_works(absent):
    """The test's own premise: torch does not import in such a child, and the CLI still starts."""
    code = "import importlib.util, sys, toolchain.cli; print(importlib.util.find_spec('torch'), sys.modules['torch'])"
    child = subprocess.run([sys.executable, "-c", code],
                           env=absent, cwd=ROOT, text=True, capture_output=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["None", "None"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_generate_and_gate_need_no_extra(absent, artifact, backend):
    art = artifact(MODEL, backend)
    verified = _dstc(absent, "verify", art.path)
    assert verified.returncode == 0, verified.stderr
    assert "every file matches manifest.json" in verified.stdout
    generated = _dstc(absent, "generate", art.path, "The cat", "--new-tokens", "5", "--raw", "--json")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["new_tokens"] == 5


def test_gate_needs_no_extra(absent):
    report = next(iter(sorted((ROOT / "baselines").glob("*.json"))))
    gated = _dstc(absent, "gate", report, "--baseline", report, "--max-perplexity-increase", "0.02", "--json")
    assert gated.returncode == 0, gated.stderr
    assert [row["passed"] for row in json.loads(gated.stdout)] == [True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_needs_no_extra(absent, artifact, backend):
    art = artifact(MODEL, backend)
    server = Server(art, env=absent)
    try:
        reply = server.post("/v1/completions", {"model": art.path.name, "prompt": "The cat", "max_tokens": 4,
                                                 "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    assert not any("Traceback" in line for line in server.log), "".join(server.log)


@pytest.mark.parametrize(("argv", "extra"), [
    (["export", MODEL, "-o", "{tmp}/e"], "build"),
    (["build", "recipes/deepseek-v3-tiny-openvino-int4.yaml", "-o", "{tmp}/b"], "build"),
    (["models", "shape-faithful", "deepseek-v2-lite", "-o", "{tmp}/m", "--layers", "1", "--experts", "2"], "build"),
])
def test_a_command_without_its_extra_names_it_in_one_line(absent, tmp_path, argv, extra):
    env = {**absent, "DSTC_CACHE_DIR": str(tmp_path / "cache")}
    done = _dstc(env, *[a.format(tmp=tmp_path) for a in argv])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"pip install 'dstc[{extra}]'"), done.stderr
    assert "Traceback" not in done.stderr
    assert not any((tmp_path / out).exists() for out in ("e", "b", "m"))  # nothing half-written


def test_a_command_without_its_extra_says_so_in_json(absent, tmp_path):
    done = _dstc({**absent, "DSTC_CACHE_DIR": str(tmp_path / "cache")}, "export", MODEL, "-o", tmp_path / "e",
                 "--json")
    assert done.returncode == 2
    document = json.loads(done.stdout)
    assert "pip install 'dstc[build]'" in json.dumps(document)
