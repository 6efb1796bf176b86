"""What every benchmark shares, so that each benchmark is the short file that says what it measures: a command run
with its whole process tree's memory sampled, the order contenders are timed in, the timing loops, the lock that
keeps two benchmarks from timing at once on a shared machine, and the table.

Benchmarks are scripts, not a package: they put the repository on sys.path and import ``benchmarks.harness``."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import psutil

GIB = 1 << 30
LOCK = Path(os.environ.get("DSTC_BENCH_LOCK", "/tmp/dstc-bench.lock"))
T = TypeVar("T")


# -- memory of a process tree ------------------------------------------------------------------------------------

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


@dataclass
class Measured:
    returncode: int
    wall_s: float
    peak_bytes: int  # the process tree's summed RSS, at its highest sample
    anon_peak_bytes: int
    output: str  # stdout and stderr together (empty where they went to a log file)
    over_budget: bool = False  # killed above max_rss
    timed_out: bool = False

    def last_line(self) -> str:
        lines = [line.strip() for line in self.output.strip().splitlines() if line.strip()]
        return (lines or ["no output"])[-1][:300]


def run_measured(cmd: Sequence[str], *, env: dict | None = None, cwd: Path | None = None, log: Path | None = None,
                 max_rss: int | None = None, timeout: float | None = None, every: float = 0.05,
                 on_sample: Callable[[float, int, int], None] | None = None) -> Measured:
    """Run ``cmd`` (``env`` added to this process's environment) in a session of its own, its process tree's RSS
    sampled every ``every`` seconds (``on_sample(seconds, rss, anon)`` sees each sample). Killed, with all its
    children, above ``max_rss`` bytes or after ``timeout`` seconds, and when this process is interrupted. Output to
    ``log`` or returned."""
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(log, "w")) if log else subprocess.PIPE
        proc = subprocess.Popen(list(cmd), cwd=cwd, env={**os.environ, **(env or {})}, stdout=sink,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        peak, anon_peak, over = [0], [0], [False]

        def sample() -> None:
            while proc.poll() is None:
                rss, anon = tree_memory(proc.pid)
                peak[0], anon_peak[0] = max(peak[0], rss), max(anon_peak[0], anon)
                if on_sample is not None:
                    on_sample(time.perf_counter() - started, rss, anon)
                if max_rss is not None and rss > max_rss:
                    over[0] = True
                    _kill(proc)
                time.sleep(every)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
            output, _ = proc.communicate()
        finally:
            if proc.poll() is None:  # interrupted here: the child's session would outlive us
                _kill(proc)
                proc.wait()
        sampler.join()
    return Measured(proc.returncode, round(time.perf_counter() - started, 2), peak[0], anon_peak[0], output or "",
                    over[0], timed_out)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# -- timing --------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def one_at_a_time(path: Path = LOCK) -> Iterator[None]:
    """Hold the machine's benchmark lock while timing: two benchmarks timing at once would each measure the other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {path} (another benchmark is timing)", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def alternation(contenders: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, contender) for ``rounds`` rounds over every contender, the order rotated each round, so that a slow
    phase of a shared machine falls on all of them alike and no contender always runs first."""
    items = list(contenders)
    for r in range(rounds):
        shift = r % len(items) if items else 0
        for item in items[shift:] + items[:shift]:
            yield r, item


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median ms of ``repeats`` runs of ``fn`` after ``warmup`` unmeasured ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def per_run_ms(fn: Callable[[], object], budget_s: float) -> float:
    """Mean ms of ``fn`` over as many back-to-back runs as fill ``budget_s`` (at least one): on a shared
    machine, one sample of a millisecond-long run is mostly the scheduler's noise."""
    runs, started = 0, time.perf_counter()
    while runs == 0 or time.perf_counter() - started < budget_s:
        fn()
        runs += 1
    return (time.perf_counter() - started) * 1e3 / runs


def prefill_ms(decoder, prompt: np.ndarray) -> float:
    """ms of one prefill of ``prompt`` [1, P] on a dstc Decoder (toolchain/runtime/decoder.py), its cache emptied."""
    decoder.reset()
    started = time.perf_counter()
    decoder.forward(prompt, np.ones_like(prompt))
    return (time.perf_counter() - started) * 1e3


def decode_ms(decoder, prompt: np.ndarray, steps: int) -> tuple[float, list[int]]:
    """Mean ms per greedy step on a dstc Decoder after prefilling ``prompt`` [1, P]; and the tokens."""
    decoder.reset()
    mask = np.ones_like(prompt)
    logits = decoder.forward(prompt, mask)
    tokens = []
    started = time.perf_counter()
    for _ in range(steps):
        token = logits[:, -1].argmax(-1)[:, None]
        tokens.append(int(token[0, 0]))
        mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
        logits = decoder.forward(token, mask)
    return (time.perf_counter() - started) * 1e3 / steps, tokens


# -- the table ------------------------------------------------------------------------------------------------------

def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (what the README and the closing notes paste); numbers right-aligned, text left."""
    cells = [[str(c) for c in header], *[[_cell(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric)) + "|"
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 0.01 and value else f"{value:.2f}"
    return "-" if value is None else str(value)


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
