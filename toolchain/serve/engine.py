"""The scheduling loop both backends share: admission with bounds, a thread that runs decode steps, requests that
join and leave the running batch between steps, cancellation, and the per-token timings the metrics need.

A backend (engine_openvino.py, engine_runner.py) provides ``load()``, ``add(requests)`` (start them; may
already return their first tokens), ``drop(requests)`` (free them at once), ``step()`` (one decode step of every
running request: ``[(request, new tokens, finish reason or None)]``; a request reported finished is already freed),
``reset()`` (forget every request, after an error), ``kv_cache_usage()`` (0..1) and ``close()``; one that decodes
speculatively also has ``drafted``, each request's (drafts proposed or None if unknown, accepted) in its last
step. Every call to it comes from the engine's thread.

One request never fails another: a backend finishes a request whose own sampling or prefill raises with
``"error"`` (its ``error`` the traceback) and goes on with the others. What the engine catches itself fails only
the requests it concerns: an ``add`` that raises, the requests joining; a ``step`` that raises, the running batch
(a batched step cannot tell whose it was).

Each request's events go to its ``sink``: ``Event(tokens, finish, error)``, all of one step's through one call of
``dispatch`` (the API layer sets it to schedule them on its event loop: one wake-up per step, not per token). A finish
reason is ``"stop"`` (a stop token), ``"length"`` (max tokens or the context), ``"cancelled"`` or ``"error"``.
``after_iteration``, when set, runs on the engine's thread after each iteration (engine_process.py sends the step's
events and figures to the server process there).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from toolchain.runtime.sampling import Sampling


def wait_ready(engine, timeout: float | None = None) -> bool:
    """Wait while ``engine`` (any of serve's engines: its ``state``) is loading; whether it is ready."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while engine.state == "loading":
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return engine.state == "ready"


class QueueFull(Exception):
    """More requests are waiting for a slot than the server's bound allows."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{waiting} requests are already waiting for a slot")
        self.retry_after_s = retry_after_s


class NotReady(Exception):
    """The model is still loading (or failed to load)."""


@dataclass(frozen=True)
class Event:
    tokens: list[int]
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    sink: Callable[[Event], None]
    ignore_eos: bool = False
    id: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    # set by the engine
    generated: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    finished: bool = False
    error: str | None = None  # why a backend finished it with "error": a traceback, for the server's log
    state: Any = None  # the backend's own (a handle, a random generator, the last token)

    def record(self, tokens, finish: str | None, now: float) -> None:
        """A step's tokens and finish reason from an engine that runs the request elsewhere (a child process, a
        replica): the timings and counts the metrics read."""
        if tokens:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.generated += len(tokens)
        if finish is not None:
            self.finished = True


def failure(e: BaseException) -> str:
    """The traceback of an error that failed a request (the server logs it; the client is told only its id)."""
    return "".join(traceback.format_exception(e)).rstrip()


def deliver_events(events: list[tuple[Request, Event]]) -> None:
    """Each event to its request's sink (a dispatch of one step's events)."""
    for request, event in events:
        request.sink(event)


class Observer:
    """What the engine reports as it runs (toolchain/serve/metrics.py implements it)."""

    def first_token(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float, tokens: int) -> None: ...
    def tokens(self, prompt: int, generated: int) -> None: ...
    def finished(self, reason: str) -> None: ...
    def step(self, seconds: float, batch: int) -> None: ...
    def drafts(self, proposed: int | None, accepted: int) -> None: ...


class Engine:
    """Runs a backend in a thread of its own; ``submit`` and ``cancel`` are safe from any thread."""

    def __init__(self, backend, *, max_batch: int, max_queue: int, observer: Observer | None = None) -> None:
        self.backend = backend
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.observer = observer or Observer()
        self.state = "loading"  # loading | ready | failed | stopped
        self.load_error: str | None = None
        self.load_seconds: float | None = None
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._pending: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._cancelled: set[int] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="dstc-engine", daemon=True)
        self._durations: collections.deque[float] = collections.deque(maxlen=64)  # seconds per finished request
        self.dispatch: Callable[[Callable[[], None]], None] = lambda deliver: deliver()
        self.after_iteration: Callable[[], None] | None = None

    # -- from any thread ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> int:
        """Queue a request (its id is returned); QueueFull when the bound is reached, NotReady while loading."""
        with self._cv:
            if self.state != "ready":
                raise NotReady(self.load_error or f"the model is {self.state}")
            in_flight = len(self._pending) + len(self._running)
            if in_flight >= self.max_batch + self.max_queue:
                raise QueueFull(len(self._pending), self._retry_after(in_flight))
            if not request.id:
                request.id = next(self._ids)
            self._pending.append(request)
            self._cv.notify()
        return request.id

    def cancel(self, request_id: int) -> None:
        """Free the request's slot before the next step (a client that went away); nothing more is sent to it."""
        with self._cv:
            self._cancelled.add(request_id)
            self._cv.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    def kv_cache_usage(self) -> float:
        try:
            return float(self.backend.kv_cache_usage()) if self.state == "ready" else 0.0
        except Exception:  # a scrape must not fail because the backend is between states
            return 0.0

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return wait_ready(self, timeout)

    def _retry_after(self, in_flight: int) -> int:
        """Seconds until a slot is likely free: the mean request duration so far times the requests ahead per slot."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, min(60, round(mean * (in_flight - self.max_batch + 1) / self.max_batch + 0.5)))

    # -- the engine's thread -----------------------------------------------------------------------------------

    def _main(self) -> None:
        started = time.perf_counter()
        try:
            self.backend.load()
        except Exception as e:  # reported by /health and the CLI; the server does not serve without a model
            self.load_error = f"{type(e).__name__}: {e}"
            self.state = "failed"
            return
        self.load_seconds = time.perf_counter() - started
        self.state = "ready"
        try:
            while self._iteration():
                if self.after_iteration is not None:
                    self.after_iteration()
        finally:
            with self._cv:
                self.state = "stopped"
                leftovers = list(self._pending) + self._running
                self._pending.clear()
                self._running = []
            for request in leftovers:
                self._finish(request, "cancelled", notify=True)
            if self.after_iteration is not None:
                self.after_iteration()
            with contextlib.suppress(Exception):
                self.backend.close()

    def _iteration(self) -> bool:
        with self._cv:
            while not self._stop and not self._pending and not self._running and not self._cancelled:
                self._cv.wait()
            if self._stop:
                return False
            cancelled, self._cancelled = self._cancelled, set()
            gone = [r for r in self._running if r.id in cancelled]
            self._running = [r for r in self._running if r.id not in cancelled]
            for request in [r for r in self._pending if r.id in cancelled]:
                self._pending.remove(request)
                gone.append(request)
            admitted: list[Request] = []
            while self._pending and len(self._running) + len(admitted) < self.max_batch:
                admitted.append(self._pending.popleft())
            self._running += admitted
        for request in gone:  # told too: a RemoteEngine counts its requests in flight by their last event
            self._finish(request, "cancelled", notify=True)
        for request in admitted:
            self.observer.tokens(len(request.prompt), 0)
        # the server never dies on a request: what raises fails the requests it concerns, and the engine goes on
        if gone:
            try:
                self.backend.drop([r for r in gone if r.state is not None])
            except Exception as e:
                self._fail(list(self._running), e, reset=True)
        if admitted:
            try:
                self._deliver(self.backend.add(admitted))
            except Exception as e:
                self._fail(admitted, e)
        if self._running:
            try:
                started = time.perf_counter()
                results = self.backend.step()
                self.observer.step(time.perf_counter() - started, len(self._running))
                for proposed, accepted in getattr(self.backend, "drafted", ()):
                    self.observer.drafts(proposed, accepted)
                self._deliver(results)
            except Exception as e:
                self._fail(list(self._running), e)
        return True

    def _fail(self, requests: list[Request], e: Exception, *, reset: bool = False) -> None:
        """Finish ``requests`` with an error and free them in the backend. When that fails too (or ``reset``), the
        backend's state is unknown: start it again clean, failing every request it held."""
        failed = {r.id: r for r in requests if not r.finished}
        with self._cv:
            self._running = [r for r in self._running if r.id not in failed]
        if not reset:
            try:
                self.backend.drop([r for r in failed.values() if r.state is not None])
            except Exception:
                reset = True
        if reset:
            self.backend.reset()
            with self._cv:
                failed.update((r.id, r) for r in self._running)
                self._running = []
        error = failure(e)
        for request in failed.values():
            self._finish(request, "error", notify=True, error=error)

    def _send(self, events: list[tuple[Request, Event]]) -> None:
        if events:
            self.dispatch(partial(deliver_events, events))

    def _deliver(self, results) -> None:
        now = time.perf_counter()
        done, events = [], []
        for request, tokens, finish in results:
            if request.finished:
                continue
            if tokens:
                if request.first_token_at is None:
                    request.first_token_at = now
                    self.observer.first_token(now - request.arrived)
                    if len(tokens) > 1:
                        self.observer.inter_token(0.0, len(tokens) - 1)
                else:
                    self.observer.inter_token((now - request.last_token_at) / len(tokens), len(tokens))
                request.last_token_at = now
                request.generated += len(tokens)
                self.observer.tokens(0, len(tokens))
            if finish is not None:
                done.append(request)
                request.finished = True
                events.append((request, Event(list(tokens), finish, request.error)))
                self._finish(request, finish, notify=False)
            elif tokens:
                events.append((request, Event(list(tokens))))
        self._send(events)
        if done:
            with self._cv:
                self._running = [r for r in self._running if not r.finished]

    def _finish(self, request: Request, reason: str, *, notify: bool, error: str | None = None) -> None:
        request.finished = True
        self._durations.append(time.perf_counter() - request.arrived)
        self.observer.finished(reason)
        if notify:
            self._send([(request, Event([], reason, error))])
