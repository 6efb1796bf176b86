"""stdout is dstc's: a command's own lines, or with --json its one JSON document, and nothing else.

While a command runs, the process's stdout (file descriptor 1, which native code and child processes write to:
OpenVINO, ONNX Runtime) and ``sys.stdout`` (which Python libraries write to: NNCF's logger, bit-width tables and
rich progress bars, Ray's relayed worker logs, a stray print) are both stderr; dstc writes its own output to the
stdout the process was started with, through `echo` and `print_json`. A library keeping ``sys.stdout`` from its
import (NNCF's log handler) keeps stderr when it is imported while a command runs, as dstc imports it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import click

_held: list[TextIO] = []  # the real stdout, while a command runs
_printed = [False]  # whether a JSON document was printed: then an error after it prints no second one


def start() -> None:
    """A new command line (commands run in one process, as tests do, each print their own document)."""
    _printed[0] = False


def _fd(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a test's captured stream has none
        return None


@contextmanager
def stdout_held() -> Iterator[None]:
    """Run the body with fd 1 and ``sys.stdout`` on stderr; `echo` writes to the real stdout meanwhile."""
    try:
        saved = None if _held else os.dup(1)
    except OSError:  # no stdout at all (closed by the caller): nothing to keep apart
        saved = None
    if saved is None:
        yield
        return
    original = sys.stdout
    original.flush()
    sys.stderr.flush()
    os.dup2(2, 1)
    own = original
    if _fd(original) == 1:  # the process's stdout: written through the saved descriptor
        own = open(saved, "w", buffering=1 if getattr(original, "line_buffering", False) else -1,  # noqa: SIM115
                   encoding=original.encoding, errors=original.errors, closefd=False)
    _held.append(own)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = original
        _held.pop()
        sys.stderr.flush()
        original.flush()  # what a library wrote to the stdout it kept from before goes where fd 1 points: stderr
        if own is not original:
            own.close()  # flushes; the descriptor stays open (closefd=False)
        os.dup2(saved, 1)
        os.close(saved)


def own_stdout() -> TextIO:
    """Where dstc's own output goes: the real stdout, also while a command holds it."""
    return _held[-1] if _held else sys.stdout


def echo(message: str = "", nl: bool = True) -> None:
    click.echo(message, file=own_stdout(), nl=nl)


def print_json(document) -> None:
    """The command's one JSON document (--json)."""
    echo(json.dumps(document, indent=2))
    _printed[0] = True


def print_json_error(message: str, exit_code: int) -> None:
    """A failure's document, unless the command printed its own before failing (a gate's results, exit 1)."""
    if not _printed[0]:
        print_json({"error": message, "exit_code": exit_code})


def json_requested(args: list[str]) -> bool:
    """Whether a command line asks for --json (before ``--``, as click reads it), known before click parses it:
    a command line that does not parse gets its error as JSON too."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)
