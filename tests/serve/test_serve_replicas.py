"""dstc serve --replicas N: engine replicas on Ray Serve (a local Ray started by the server) behind one endpoint,
each pinned to a core of its own; routing by prompt prefix within a bound on load; /health and /metrics over the
replicas; a replica killed under load fails its own requests only and is replaced; a server stopped leaves none of
its Ray's processes behind.

The routing and pinning rules are checked in process (fast); the servers, each with a local Ray of its own, in
child processes (slow: Ray and Ray Serve take 20-30 s to start on 2 cores)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from serve_helpers import ROOT, Server, build_artifacts

from toolchain.distributed.ray_cluster import sigterm_exits
from toolchain.serve.replica import _cpu_list, core_set

openai = pytest.importorskip("openai")


# -- in process ------------------------------------------------------------------------------------------------


def test_each_replica_gets_its_own_cores_in_numa_order():
    two_nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    allowed = set(range(8))
    assert [core_set(rank, 1, {0, 1}, [[0, 1]]) for rank in range(2)] == [[0], [1]]  # this machine's case
    assert [core_set(rank, 2, allowed, two_nodes) for rank in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [core_set(rank, 4, allowed, two_nodes) for rank in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # more replicas than cores: round again; a mask that leaves some cores out; more threads than cores
    assert core_set(2, 1, {0, 1}, [[0, 1]]) == [0]
    assert core_set(1, 2, {2, 3, 6, 7}, two_nodes) == [6, 7]
    assert core_set(0, 4, {0, 1}, [[0, 1]]) == [0, 1]
    assert _cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_replicas_that_no_node_has_the_memory_for_are_refused_before_any_starts():
    from toolchain.errors import InputError
    from toolchain.serve.engine_options import EngineOptions
    from toolchain.serve.replicated import ReplicatedEngine

    gib = 2**30
    options = EngineOptions(artifact="a", engine="dstc", threads=1, max_batch=1, max_context=64)
    engine = ReplicatedEngine(options, replicas=3, address="10.0.0.1:6379", max_queue=1, memory_bytes=2 * gib,
                              metrics=None)
    node = lambda memory, alive=True: {"Alive": alive, "Resources": {"memory": memory}}  # noqa: E731
    engine._check_memory([node(4.5 * gib), node(2 * gib)])  # 2 + 1 engines fit
    # per node, not in sum: 3 x 1.5 GiB hold no 2 GiB engine; a dead node holds none
    for nodes, fit in (([node(4.5 * gib), node(1.5 * gib), node(1.5 * gib)], 2),
                       ([node(4.5 * gib), node(8 * gib, alive=False)], 2), ([], 0)):
        with pytest.raises(InputError, match=f"^--replicas 3 need 2.0 GiB of memory each; the Ray cluster at "
                                             f"10.0.0.1:6379 has room for {fit} "):
            engine._check_memory(nodes)


def test_the_router_prefers_the_replica_holding_the_prompt_prefix_unless_it_is_overloaded():
    import asyncio
    from types import SimpleNamespace

    from toolchain.serve.replica_router import LoadPrefixRouter, block_hashes

    assert len(block_hashes(list(range(40)), 16)) == 2
    assert block_hashes(list(range(32)), 16)[0] == block_hashes(list(range(16)) + [99] * 16, 16)[0]
    assert block_hashes(list(range(32)), 16)[1] != block_hashes(list(range(16)) + [99] * 16, 16)[1]

    class Router(LoadPrefixRouter):
        """The ranking alone: no Ray Serve around it (queue lengths and replicas set here)."""

        def __init__(self, queues: dict) -> None:
            self.queues = queues
            self._deployment_id = None
            self.initialize_state(block_tokens=4, max_imbalance=2)

        @property
        def replica_queue_len_cache(self):
            return SimpleNamespace(get=self.queues.get)

    a = SimpleNamespace(replica_id="a", routing_stats={"kv_cache_usage": 0.1})
    b = SimpleNamespace(replica_id="b", routing_stats={"kv_cache_usage": 0.2})
    prompt = list(range(12))

    def request(ids):
        return SimpleNamespace(args=(ids, 8))

    router = Router({"a": 0, "b": 0})
    assert asyncio.run(router.choose_replicas([a, b], request(prompt))) == [[a, b], [a, b]]  # no history
    router.on_request_routed(request(prompt), "b", None)
    assert asyncio.run(router.choose_replicas([a, b], request([*prompt, 7])))[0] == [b]
    assert asyncio.run(router.choose_replicas([a, b], request([*prompt[:4], 5, 5, 5, 5])))[0] == [b]
    assert asyncio.run(router.choose_replicas([a, b], request([9] * 12)))[0] == [a, b]  # nothing shared
    router.queues["b"] = 3  # 3 more in flight than a: past max_imbalance, the prefix waits
    assert asyncio.run(router.choose_replicas([a, b], request(prompt)))[0] == [a, b]
    router.queues["b"] = 0
    b.routing_stats["kv_cache_usage"] = 0.95  # a nearly full KV cache: last rank only
    assert asyncio.run(router.choose_replicas([a, b], request(prompt))) == [[a], [a, b]]
    b.routing_stats.update(kv_cache_usage=0.2, state="failed")  # its engine died: left out until replaced
    assert asyncio.run(router.choose_replicas([a, b], request(prompt))) == [[a], [a]]


@pytest.mark.subprocess  # a SIGTERM not handled ends the process
def test_sigterm_under_sigterm_exits_is_exit_143_even_when_the_code_it_hit_exits_otherwise():
    """dstc build --ray: SIGTERM raised in ray.get came out as Ray's SystemExit(1), and before, with Ray's C++
    handler, as an abort (-6) that skipped Ray's shutdown."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_, sigterm_exits():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except SystemExit:
            raise SystemExit(1) from None  # what ray.get makes of it
    assert exit_.value.code == 143 and signal.getsignal(signal.SIGTERM) is before


# -- servers ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, stage_cache):
    """The embedded DeepSeek-V3 model on ONNX Runtime (the recipe tests/test_serve.py serves, same stage cache)."""
    return build_artifacts(tmp_path_factory.mktemp("replicas"), stage_cache, ("onnxruntime",))["onnxruntime"]


@pytest.fixture(scope="module")
def ray_env():
    """The server's local Ray starts its workers with the server's environment: this checkout's dstc."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        yield


def cores_of(pid: int) -> str:
    return re.search(r"^Cpus_allowed_list:\s+(\S+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1)


def requests_by_replica(server: Server) -> dict[str, float]:
    finished: dict[str, float] = {}
    for key, value in server.metrics().items():
        match = re.match(r'dstc_requests_total\{finish_reason=length,replica=(\d+)\}', key)
        if match:
            finished[match.group(1)] = value
    return finished


@pytest.mark.slow
def test_two_replicas_serve_as_one_engine_does(artifact, ray_env):
    key = "sk-replicas"
    server = Server(artifact, "--replicas", "2", "--threads", "1", "--api-key", key, timeout=240, api_key=key)
    try:
        health = httpx.get(server.base + "/health", timeout=10).json()
        assert health["state"] == "ready" and health["replicas_ready"] == health["replicas_target"] == 2
        replicas = health["replicas"]
        assert [r["replica"] for r in replicas] == ["0", "1"] and [r["cores"] for r in replicas] == [[0], [1]]
        for replica in replicas:  # the replica's process and its engine's, pinned to its core
            assert cores_of(replica["pid"]) == cores_of(replica["engine_pid"]) == str(replica["cores"][0])
        client = server.client()
        # auth and errors as the single-engine server's
        assert httpx.post(server.base + "/v1/completions", json={"model": server.name, "prompt": "1"}).status_code \
            == 401
        bad = server.post("/v1/completions", {"model": "other", "prompt": "1"})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
        # greedy: the same text whichever replica answers, streamed or not
        whole = client.completions.create(model=server.name, prompt="123+456=", max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=server.name, prompt="123+456=", max_tokens=8, temperature=0, stream=True))
        assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 8

        # concurrent clients spread over both replicas; a prompt sent again goes where its prefix is
        before = requests_by_replica(server)
        threads = [threading.Thread(target=lambda i=i: client.completions.create(
            model=server.name, prompt=f"{i} " * 30, max_tokens=64, temperature=0, extra_body={"ignore_eos": True}))
            for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        spread = requests_by_replica(server)
        assert all(spread.get(r, 0) > before.get(r, 0) for r in ("0", "1")), spread
        long_prompt = "the same long system prompt, " * 8
        for _ in range(4):
            client.completions.create(model=server.name, prompt=long_prompt, max_tokens=4, temperature=0)
        after = requests_by_replica(server)
        assert sorted(after[r] - spread.get(r, 0) for r in ("0", "1")) == [0, 4], (spread, after)

        metrics = server.metrics()
        assert metrics["dstc_replicas_ready"] == 2 and metrics["dstc_replicas_target"] == 2
        assert {"dstc_kv_cache_usage_ratio{replica=0}", "dstc_kv_cache_usage_ratio{replica=1}"} <= set(metrics)
        assert sum(v for k, v in metrics.items() if k.startswith("dstc_generation_tokens_total{")) == \
            8 + 8 + 8 * 64 + 4 * 4
    finally:
        server.stop()


def kill_under_load(server: Server, pid: int, why: str, seconds: float = 14, kill_after: float = 5) -> None:
    """16 clients in a closed loop; ``pid`` SIGKILLed after ``kill_after`` s: the requests that fail were in flight
    at the kill (logged with ``why``), the others and every later one complete, and a one-token request sent at the
    kill is answered within 5 s."""
    outcomes: list[tuple[float, float, int, str]] = []  # (sent, ended, status, request id or "")
    stop = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=server.base, timeout=60) as http:
            while time.monotonic() < stop:
                sent = time.monotonic()
                response = http.post("/v1/completions", json={
                    "model": server.name, "prompt": "321+654=", "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True})
                found = re.search(r"req-[0-9a-f]+", response.text)
                outcomes.append((sent, time.monotonic(), response.status_code, found.group(0) if found else ""))

    clients = [threading.Thread(target=client) for _ in range(16)]
    for thread in clients:
        thread.start()
    time.sleep(kill_after)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # the endpoint answers: a one-token request sent at once (again every 0.2 s until one succeeds)
    while True:
        probe = server.post("/v1/completions", {"model": server.name, "prompt": "1", "max_tokens": 1})
        if probe.status_code == 200:
            break
        assert time.monotonic() - killed < 5, probe.text
        time.sleep(0.2)
    assert time.monotonic() - killed < 5
    for thread in clients:
        thread.join()

    failed = [o for o in outcomes if o[2] != 200]
    assert failed, "no request was in flight on the killed replica"
    for sent, ended, status, request_id in failed:  # only those in flight on it at the kill
        assert status == 500 and sent < killed < ended, (sent, killed, ended, status)
        assert server.logged(request_id, "the request failed in the engine: " + why)
    assert len(failed) <= 16
    after = [o for o in outcomes if o[0] > killed]
    assert after and all(o[2] == 200 for o in after)
    assert sum(o[2] == 200 and o[0] < killed < o[1] for o in outcomes) > 0  # the other replica's went on


def replaced(server: Server, victim: dict) -> dict:
    """/health once Ray Serve's health check has replaced ``victim`` (two replicas ready, neither its process):
    the replacement, pinned to the same cores."""
    deadline = time.monotonic() + 90
    while True:
        health = httpx.get(server.base + "/health", timeout=10).json()
        pids = {r["pid"] for r in health["replicas"] if r["state"] == "ready"}
        if len(pids) == 2 and victim["pid"] not in pids:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
    replacement = next(r for r in health["replicas"] if r["replica"] == victim["replica"])
    assert replacement["cores"] == victim["cores"] and replacement["engine_pid"] != victim["engine_pid"]
    return health


@pytest.mark.slow
def test_a_replica_killed_under_load_fails_only_its_requests_and_is_replaced(artifact, ray_env):
    server = Server(artifact, "--replicas", "2", "--threads", "1", timeout=240)
    try:
        victim = httpx.get(server.base + "/health", timeout=10).json()["replicas"][1]
        kill_under_load(server, victim["pid"], "its replica died")  # the replica's own process
        health = replaced(server, victim)
        assert server.metrics()["dstc_replicas_replaced_total"] == 1
        # an engine process that dies (a native crash of the runtime): its replica is replaced as well
        victim = health["replicas"][0]
        kill_under_load(server, victim["engine_pid"], "the engine process died (killed by SIGKILL)")
        replaced(server, victim)
        assert server.metrics()["dstc_replicas_replaced_total"] == 2
        ok = server.post("/v1/completions", {"model": server.name, "prompt": "321+654=", "max_tokens": 4,
                                              "temperature": 0})
        assert ok.status_code == 200 and server.process.poll() is None
    finally:
        server.stop()


def stop_and_count_left(artifact, sig: int) -> tuple[set[str], list[str], list[str]]:
    """A server with two replicas started and stopped by ``sig``: (the names of the processes it ran, those of them
    still running 5 s after it exited, the lines it logged once signalled)."""
    server = Server(artifact, "--replicas", "2", "--threads", "1", timeout=240)
    try:
        tree = psutil.Process(server.process.pid).children(recursive=True)
        names = {p.name() for p in tree}
        logged = len(server.log)
    finally:
        server.stop(sig, timeout=60)
    # SIGTERM: drained, exit 0; SIGINT is dstc's "interrupted"
    assert server.process.returncode == (130 if sig == signal.SIGINT else 0), server.log
    _, alive = psutil.wait_procs(tree, timeout=5)
    return names, [f"{p.pid} {p.name()}" for p in alive], server.log[logged:]


@pytest.mark.slow  # 130-150 s a signal on 2 busy cores (Ray and Ray Serve start in 45-80 s of it)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_server_with_replicas_stopped_leaves_no_process_of_its_ray(artifact, ray_env, sig):
    """Issue #39: the server aborted on SIGTERM (Ray's C++ signal handler in the driver: a stack dump in its log,
    exit -6) before it shut Ray down, and the raylet's agents lived on under PID 1."""
    names, alive, log = stop_and_count_left(artifact, sig)
    assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names
    assert any(name.startswith("ray::ServeReplica") for name in names)
    assert alive == []
    assert not [line for line in log if any(text in line for text in ("SIGTERM received", "logging.cc", "(raylet)",
                                                                       "Traceback"))]


@pytest.mark.slow
def test_servers_started_and_stopped_again_leave_no_process_behind(artifact, ray_env):
    """Three start / stop cycles: nothing of dstc's or Ray's accumulates on the machine."""
    for _ in range(3):
        _, alive, _ = stop_and_count_left(artifact, signal.SIGTERM)
        assert alive == []
