"""Resident memory of a process and all its descendants, as the benchmarks sample a build or a peer running in a
child: a build's own children (smoke inference, converters) count too."""

from __future__ import annotations

import contextlib

import psutil


def tree_memory(pid: int) -> tuple[int, int]:
    """(resident bytes, anonymous resident bytes) of ``pid`` and its descendants now ((0, 0) once it has exited).

    The resident set counts the pages of memory-mapped files a process has touched (OpenVINO maps an IR's .bin and
    an ONNX file's external data): clean file pages the kernel takes back when memory runs short, so a build fits
    in less RAM than its peak RSS. Anonymous memory (RssAnon) is what it cannot take back without swap."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    rss = anon = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            # a child that exited between the listing and the read
            rss += proc.memory_info().rss
            anon += _status_kib(proc.pid, "RssAnon") * 1024
    return rss, anon


def tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and its descendants now (0 once it has exited)."""
    return tree_memory(pid)[0]


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0
