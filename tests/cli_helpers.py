"""The command line run in this process, and the one-line error every bad input must end with (exit 2)."""

from __future__ import annotations

import conftest


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    """``dstc ARGS`` in this process: (exit code, stderr)."""
    code, _, err = conftest.run_cli(monkeypatch, capsys, *args)
    return code, err


def assert_one_line_error(code, err, fragment):
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("dstc: error:")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err
