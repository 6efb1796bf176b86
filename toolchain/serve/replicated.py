"""``dstc serve --replicas N [--ray ADDRESS]``: N engine replicas on Ray Serve behind this server's one endpoint.

The server (api.py, intake.py: the routes, API keys, limits, tokenization and errors of the single-engine server)
stays in the ``dstc serve`` process; ``ReplicatedEngine`` takes the place of its RemoteEngine, with the same
interface: admission (429 before a byte is sent; the bound is the replicas' slots and queues together), a request
submitted as a streaming call of Ray Serve's handle to the ``EngineReplica`` deployment (replica.py), its messages
delivered to the request's sink, and cancellation (the stream is cancelled, and so the request in its replica).

Ray Serve does the rest: it places the replicas (``num_cpus``: the replica's threads), routes each request
(replica_router.py: prompt-prefix affinity within a bound on queue length and KV-cache use), health-checks the
replicas every second and replaces one that died or whose engine died. The requests in flight on a replica that
dies end with an error (a 500, or an error event in a stream); the others complete; a request that arrives while
no replica runs waits in Ray Serve's router until one does.

Without ``--ray`` a local Ray is started for the process (this machine's CPUs) and shut down on exit; with it the
cluster at that address is joined and the application is deleted from it on exit (each node needs dstc installed
and the artifact at the same path). No Ray Serve HTTP proxy is started: this server is the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from toolchain.distributed.ray_cluster import connect_ray, shutdown_ray
from toolchain.errors import InputError
from toolchain.memory_guard import size
from toolchain.serve.engine import Event, NotReady, QueueFull, Request, wait_ready
from toolchain.serve.engine_options import EngineOptions
from toolchain.serve.replica import NOT_STARTED, EngineReplica, ReplicaSpec
from toolchain.serve.replica_board import replaced, running_replicas

HEALTH_CHECK_PERIOD_S = 1.0  # Ray Serve's check of each replica: a dead engine is found within this
HEALTH_CHECK_TIMEOUT_S = 10.0
ROUTING_STATS_PERIOD_S = 0.5  # how often each replica's load reaches the router, /health and /metrics
# a request whose replica's engine had died before it started is sent again (to another replica once the router
# knows, within a routing-stats period and a health check)
NOT_STARTED_ATTEMPTS = 10
NOT_STARTED_RETRY_S = 0.2


class ReplicatedEngine:
    """RemoteEngine's interface over N replicas on Ray Serve (see the module doc)."""

    def __init__(self, options: EngineOptions, *, replicas: int, address: str | None, max_queue: int,
                 memory_bytes: int, metrics) -> None:
        self.options = options
        self.memory_bytes = memory_bytes  # what one replica's engine holds (toolchain/memory_guard.py)
        self.target = replicas
        self.threads = options.threads
        self.address = address
        self.max_batch = options.max_batch
        self.max_queue = max_queue
        self.metrics = metrics  # ServerMetrics(replica_label=True): each replica's observations under its rank
        self.app_name = f"dstc-serve-{socket.gethostname()}-{os.getpid()}"
        self.state = "loading"
        self.load_error: str | None = None
        self.load_seconds: float | None = None
        self.pid = None  # the engines' processes are the replicas' (/health lists them)
        self.dispatch: Callable[[Callable[[], None]], None] = lambda deliver: deliver()
        self._ids = itertools.count(1)
        self._tasks: dict[int, asyncio.Task] = {}
        self._stream = None
        self._started_ray = False
        self._stopping = threading.Event()
        self._stopped = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._main, name="dstc-replicas", daemon=True).start()

    def _main(self) -> None:
        """Deploys, waits for stop(), shuts down. One thread for it all: the local Ray's processes die with the
        thread that started them (PR_SET_PDEATHSIG), so it lives as long as the server."""
        started = time.perf_counter()
        try:
            self._stream = self._run_application()
        except Exception as e:  # reported as the single engine's load error is: /health, then the CLI's exit
            self.load_error = str(e) if isinstance(e, InputError) else f"{type(e).__name__}: {e}"
            self.state = "failed"
        else:
            self.load_seconds = time.perf_counter() - started
            self.state = "ready"
            self._stopping.wait()
        try:
            self._shut_down()
        finally:
            if self.state != "failed":
                self.state = "stopped"
            self._stopped.set()

    def _run_application(self):
        import ray  # loaded when used: the single-engine server starts without it
        from ray import serve

        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines of each start on our stderr

        if self.address and self.address.startswith("ray://"):
            # Ray Client does not carry Ray Serve's streaming responses
            raise InputError(f"--ray {self.address}: Ray Client addresses cannot stream from Ray Serve; run dstc "
                             "serve on a node of the cluster (ray start --address HOST:PORT) with --ray auto")
        # a local Ray's workers at the server's own priority: Ray starts them at niceness 15 by default, below
        # whatever else runs on the machine, and a replica's engine process inherits it
        local = {} if self.address else {"_system_config": {"worker_niceness": 0}}
        # log_to_driver off: what Ray's processes print (Ray Serve's controller, the raylet's retries of the
        # controller's tasks as it is stopped) stays in Ray's session directory, out of the server's log; a request's
        # failure in a replica reaches the server as an exception, logged with the request's id
        self._started_ray = connect_ray(self.address, include_dashboard=False, log_to_driver=False, **local)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        threads = self.threads or max(1, cpus // self.target)
        if self.target * threads > cpus:
            where = f"the Ray cluster at {self.address}" if self.address else "this machine"
            raise InputError(f"--replicas {self.target} of {threads} threads each need {self.target * threads} "
                             f"CPUs; {where} has {cpus}")
        self._check_memory(ray.nodes())
        spec = ReplicaSpec(options=self.options, threads=threads, max_queue=self.max_queue)
        deployment = serve.deployment(
            name="engine", num_replicas=self.target,
            # Ray places a replica only on a node with the memory its engine holds
            ray_actor_options={"num_cpus": threads, "memory": self.memory_bytes},
            # a replica takes its running batch and its queue; Ray Serve holds the rest back in the router
            max_ongoing_requests=self.max_batch + self.max_queue,
            health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
            graceful_shutdown_timeout_s=5, max_constructor_retry_count=1,
            request_router_config={"request_router_class": "toolchain.serve.replica_router:LoadPrefixRouter",
                                   "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
                                   "request_routing_stats_timeout_s": 5},
            logging_config={"log_level": "WARNING", "enable_access_log": False})(EngineReplica)
        serve.start(proxy_location="Disabled")
        handle = serve.run(deployment.bind(spec), name=self.app_name, route_prefix=None)
        stream = handle.options(stream=True, method_name="generate")  # starts the handle's router
        # ready once the router has the replicas' first reports, which /health shows
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and \
                sum("state" in r for r in running_replicas(self.app_name)) < self.target:
            time.sleep(0.05)
        return stream

    def _check_memory(self, nodes: list[dict]) -> None:
        """InputError, before any replica starts, when the cluster's nodes cannot hold ``target`` engines (Ray's
        "memory" resource of each node: what it leaves to tasks and actors), instead of replicas waiting forever
        for a node to place them on."""
        fit = sum(int(node["Resources"].get("memory", 0) // self.memory_bytes) for node in nodes if node["Alive"])
        if fit < self.target:
            where = f"the Ray cluster at {self.address}" if self.address else "this machine's Ray"
            raise InputError(f"--replicas {self.target} need {size(self.memory_bytes)} of memory each; {where} "
                             f"has room for {fit} (Ray's memory resource of each node): run fewer replicas or "
                             "add nodes")

    def stop(self, timeout: float = 30.0) -> None:
        """Cancels the requests in flight and waits for the application's deletion from a cluster, or for a local
        Ray's shutdown (shutdown_ray)."""
        for task in list(self._tasks.values()):
            task.cancel()
        self._stopping.set()
        self._stopped.wait(timeout)

    def _shut_down(self) -> None:
        import ray  # loaded by _run_application already

        if self._started_ray:
            # the replicas, Ray Serve's controller and Ray at once, their requests cancelled already (stop());
            # serve.shutdown() first waited out each replica's grace period, and its controller's task killed on
            # the way was reported on stdout as a failure
            shutdown_ray()
        elif ray.is_initialized():  # a cluster others may use: only this server's application goes
            with contextlib.suppress(Exception):
                from ray import serve

                serve.delete(self.app_name)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return wait_ready(self, timeout)

    # -- the Engine's interface (on the event loop) -----------------------------------------------------------

    def submit(self, request: Request) -> int:
        if self.state != "ready" or self._stream is None:
            raise NotReady(self.load_error or f"the replicas are {self.state}")
        in_flight = len(self._tasks)
        capacity = self.target * (self.max_batch + self.max_queue)
        if in_flight >= capacity:
            raise QueueFull(in_flight - self.target * self.max_batch, 1)
        request.id = next(self._ids)
        self._tasks[request.id] = asyncio.get_running_loop().create_task(self._run(request, self._stream))
        return request.id

    def cancel(self, request_id: int) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _run(self, request: Request, stream) -> None:
        try:
            for attempt in range(1, NOT_STARTED_ATTEMPTS + 1):
                if await self._attempt(request, stream, last=attempt == NOT_STARTED_ATTEMPTS):
                    return
                await asyncio.sleep(NOT_STARTED_RETRY_S)
        except Exception as e:  # the replica died under it, or Ray failed the call: the API layer logs why
            from ray.exceptions import RayActorError  # loaded with Ray Serve already

            request.finished = True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = f"its replica died ({type(e).__name__}: {first})" if isinstance(e, RayActorError) else \
                f"{type(e).__name__}: {e}"
            request.sink(Event([], "error", why))
        finally:
            self._tasks.pop(request.id, None)

    async def _attempt(self, request: Request, stream, *, last: bool) -> bool:
        """The request on the replica Ray Serve routes it to; False when that replica's engine was not running
        (it died, and Ray Serve's health check has not yet replaced the replica) and ``last`` is not set: nothing
        was generated, so it goes to a replica again."""
        s = request.sampling
        responses = stream.remote(request.prompt, request.max_tokens, (s.temperature, s.top_p, s.seed),
                                  tuple(request.stop_ids), request.ignore_eos)
        try:
            async for rank, tokens, finish, error, observations in responses:
                observer = self.metrics.replica(str(rank))
                for kind, *args in observations:
                    getattr(observer, kind)(*args)
                if finish == NOT_STARTED:
                    if not last:
                        return False
                    finish = "error"
                request.record(tokens, finish, time.perf_counter())
                request.sink(Event(list(tokens), finish, error))
                if finish is not None:
                    return True
            raise RuntimeError("the replica's stream ended before its request finished")
        except asyncio.CancelledError:  # the client went away: the replica cancels it in its engine
            responses.cancel()
            raise

    # -- what /health and /metrics read ------------------------------------------------------------------------

    def replica_stats(self) -> list[dict]:
        """Each running replica: its rank as ``replica``, ``state`` (ready, or starting before its first report)
        and its figures (replica.py's record_routing_stats), as the router last saw them."""
        if self.state != "ready":
            return []
        replicas = []
        for stats in running_replicas(self.app_name):
            state = stats.get("state", "starting")
            replicas.append({**stats, "replica": str(stats.get("rank", "?")), "state": state})
        return sorted(replicas, key=lambda r: r["replica"])

    @property
    def restarts(self) -> int:
        """Replicas that were replaced."""
        return replaced(self.app_name, self.target)

    @property
    def engine_name(self) -> str | None:
        return next((r.get("engine") for r in self.replica_stats() if r.get("engine")), None)

    @property
    def queue_depth(self) -> int:
        return sum(int(r.get("queue_depth") or 0) for r in self.replica_stats())

    @property
    def running(self) -> int:
        return sum(int(r.get("running") or 0) for r in self.replica_stats())

    def kv_cache_usage(self) -> float:
        usage = [float(r.get("kv_cache_usage") or 0.0) for r in self.replica_stats()]
        return sum(usage) / len(usage) if usage else 0.0
