"""The engine in a child process of its own, so that the HTTP server's event loop never waits for a decode step.

Why: openvino_genai's ``ContinuousBatchingPipeline.step()`` holds Python's GIL for the whole step (measured with
openvino_genai 2026.4: a thread sleeping 1 ms wakes only when a 20-84 ms prefill step has returned, with a core
free), so in one process the event loop could read requests and send tokens only between steps: streams arrived
in bursts and time to first token grew with the batch. ONNX Runtime releases the GIL, but the child costs it nothing
and keeps a native crash of either runtime away from the server: the server fails the requests in flight with an
error, starts a new engine process and goes on (``/health`` says ``loading`` meanwhile).

``RemoteEngine`` (in the server) has the Engine's interface: admission with the same bounds is decided here, at
once (429 before a byte is sent); submissions and cancellations go to the child over a socket pair as pickled
tuples; the child sends one message per engine iteration with that step's events, the metrics observations and the
engine's figures (queue depth, running batch, KV-cache use).

The child is ``python -m toolchain.serve.engine_process FD``, not a multiprocessing spawn (which would import and
run ``python -m toolchain``'s __main__ again).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from typing import TypedDict

from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.sampling import Sampling
from toolchain.serve.engine import Engine, Event, NotReady, Observer, QueueFull, Request, deliver_events, wait_ready
from toolchain.serve.engine_openvino import OpenVINOBackend
from toolchain.serve.engine_options import GENAI, EngineOptions
from toolchain.serve.engine_runner import RunnerBackend

RESTART_DELAY_S = 0.5
log = logging.getLogger("dstc.serve")


def make_backend(options: EngineOptions):
    """The backend object of toolchain/serve/engine.py that ``options`` name (in the engine's process)."""
    artifact = open_artifact(options.artifact)
    if options.engine == GENAI:
        return OpenVINOBackend(artifact, options.pipeline_settings())
    return RunnerBackend(artifact, options)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Stats(TypedDict):
    queue_depth: int
    running: int
    kv_cache_usage: float


class RemoteEngine:
    """The Engine's interface over an engine process (see the module doc)."""

    def __init__(self, options: EngineOptions, *, max_queue: int, observer: Observer | None = None,
                 restart: bool = True) -> None:
        self.options = options
        self.max_batch = options.max_batch
        self.max_queue = max_queue
        self.observer = observer or Observer()
        self.state = "loading"
        self.load_error: str | None = None
        self.load_seconds: float | None = None
        self.engine_name: str | None = None  # the backend the child chose for the artifact (its ``name``)
        self.restarts = 0
        # False: an engine process that dies leaves the engine "failed" (a replica of dstc serve --replicas: Ray
        # Serve's health check replaces the whole replica, replica.py)
        self.restart = restart
        self.dispatch: Callable[[Callable[[], None]], None] = lambda deliver: deliver()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._requests: dict[int, Request] = {}
        self._stats: _Stats = {"queue_depth": 0, "running": 0, "kv_cache_usage": 0.0}
        self._durations: collections.deque[float] = collections.deque(maxlen=64)
        self._stopping = False
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn()

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen([sys.executable, "-m", "toolchain.serve.engine_process", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(self.options.model_dump())  # data: validated again in the engine process
        threading.Thread(target=self._read, args=(self._conn, self._process), name="dstc-engine-reader",
                         daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        with contextlib.suppress(OSError, AttributeError):
            self._send(("stop",))
        process = self._process
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return wait_ready(self, timeout)

    # -- the Engine's interface --------------------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        with self._lock:
            if self.state != "ready":
                raise NotReady(self.load_error or f"the model is {self.state}")
            in_flight = len(self._requests)
            if in_flight >= self.max_batch + self.max_queue:
                raise QueueFull(max(0, in_flight - self.max_batch), self._retry_after(in_flight))
            request.id = next(self._ids)
            self._requests[request.id] = request
            s = request.sampling
            try:
                self._send(("submit", request.id, request.prompt, request.max_tokens, (s.temperature, s.top_p, s.seed),
                            tuple(request.stop_ids), request.ignore_eos, request.arrived))
            except OSError:
                del self._requests[request.id]
                raise NotReady("the engine process is restarting") from None
        return request.id

    def cancel(self, request_id: int) -> None:
        with contextlib.suppress(OSError):  # the engine process is gone; its requests were failed already
            self._send(("cancel", request_id))

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (admitted here, so counted here at once)."""
        return len(self._requests)

    @property
    def queue_depth(self) -> int:
        return self._stats["queue_depth"]

    @property
    def running(self) -> int:
        return self._stats["running"]

    def kv_cache_usage(self) -> float:
        return self._stats["kv_cache_usage"] if self.state == "ready" else 0.0

    def _retry_after(self, in_flight: int) -> int:
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, min(60, round(mean * (in_flight - self.max_batch + 1) / self.max_batch + 0.5)))

    def _send(self, message) -> None:
        with self._send_lock:
            if self._conn is None:
                raise OSError("the engine process was never started")
            self._conn.send(message)

    # -- the reader thread -------------------------------------------------------------------------------------

    def _read(self, conn: Connection, process: subprocess.Popen) -> None:
        try:
            while True:
                message = conn.recv()
                if message[0] == "state":
                    _, state, load_seconds, load_error, self.engine_name = message
                    self.load_seconds, self.load_error = load_seconds, load_error
                    self.state = state
                elif message[0] == "step":
                    self._on_step(*message[1:])
        except (EOFError, OSError):
            pass
        self._gone(conn, process)

    def _on_step(self, events, observations, stats) -> None:
        self._stats = stats
        for kind, *args in observations:
            getattr(self.observer, kind)(*args)
        now = time.perf_counter()
        deliveries = []
        with self._lock:
            for request_id, tokens, finish, error in events:
                request = self._requests.get(request_id)
                if request is None:
                    continue
                request.record(tokens, finish, now)
                if finish is not None:
                    del self._requests[request_id]
                    self._durations.append(now - request.arrived)
                deliveries.append((request, Event(tokens, finish, error)))
        if deliveries:
            self.dispatch(partial(deliver_events, deliveries))

    def _gone(self, conn: Connection, process: subprocess.Popen) -> None:
        try:
            code = process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        conn.close()
        reason = _exit_reason(code)
        with self._lock:
            failed = list(self._requests.values())
            self._requests.clear()
            self._stats = {"queue_depth": 0, "running": 0, "kv_cache_usage": 0.0}
            was = self.state
            if self._stopping:
                self.state = "stopped"
            elif was == "ready" and self.restart:
                self.state = "loading"
            elif was == "ready":
                self.state = "failed"
                self.load_error = f"the engine process died ({reason})"
            elif was == "loading":
                self.state = "failed"
                self.load_error = self.load_error or f"the engine process died while loading the model ({reason})"
        for request in failed:
            request.finished = True
            self.observer.finished("cancelled" if self._stopping else "error")
        if failed:
            message = "the server is shutting down" if self._stopping else f"the engine process died ({reason})"
            events = [(r, Event([], "cancelled" if self._stopping else "error", message)) for r in failed]
            self.dispatch(partial(deliver_events, events))
        if not self._stopping and was == "ready" and self.restart:
            # the server's log, one write per line (print's two could interleave with a request's error line)
            log.warning("dstc serve: the engine process died (%s); %d requests failed; restarting it", reason,
                        len(failed))
            self.restarts += 1
            time.sleep(RESTART_DELAY_S)
            self._spawn()


# -- the engine process ------------------------------------------------------------------------------------------


class _Recorder(Observer):
    """Observations of one iteration, sent with its events."""

    def __init__(self) -> None:
        self.items: list[tuple] = []

    def first_token(self, seconds: float) -> None:
        self.items.append(("first_token", seconds))

    def inter_token(self, seconds: float, tokens: int) -> None:
        self.items.append(("inter_token", seconds, tokens))

    def tokens(self, prompt: int, generated: int) -> None:
        self.items.append(("tokens", prompt, generated))

    def finished(self, reason: str) -> None:
        self.items.append(("finished", reason))

    def step(self, seconds: float, batch: int) -> None:
        self.items.append(("step", seconds, batch))

    def drafts(self, proposed: int | None, accepted: int) -> None:
        self.items.append(("drafts", proposed, accepted))


def worker(fd: int) -> None:
    """The engine process: reads its options, loads the backend, serves submissions and cancellations until told to
    stop or the server goes away."""
    # Ctrl-C, and a SIGTERM sent to the process group, reach this process too: the server stops it (and when the
    # server is gone, the socket's end of file does)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    options = EngineOptions.model_validate(conn.recv())
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    recorder = _Recorder()
    try:
        backend = make_backend(options)
    except Exception as e:
        send(("state", "failed", None, f"{type(e).__name__}: {e}", None))
        return
    engine = Engine(backend, max_batch=options.max_batch, max_queue=1 << 30, observer=recorder)
    outbox: list[tuple] = []  # filled and sent on the engine's thread

    def flush() -> None:
        items, recorder.items = recorder.items, []
        events = list(outbox)
        outbox.clear()
        with contextlib.suppress(OSError):  # the server has gone
            send(("step", events, items, {"queue_depth": engine.queue_depth, "running": engine.running,
                                          "kv_cache_usage": engine.kv_cache_usage()}))

    engine.after_iteration = flush
    engine.start()
    engine.wait_ready()
    send(("state", engine.state, engine.load_seconds, engine.load_error, backend.name))
    if engine.state != "ready":
        return
    try:
        while True:
            message = conn.recv()
            if message[0] == "submit":
                _, request_id, prompt, max_tokens, (temperature, top_p, seed), stop_ids, ignore_eos, arrived = message

                def sink(event: Event, request_id=request_id) -> None:
                    outbox.append((request_id, event.tokens, event.finish, event.error))

                engine.submit(Request(prompt=prompt, max_tokens=max_tokens, id=request_id, arrived=arrived,
                                      sampling=Sampling(temperature=temperature, top_p=top_p, seed=seed),
                                      stop_ids=frozenset(stop_ids), ignore_eos=ignore_eos, sink=sink))
            elif message[0] == "cancel":
                engine.cancel(message[1])
            elif message[0] == "stop":
                break
    except (EOFError, OSError):
        pass
    engine.stop()


if __name__ == "__main__":
    worker(int(sys.argv[1]))
