"""dstc as a user installs it: a wheel built from the source (pip wheel), installed into a fresh virtualenv from
the wheel file and the package index. The base install (no extra) serves an artifact built elsewhere and refuses
a build in one line; the slow test installs the build extra from the same wheel and builds, gates and serves the
default recipe, as a user's repository (recipes, no dstc source) does in CI (docs/github-actions-release-gate.yml)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from serve_helpers import Server

from toolchain import __version__

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = ROOT / "recipes" / "deepseek-v3-tiny-openvino-int4.yaml"
# what `pip install` may take: the wheels of the base install (about 600 MB, the build extra 2 GB more) come from
# pip's cache or the index; resolving the build extra took 10+ minutes on a loaded 2-core machine
INSTALL_TIMEOUT = 1800


def _run(argv, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], text=True, capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """dstc's wheel, built from a copy of the packaged sources (no build/ or egg-info left in the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("toolchain", "passes"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", root / "dist",
                  source])
    assert built.returncode == 0, built.stderr
    (path,) = (root / "dist").glob("dstc-*.whl")
    return path


def _venv(root: Path, wheel: Path, extra: str | None = None) -> Path:
    """A fresh virtualenv with dstc installed from ``wheel`` (``extra``: with that extra); its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", root], check=True, timeout=120)
    requirement = f"dstc[{extra}] @ {wheel.as_uri()}" if extra else str(wheel)
    installed = _run([root / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      requirement], timeout=INSTALL_TIMEOUT)
    assert installed.returncode == 0, installed.stderr[-5000:]
    return root / "bin"


def test_the_wheel_holds_the_embedded_models_and_reference_configs(wheel):
    assert wheel.name == f"dstc-{__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [p.relative_to(ROOT).as_posix() for p in (ROOT / "toolchain" / "models").rglob("*")
               if p.is_file() and p.parent.name != "__pycache__" and p.suffix != ".pyc"]
    assert len(shipped) > 40
    assert not set(shipped) - names  # every file of the embedded models, the reference configs and the code
    assert "toolchain/models/embedded/deepseek-v3-tiny/model.safetensors" in names
    entry_points = zipfile.ZipFile(wheel).read(f"dstc-{__version__}.dist-info/entry_points.txt").decode()
    assert "dstc = toolchain.cli:main" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"dstc-{__version__}.dist-info/METADATA").decode()
    assert "Provides-Extra: build" in metadata and "Provides-Extra: ray" in metadata
    base = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not [line for line in base if any(f" {n}" in line for n in ("torch", "nncf", "lm-eval", "ray", "datasets"))]


def test_a_serve_only_install_from_the_wheel_serves_and_refuses_a_build_in_one_line(wheel, artifact, tmp_path):
    """The base install: no torch, NNCF, lm-eval or Ray in it; `dstc verify` and `dstc generate` run an artifact
    built by the full toolchain, `dstc build` says which extra it needs (exit 2)."""
    bin_dir = _venv(tmp_path / "venv", wheel)
    site = _run([bin_dir / "python", "-c", "import importlib.util as u; print([m for m in ('torch', 'nncf', "
                 "'lm_eval', 'ray', 'datasets') if u.find_spec(m)])"], cwd=tmp_path)
    assert site.stdout.strip() == "[]", site.stderr
    dstc = bin_dir / "dstc"
    assert _run([dstc, "--help"], cwd=tmp_path).returncode == 0
    art = artifact("deepseek-v3-tiny", "openvino").path
    verified = _run([dstc, "verify", art], cwd=tmp_path)
    assert verified.returncode == 0, verified.stderr
    generated = _run([dstc, "generate", art, "The cat", "--new-tokens", "4", "--raw", "--json"], cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["new_tokens"] == 4
    refused = _run([dstc, "build", DEFAULT_RECIPE, "-o", tmp_path / "out"], cwd=tmp_path,
                   env={"PATH": "/usr/bin:/bin", "DSTC_CACHE_DIR": str(tmp_path / "cache")})
    assert refused.returncode == 2, refused.stderr
    assert re.fullmatch(r"dstc: error: this command needs (torch|onnx_ir), which this install of dstc does not "
                        r"have: pip install 'dstc\[build\]'", refused.stderr.strip()), refused.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_build_extra_from_the_wheel_builds_gates_and_serves_the_default_recipe(wheel, tmp_path):
    """A user's repository: the recipe and nothing of dstc's source; dstc[build] from the wheel."""
    bin_dir = _venv(tmp_path / "venv", wheel, extra="build")
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    shutil.copy(DEFAULT_RECIPE, repo / "recipes")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "DSTC_CACHE_DIR": str(tmp_path / "cache")}
    built = _run(["dstc", "build", f"recipes/{DEFAULT_RECIPE.name}", "-o", "artifacts/default"], cwd=repo, env=env,
                 timeout=1800)
    assert built.returncode == 0, built.stderr[-5000:]
    report = json.loads((repo / "artifacts" / "default" / "report.json").read_text())
    assert report["gates"] and all(g["passed"] for g in report["gates"])
    gated = _run(["dstc", "gate", "artifacts/default", "--max-kl-mean", "0.001", "--json"], cwd=repo, env=env)
    assert gated.returncode == 0, gated.stderr
    assert [g["passed"] for g in json.loads(gated.stdout)] == [True]
    _serves(["dstc"], cwd=repo, env=env)
def _serves(program, cwd: Path, env: dict) -> None:
    """The installed dstc serves the built artifact: a completion, then SIGTERM drains it and it exits 0."""
    server = Server("artifacts/default", program=program, env=env, cwd=cwd, timeout=300)
    try:
        reply = server.post("/v1/completions", {"model": server.name, "prompt": "321+654=", "max_tokens": 4,
                                                 "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0, "".join(server.log)
    finally:
        server.stop()
    assert not any("Traceback" in line for line in server.log), "".join(server.log)
