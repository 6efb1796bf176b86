"""Lint and type checks of toolchain/ and passes/, as part of the test suite (issue #13): ``ruff check`` and
``mypy``, configured in pyproject.toml, each run in a child process that must exit 0; on failure the test shows
what the tool printed.

``ruff format --check`` is not run: ruff's formatter would rewrite 93 of the 128 files. The code aligns
continuation lines with the opening bracket and packs arguments up to 120 columns; the formatter puts one argument
per line under a closing bracket of its own and has no option to keep that style, and a mass reformat is a change
of its own, not part of making the checks pass.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# mypy from a cold cache takes about 30 s of CPU; a loaded machine stretches that several times over
LIMIT_S = 540


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed in {sys.executable}: it is part of the test extras "
                    f"(./install.sh test)")
    try:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=LIMIT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module} did not finish in {LIMIT_S} s:\n{e.stdout or ''}{e.stderr or ''}")


def _check(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, f"{what} failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"


def test_ruff_check() -> None:
    _check(_run("ruff", "check", "--no-cache", "toolchain", "passes"), "ruff check toolchain passes")


@pytest.mark.timeout(LIMIT_S + 60)
def test_mypy() -> None:
    # packages, plugins and strictness from pyproject.toml's [tool.mypy]; the cache stays in .mypy_cache
    _check(_run("mypy"), "mypy")
