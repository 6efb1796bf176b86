"""The command line run in this process, and the one-line error every bad input must end with (exit 2)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

import conftest


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    """``dstc ARGS`` in this process: (exit code, stderr)."""
    code, _, err = conftest.run_cli(monkeypatch, capsys, *args)
    return code, err


def dstc_here(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """``dstc ARGS`` in this process with the environment ``env``, reported as ``subprocess.run`` reports a child:
    for tests that check a command's exit code and outputs, not its process (a fresh one costs seconds of imports)."""
    from toolchain.cli import main

    argv = ["dstc", *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setattr(sys, "argv", argv)
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def assert_one_line_error(code, err, fragment):
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dstc: error:")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


def leaf_commands(group, prefix: str = "") -> dict:
    """Every command under a click group by its path (``prefix`` + "models list"), subgroups walked."""
    import click

    found = {}
    for name, command in group.commands.items():
        path = f"{prefix} {name}".strip()
        if isinstance(command, click.Group):
            found.update(leaf_commands(command, path))
        else:
            found[path] = command
    return found
