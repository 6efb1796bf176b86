"""Ctrl-C that cannot be lost on the way to an output.

Python raises KeyboardInterrupt wherever the main thread happens to be. Raised inside a finalizer (``__del__`` or
a weakref callback: a runtime session or a temporary file being collected) it is printed as "Exception ignored"
and the program goes on, so a build interrupted at that moment would finish and replace the user's artifact. The
handler also remembers the interrupt, and outputs check it before they are committed.
"""

from __future__ import annotations

import signal
import threading

_seen = threading.Event()


def _on_interrupt(signum, frame) -> None:
    _seen.set()
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT (from the main thread, once per process)."""
    signal.signal(signal.SIGINT, _on_interrupt)


def interrupted() -> bool:
    return _seen.is_set()


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if the process was interrupted, even when the first one was swallowed."""
    if _seen.is_set():
        raise KeyboardInterrupt
