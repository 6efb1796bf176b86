"""Progress lines in a CI log (stderr not a terminal): each message one line whatever its length (no wrap at 80
columns, mid-path), headed by the time since the command started, brackets kept as written."""

from __future__ import annotations

import re

from toolchain.cli import _BuildDisplay, _logger

LONG = "reading model from /a/very/long/path/" + "x" * 150 + " [1, 4] [bold]not markup[/bold]"


def test_a_build_log_line_is_one_line_with_its_elapsed_time(capsys):
    display = _BuildDisplay()
    display.log(LONG)
    display.stage_finished("export", 12.5, cached=False)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\d\d:\d\d\.\d    " + re.escape(LONG), lines[0])
    assert re.fullmatch(r"\d\d:\d\d\.\d  export    done in 12\.5 s", lines[1])


def test_a_stage_commands_log_line_has_its_elapsed_time(capsys):
    _logger("eval")(LONG)
    (line,) = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\d\d:\d\d\.\d \[eval\] " + re.escape(LONG), line)
