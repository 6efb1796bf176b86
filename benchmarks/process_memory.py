"""Resident memory of a process and all its descendants, as the benchmarks sample a build or a peer running in a
child: a build's own children (smoke inference, converters) count too."""

from __future__ import annotations

import contextlib

import psutil


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and its descendants now (0 once it has exited)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # a child that exited between the listing and the read
            total += proc.memory_info().rss
    return total
