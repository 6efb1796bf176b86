"""One replica of ``dstc serve --replicas N``: a Ray Serve deployment whose replicas each run dstc's engine
(engine_process.py: the engine in a child process of the replica, so that a decode step holding the GIL never
stalls the replica's event loop, where Ray Serve's health checks and queue-length probes are answered) on a core set
of their own.

The replica pins itself, and so the engine process it starts, to the cores of its rank on its node (``core_set``:
the node's CPUs in NUMA-node order, ``threads`` of them from ``local_rank * threads``), and the runtime runs that many
threads. A request is ``generate(prompt ids, ...)``: a stream of ``(rank, tokens, finish, error, observations)``
messages, the tokens of one or more engine steps and the engine's metrics observations since the last message
(toolchain/serve/replicated.py feeds them to the server's metrics under the replica's label). A stream cancelled by
the server (its client went away) cancels the request in the engine.

An engine process that dies is not started again here (RemoteEngine(restart=False)): its requests end with an
error, ``check_health`` raises and Ray Serve replaces the replica, as it does one whose own process died.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from toolchain.runtime.sampling import Sampling
from toolchain.serve.engine import Event, NotReady, Observer, QueueFull, Request
from toolchain.serve.engine_options import EngineOptions
from toolchain.serve.engine_process import RemoteEngine

NODE_CPUS = Path("/sys/devices/system/node")
NOT_STARTED = "not_started"  # a stream's finish when the replica's engine could not take the request


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica is given (pickled to it by Ray Serve)."""

    options: EngineOptions  # as the single-engine server gives RemoteEngine (threads set here)
    threads: int
    max_queue: int


def _cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def numa_cpus() -> list[list[int]]:
    """Each NUMA node's CPUs (one list of all CPUs where the kernel shows no nodes)."""
    nodes = sorted(NODE_CPUS.glob("node[0-9]*"), key=lambda p: int(p.name[4:])) if NODE_CPUS.exists() else []
    found = [_cpu_list((node / "cpulist").read_text()) for node in nodes if (node / "cpulist").exists()]
    return [cpus for cpus in found if cpus] or [sorted(os.sched_getaffinity(0))]


def core_set(local_rank: int, threads: int, allowed: set[int], nodes: list[list[int]]) -> list[int]:
    """The cores of the replica of ``local_rank`` on its node: ``threads`` consecutive cores of the allowed ones in
    NUMA-node order, from ``local_rank * threads`` (wrapping round when the replicas outnumber them), so that a
    replica's cores share a NUMA node whenever ``threads`` divides a node's cores."""
    ordered = [cpu for node in nodes for cpu in node if cpu in allowed]
    ordered += sorted(allowed - set(ordered))
    if threads >= len(ordered):
        return ordered
    start = local_rank * threads
    return sorted(ordered[(start + i) % len(ordered)] for i in range(threads))


def pin_process(cores: list[int]) -> None:
    """Every thread of this process on ``cores``; threads and processes started later inherit it."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has just ended
            os.sched_setaffinity(int(task), cores)


class _Recorder(Observer):
    """The engine's observations (from its reader thread) until the next message of any stream takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple] = []

    def _add(self, *item) -> None:
        with self._lock:
            self._items.append(item)

    def first_token(self, seconds: float) -> None:
        self._add("first_token", seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        self._add("inter_token", seconds, tokens)

    def tokens(self, prompt: int, generated: int) -> None:
        self._add("tokens", prompt, generated)

    def finished(self, reason: str) -> None:
        self._add("finished", reason)

    def step(self, seconds: float, batch: int) -> None:
        self._add("step", seconds, batch)

    def drafts(self, proposed: int | None, accepted: int) -> None:
        self._add("drafts", proposed, accepted)

    def take(self) -> list[tuple]:
        with self._lock:
            items, self._items = self._items, []
        return items


class EngineReplica:
    """The deployment's class (toolchain/serve/replicated.py deploys it with Ray Serve's options)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from ray import serve  # loaded in the replica's process, where Ray Serve runs it

        context = serve.get_replica_context()
        self.rank = context.rank.rank
        self.cores = core_set(context.rank.local_rank, spec.threads, os.sched_getaffinity(0), numa_cpus())
        pin_process(self.cores)
        self.recorder = _Recorder()
        self.engine = RemoteEngine(spec.options.model_copy(update={"threads": len(self.cores)}),
                                   max_queue=spec.max_queue, observer=self.recorder,
                                   restart=False)
        self.engine.start()
        # Ray Serve routes to a replica once its constructor has returned: the model is loaded by then
        if not self.engine.wait_ready():
            raise RuntimeError(f"the model failed to load: {self.engine.load_error}")

    async def generate(self, prompt: list[int], max_tokens: int, sampling: tuple, stop_ids: tuple,
                       ignore_eos: bool) -> AsyncIterator[tuple]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        temperature, top_p, seed = sampling

        def sink(event: Event) -> None:  # on the engine's reader thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        request = Request(prompt=list(prompt), max_tokens=max_tokens, stop_ids=frozenset(stop_ids),
                          sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed), ignore_eos=ignore_eos,
                          arrived=time.perf_counter(), sink=sink)
        try:
            self.engine.submit(request)
        except NotReady as e:  # its engine died: the server sends it to a replica again (replicated.py)
            yield self.rank, [], NOT_STARTED, f"replica {self.rank}: {e}", self.recorder.take()
            return
        except QueueFull as e:  # Ray Serve keeps to max_ongoing_requests: not expected
            yield self.rank, [], "error", f"replica {self.rank}: {e}", self.recorder.take()
            return
        try:
            while True:
                event = await queue.get()
                tokens, finish, error = list(event.tokens), event.finish, event.error
                # the steps that arrived meanwhile go in one message: a slow reader costs messages, not steps
                while finish is None and not queue.empty():
                    more = queue.get_nowait()
                    tokens += more.tokens
                    finish, error = more.finish, more.error
                yield self.rank, tokens, finish, error, self.recorder.take()
                if finish is not None:
                    return
        finally:
            if not request.finished:  # the server cancelled the stream: its client went away
                self.engine.cancel(request.id)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine process died is replaced."""
        if self.engine.state != "ready":
            raise RuntimeError(f"replica {self.rank}: the engine is {self.engine.state}: {self.engine.load_error}")

    def record_routing_stats(self) -> dict:
        """What the request router (replica_router.py) and the server's /health and /metrics read of this replica."""
        engine = self.engine
        return {"rank": self.rank, "pid": os.getpid(), "engine_pid": engine.pid, "cores": self.cores,
                "engine": engine.engine_name, "state": engine.state, "load_seconds": engine.load_seconds,
                "queue_depth": engine.queue_depth, "running": engine.running,
                "kv_cache_usage": engine.kv_cache_usage(), "in_flight": engine.in_flight}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.stop(timeout=5)
