"""`dstc serve` under hostile clients: issue #22's server cases (1-7) and issue #39's (8-12) replayed against a server
of each artifact.

For each artifact, a `dstc serve` child on a free port of 127.0.0.1 (the only address this script sends anything
to), at the default limits and timeouts, with an API key. Then, in order:

1. sampling values a runtime refuses (seed -1 and 2**64, top_p 1e-300, temperature 1e-300) sent while four long
   requests run: each a 400 naming the field, the four complete in full;
2. a 50 MB prompt declared by Content-Length and one sent chunked, a 1 MB prompt (within the body limit, past the
   characters the context can hold), five stop sequences, 257 messages; /health polled every 20 ms meanwhile
   (latency), the server's RSS before and after;
3. JSON nested 100,000 deep;
4. N clients (--connections, default 2000) that close before their declared Content-Length: what the log got;
5. N connections that send part of a body and 100 that send part of their headers, with five real requests while
   they are held; then a stream whose client reads nothing;
6. no key, a wrong key, the key; /health and /metrics without one; `--host 0.0.0.0` without a key;
7. the engine process killed under a request: its 500's body and the log line with its request id; the
   X-Request-Id header on every response seen;
8. eight non-streaming 1000-token requests whose clients close their sockets after 0.5 s: the running batch
   afterwards, the requests counted as cancelled;
9. a second `dstc serve` on the port the first one holds: its exit code, its one line and how long it took;
10. `dstc serve --replicas 2` started and stopped by SIGTERM (--replica-cycles times, 3 by default; 0 skips it): its
   exit (0: drained), its processes (its local Ray's) still running after it exited, and Ray's or dstc's orphaned
   processes (under PID 1) on the machine before and after the cycles (#39 item 3);
11. a copy of the artifact whose report.json is forged (KL means 0, top-1 agreements 1.0; its digest removed, or
    kept): `dstc gate` at limits the real report fails and `dstc verify` must both refuse it (#39 item 1; an
    artifact built without an eval section has no report: skipped);
12. --invariance-requests (24) staggered concurrent greedy requests against the same requests alone, on the server
    and on one with --deterministic: how many texts differ (0 with it) and the concurrent tokens/s (#39 item 5;
    case 8 is its item 7).

Printed per case: what was sent, the outcome (HTTP status, message, figures) and PASS / FAIL. Every wait is
bounded; the run stops by itself (with the default timeouts, about two minutes per artifact).

    .venv/bin/python benchmarks/serve_hostile.py artifacts/deepseek-v3-tiny-onnxruntime-int4 \\
        artifacts/deepseek-v3-tiny-openvino-per-head

An OpenVINO artifact must be built with ``export: {mla_cache: per-head}`` (continuous batching refuses the latent
KV cache).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.batch_invariance import prompts  # noqa: E402

HOST = "127.0.0.1"
KEY = "sk-hostile-benchmark"
PROMPT = "321+654="


@dataclass
class Row:
    case: str
    what: str
    outcome: str
    ok: bool | None  # None: a figure, judged by no target


@dataclass
class Server:
    artifact: Path
    threads: int
    start_args: tuple[str, ...] = ()
    process: subprocess.Popen | None = None
    port: int = 0
    log: list[str] = field(default_factory=list)
    name: str = ""
    http: httpx.Client = field(default_factory=httpx.Client)  # one for all: a client costs ~0.1 s to make

    def start(self, timeout: float = 180.0) -> None:
        self.name = self.artifact.resolve().name
        self.process = subprocess.Popen(
            [sys.executable, "-m", "toolchain", "serve", str(self.artifact), "--host", HOST, "--port", "0",
             "--threads", str(self.threads), "--api-key-file", "/dev/stdin", *self.start_args],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.process.stdin is not None
        self.process.stdin.write(KEY + "\n")  # the key off the command line, as --api-key-file is for
        self.process.stdin.close()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit("the server exited:\n" + "".join(self.log))
            if self.port:
                try:
                    if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise SystemExit("the server did not become ready:\n" + "".join(self.log))

    def _read(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if match and not self.port:
                self.port = int(match.group(1))

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    def rss_mb(self) -> float:
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024

    def post(self, body, key: str | None = KEY, path: str = "/v1/completions", timeout: float = 120) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        return self.http.post(self.base + path, content=content, headers=headers, timeout=timeout)

    def metric(self, name: str) -> float:
        """An unlabelled sample of /metrics."""
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line.split(" ")[0] == name:
                return float(line.rsplit(" ", 1)[1])
        return float("nan")

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        self.http.close()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# -- raw HTTP --------------------------------------------------------------------------------------------------------


def head(*headers: str, key: bool = True) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json", *headers]
    if key:
        lines.append(f"Authorization: Bearer {KEY}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def connect(server: Server, data: bytes = b"", timeout: float = 60) -> socket.socket:
    sock = socket.create_connection((HOST, server.port), timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def status_of(sock: socket.socket) -> int | None:
    """The status of the response on ``sock`` (None if it closed first)."""
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
    except (ConnectionResetError, TimeoutError):
        return None
    return int(data.split(b" ", 2)[1])


def closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class HealthProbe:
    def __init__(self, server: Server) -> None:
        self.server, self.latencies, self.errors = server, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.latencies and time.monotonic() < deadline:  # polling before the case starts
            time.sleep(0.01)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get(self.server.base + "/health").status_code == 200
                except httpx.TransportError:
                    ok = False
                self.latencies.append(time.perf_counter() - started)
                self.errors += not ok
                time.sleep(0.02)

    def stop(self) -> tuple[float, float, int]:
        """(p50 ms, max ms, errors)."""
        self._stop.set()
        self._thread.join(60)
        ms = np.array(self.latencies) * 1e3
        return float(np.median(ms)), float(ms.max()), self.errors


def threaded(n: int, work) -> list:
    out: list = [None] * n

    def run(i: int) -> None:
        try:
            out[i] = work(i)
        except Exception as e:  # recorded as the outcome
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


# -- the cases -------------------------------------------------------------------------------------------------------


def case1(server: Server) -> list[Row]:
    rows = []
    tokens = 300
    long = {"model": server.name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    bad = [("seed", -1), ("seed", 2**64), ("top_p", 1e-300), ("temperature", 1e-300)]
    replies: dict = {}

    def work(i: int):
        if i < 4:
            return server.post(long)
        deadline = time.monotonic() + 30
        while server.metric("dstc_running_batch_size") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        for name, value in bad:
            replies[(name, value)] = server.post({**long, "temperature": 1.0, name: value})
        return None

    results = threaded(5, work)
    for (name, value), response in replies.items():
        error = response.json().get("error", {})
        rows.append(Row("1", f"{name}={value} beside 4 long requests",
                        f"{response.status_code} param={error.get('param')}: {error.get('message', '')[:60]}",
                        response.status_code == 400 and error.get("param") == name))
    done = [r for r in results[:4] if isinstance(r, httpx.Response) and r.status_code == 200
            and r.json()["usage"]["completion_tokens"] == tokens]
    statuses = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in results[:4]]
    rows.append(Row("1", "the 4 long requests of that batch", f"{statuses}, {len(done)}/4 with all {tokens} tokens",
                    len(done) == 4))
    return rows


def case2(server: Server) -> tuple[list[Row], dict]:
    rows = []
    name = server.name
    server.post({"model": name, "prompt": PROMPT, "max_tokens": 4})
    rss_before = server.rss_mb()
    probe = HealthProbe(server)
    started = time.perf_counter()
    sock = connect(server, head(f"Content-Length: {50 << 20}"))
    status = status_of(sock)
    rows.append(Row("2", "50 MB prompt, Content-Length", f"{status} in {(time.perf_counter() - started) * 1e3:.1f} ms "
                    f"(nothing read)", status == 413))
    sock.close()
    sock = connect(server, head("Transfer-Encoding: chunked"))
    chunk = b"x" * (1 << 20)
    sent = 0
    started = time.perf_counter()
    try:
        for _ in range(50):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += 1
    except OSError:
        pass
    status = status_of(sock)
    rows.append(Row("2", "50 MB prompt, chunked", f"{status or 'reset'} after {sent} MB sent, "
                    f"{(time.perf_counter() - started) * 1e3:.0f} ms", sent < 50))
    sock.close()
    started = time.perf_counter()
    response = server.post({"model": name, "prompt": "1+1=" * 250_000})
    rows.append(Row("2", "1 MB prompt (1M characters)", f"{response.status_code} in "
                    f"{(time.perf_counter() - started) * 1e3:.0f} ms: {response.json()['error']['message'][:70]}",
                    response.status_code == 400))
    for what, body, path in (("5 stop sequences", {"model": name, "prompt": PROMPT, "stop": list("abcde")},
                              "/v1/completions"),
                             ("257 messages", {"model": name, "messages": [{"role": "user", "content": "1"}] * 257},
                              "/v1/chat/completions")):
        response = server.post(body, path=path)
        rows.append(Row("2", what, f"{response.status_code} param={response.json()['error']['param']}",
                        response.status_code == 400))
    p50, worst, errors = probe.stop()
    rows.append(Row("2", "/health meanwhile", f"p50 {p50:.1f} ms, max {worst:.1f} ms, {errors} failed",
                    worst < 100 and not errors))
    deadline = time.monotonic() + 10
    while (rss_after := server.rss_mb()) > 1.1 * rss_before and time.monotonic() < deadline:
        time.sleep(0.2)
    rows.append(Row("2", "server RSS before / after", f"{rss_before:.0f} / {rss_after:.0f} MB "
                    f"({(rss_after / rss_before - 1) * 100:+.1f} %)", abs(rss_after / rss_before - 1) <= 0.1))
    return rows, {"health_p50_ms": p50, "health_max_ms": worst, "rss_before_mb": rss_before,
                  "rss_after_mb": rss_after}


def case3(server: Server) -> list[Row]:
    nested = b'{"model": "' + server.name.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = server.post(nested)
    error = response.json()["error"]
    return [Row("3", "JSON nested 100,000 deep", f"{response.status_code} {error['code']}: {error['message']}",
                response.status_code == 400 and error["code"] == "invalid_json")]


def case4(server: Server, n: int) -> list[Row]:
    before = len(server.log)
    for _ in range(n):
        connect(server, head("Content-Length: 1000") + b'{"model": ').close()
    time.sleep(1.0)
    added = server.log[before:]
    tracebacks = sum("Traceback" in line for line in added)
    ok = server.post({"model": server.name, "prompt": PROMPT, "max_tokens": 4}).status_code == 200
    return [Row("4", f"{n} clients closing before Content-Length",
                f"{len(added)} log lines, {tracebacks} tracebacks; then a request: {'200' if ok else 'failed'}",
                tracebacks == 0 and len(added) <= n and ok)]


def case5(server: Server, n: int, body_timeout: float = 30.0, idle_timeout: float = 30.0) -> list[Row]:
    rows = []
    opened = time.monotonic()
    bodies = [connect(server, head("Content-Length: 1000") + b'{"model"') for _ in range(n)]
    heads = [connect(server, f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\n".encode()) for _ in range(100)]
    held = time.monotonic() - opened
    started = time.perf_counter()
    served = [server.post({"model": server.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
              for _ in range(5)]
    served_ms = (time.perf_counter() - started) * 1e3
    ok = all(r.status_code == 200 and r.json()["choices"][0]["text"] == "9750" for r in served)
    rows.append(Row("5", f"5 real requests while {n} slow bodies + 100 slow headers are held",
                    f"{[r.status_code for r in served]} in {served_ms:.0f} ms (opening them took {held:.1f} s)", ok))
    statuses = [status_of(s) for s in bodies]
    all_closed = all(closed(s, 15) for s in bodies + heads)
    elapsed = time.monotonic() - opened
    rows.append(Row("5", f"{n} slow bodies, 100 slow headers", f"bodies: {statuses.count(408)} x 408; all closed: "
                    f"{all_closed}, {elapsed:.1f} s after opening", statuses.count(408) == n and all_closed
                    and elapsed < body_timeout + 20))
    for s in bodies + heads:
        s.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, server.port))
    body = json.dumps({"model": server.name, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}}).encode()
    started = time.monotonic()
    sock.sendall(head(f"Content-Length: {len(body)}") + body)
    time.sleep(idle_timeout)
    gone = closed(sock, 20)
    rows.append(Row("5", "a stream whose client reads nothing", f"closed by the server: {gone}, "
                    f"{time.monotonic() - started:.1f} s after the request; running batch after: "
                    f"{server.metric('dstc_running_batch_size'):.0f}", gone))
    sock.close()
    return rows


def case6(server: Server) -> list[Row]:
    rows = []
    completion = {"model": server.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    for what, key in (("no key", None), ("a wrong key", "sk-wrong"), ("the key", KEY)):
        response = server.post(completion, key=key)
        expected = 200 if key == KEY else 401
        detail = "" if response.status_code == 200 else \
            f" {response.json()['error']['code']}: {response.json()['error']['message'][:50]}"
        rows.append(Row("6", what, f"{response.status_code}{detail}", response.status_code == expected))
    for path in ("/health", "/metrics"):
        status = httpx.get(server.base + path).status_code
        rows.append(Row("6", f"{path} without a key", str(status), status == 200))
    result = subprocess.run([sys.executable, "-m", "toolchain", "serve", str(server.artifact), "--host", "0.0.0.0",
                             "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = result.stderr.strip()
    rows.append(Row("6", "--host 0.0.0.0 without a key", f"exit {result.returncode}: {line[:90]}",
                    result.returncode == 2 and "\n" not in line))
    return rows


def case7(server: Server, seen_ids: list[str]) -> list[Row]:
    result: dict = {}

    def work() -> None:
        result["response"] = server.post({"model": server.name, "prompt": PROMPT, "max_tokens": 1000,
                                          "ignore_eos": True})

    thread = threading.Thread(target=work)
    thread.start()
    deadline = time.monotonic() + 30
    while server.metric("dstc_running_batch_size") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(httpx.get(server.base + "/health").json()["engine_pid"], signal.SIGKILL)
    thread.join(120)
    response = result["response"]
    request_id = response.headers.get("x-request-id", "")
    message = response.json()["error"]["message"]
    time.sleep(0.5)
    logged = [line.strip() for line in server.log if request_id and request_id in line]
    ok = response.status_code == 500 and message == f"internal error (request id {request_id})" and bool(logged)
    rows = [Row("7", "the engine killed under a request", f"{response.status_code} {message!r}; log: "
                f"{logged[0][:80] if logged else 'nothing'}", ok)]
    restarted = server.wait_ready(120)
    seen_ids.append(request_id)
    missing = sum(not i.startswith("req-") for i in seen_ids)
    rows.append(Row("7", "X-Request-Id on every response", f"{len(seen_ids) - missing}/{len(seen_ids)}; engine "
                    f"restarted: {restarted}", missing == 0 and restarted))
    return rows


def case8(server: Server) -> list[Row]:
    body = json.dumps({"model": server.name, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
                       "temperature": 0}).encode()
    cancelled_before = _labelled(server, "dstc_requests_total", 'finish_reason="cancelled"')
    clients = [connect(server, head(f"Content-Length: {len(body)}") + body) for _ in range(8)]
    time.sleep(0.5)
    running = [server.metric("dstc_running_batch_size")]
    for sock in clients:
        sock.close()
    closed_at = time.monotonic()
    while time.monotonic() - closed_at < 2.0:
        time.sleep(0.25)
        running.append(server.metric("dstc_running_batch_size"))
    cancelled = _labelled(server, "dstc_requests_total", 'finish_reason="cancelled"') - cancelled_before
    return [Row("8", "8 x 1000 tokens, sockets closed after 0.5 s",
                f"running batch at close and every 0.25 s for 2 s: {[int(r) for r in running]}; cancelled "
                f"{cancelled:.0f}", running[-1] == 0 and cancelled == 8)]


def _labelled(server: Server, name: str, label: str) -> float:
    """A labelled sample of /metrics (0 before its first observation)."""
    for line in httpx.get(server.base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{{label}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def case9(server: Server) -> list[Row]:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "toolchain", "serve", str(server.artifact), "--port",
                             str(server.port)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    line = result.stderr.strip()
    return [Row("9", "dstc serve on the port in use", f"exit {result.returncode} in {seconds:.1f} s: {line[:70]}",
                result.returncode == 2 and "\n" not in line and "Address already in use" in line)]


def case10(artifact: Path, cycles: int) -> list[Row]:
    import psutil

    def orphans() -> set[int]:
        """Ray's or dstc's processes whose parent is gone (re-parented to PID 1), as the leaked agents were: not
        those of a server still running (another one on the machine)."""
        found = set()
        for process in psutil.process_iter(["cmdline", "ppid"]):
            command = " ".join(process.info["cmdline"] or [])
            if process.info["ppid"] == 1 and ("ray::" in command or "/ray/" in command or "toolchain" in command):
                found.add(process.pid)
        return found

    before = orphans()
    rows = []
    for cycle in range(cycles):
        server = Server(artifact, 1, ("--replicas", "2"))
        server.start(timeout=300)
        assert server.process is not None
        tree = psutil.Process(server.process.pid).children(recursive=True)
        started = time.monotonic()
        server.stop()
        seconds = time.monotonic() - started
        _, alive = psutil.wait_procs(tree, timeout=5)
        dumped = [line for line in server.log if "SIGTERM received" in line or "logging.cc" in line]
        rows.append(Row("10", f"--replicas 2, SIGTERM (cycle {cycle + 1})",
                        f"exit {server.process.returncode} in {seconds:.1f} s; of its {len(tree)} processes "
                        f"{len(alive)} left {sorted(p.name() for p in alive)}; C++ dump lines: {len(dumped)}",
                        not alive and not dumped and server.process.returncode == 0))
    left = orphans() - before
    megabytes = sum(p.memory_info().rss for p in map(psutil.Process, left) if p.is_running()) / 2**20
    rows.append(Row("10", f"orphaned Ray / dstc processes, {cycles} cycles", f"{len(before)} before, {len(left)} "
                    f"more after ({megabytes:.0f} MB)", not left))
    return rows


def case11(artifact: Path) -> list[Row]:
    """Issue #39 item 1: report.json forged (its digest removed, or kept, with the figures edited to pass), then
    `dstc gate` at limits the real report fails and `dstc verify`: each must refuse the copy."""
    import shutil
    import tempfile

    if not (artifact / "report.json").exists():
        return [Row("11", "forged report.json", "no report.json (an artifact built with an eval section has one)",
                    None)]
    rows = []
    for forgery in ("digest removed", "digest kept"):
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / artifact.name
            shutil.copytree(artifact, copy)
            report = json.loads((copy / "report.json").read_text())
            if forgery == "digest removed":
                report.pop("digest", None)
            edited = _forge(report)
            (copy / "report.json").write_text(json.dumps(report, indent=2))
            for command in (["gate", str(copy), "--max-kl", "0.0001", "--min-top1", "0.99"], ["verify", str(copy)]):
                result = subprocess.run([sys.executable, "-m", "toolchain", *command], cwd=ROOT, capture_output=True,
                                        text=True, timeout=300)
                line = ((result.stderr + result.stdout).strip().splitlines() or [""])[0]
                rows.append(Row("11", f"{edited}, {forgery}: dstc {command[0]}",
                                f"exit {result.returncode}: {line[:80]}", result.returncode != 0))
    return rows


def _forge(report: dict) -> str:
    """The report's KL mean set to 0 and its top-1 agreement to 1.0, as the probe did by hand: what was edited."""
    metrics = report["metrics"]
    metrics["kl_mean"]["value"], metrics["top1_agreement"]["value"] = 0.0, 1.0
    return "kl_mean 0, top1_agreement 1.0"


def case12(server: Server, requests: int, max_tokens: int) -> list[Row]:
    """Issue #39 item 5: N staggered concurrent greedy requests against the same N alone, on this server and on one
    started with --deterministic: how many texts differ (0 with --deterministic), and the concurrent tokens/s."""
    texts = prompts(requests)
    rows = []
    for mode in ("plain", "--deterministic"):
        target = server
        if mode != "plain":
            target = Server(server.artifact, server.threads, (mode,))
            target.start()
        try:
            def complete(text: str, target: Server = target) -> tuple[str, int]:
                response = target.post({"model": target.name, "prompt": text, "max_tokens": max_tokens,
                                        "temperature": 0, "ignore_eos": True}, timeout=600)
                body = response.json()
                return body["choices"][0]["text"], body["usage"]["completion_tokens"]

            alone = [complete(text)[0] for text in texts]
            started = time.perf_counter()
            together = threaded(len(texts), lambda i: (time.sleep(0.05 * i), complete(texts[i]))[1])
            seconds = time.perf_counter() - started
        finally:
            if target is not server:
                target.stop()
        differ = sum(a != t[0] for a, t in zip(alone, together, strict=True))
        tok_s = sum(t[1] for t in together) / seconds
        rows.append(Row("12", f"{requests} staggered greedy requests vs alone ({mode})",
                        f"{differ} of {requests} texts differ; {tok_s:.0f} tok/s concurrent",
                        differ == 0 if mode != "plain" else None))
    return rows


def run(artifact: Path, connections: int, threads: int, invariance_requests: int) -> tuple[list[Row], dict]:
    server = Server(artifact, threads)
    server.start()
    seen: list[str] = []
    original_post = server.post

    def post(*a, **kw) -> httpx.Response:  # every response's X-Request-Id, for case 7
        response = original_post(*a, **kw)
        seen.append(response.headers.get("x-request-id", ""))
        return response

    server.post = post  # type: ignore[method-assign]
    try:
        rows = case1(server)
        more, figures = case2(server)
        rows += more + case3(server) + case4(server, connections) + case5(server, connections) + case6(server)
        rows += case8(server) + case9(server) + case7(server, seen) + case12(server, invariance_requests, 48)
        return rows, figures
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--connections", type=int, default=2000, help="slow / early-closing connections (cases 4, 5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--invariance-requests", type=int, default=24, help="greedy requests of case 12")
    parser.add_argument("--replica-cycles", type=int, default=3, help="dstc serve --replicas 2 starts (case 10)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * args.connections + 512)), hard))
    failed = 0
    for artifact in args.artifacts:
        started = time.monotonic()
        rows, figures = run(artifact, args.connections, args.threads, args.invariance_requests)
        rows += case11(artifact)
        if args.replica_cycles:
            rows += case10(artifact, args.replica_cycles)
        print(f"\n{artifact.resolve().name} ({time.monotonic() - started:.0f} s)")
        print(f"{'case':<5} {'sent':<58} {'outcome':<100} result")
        for row in rows:
            print(f"{row.case:<5} {row.what:<58} {row.outcome:<100} "
                  f"{'PASS' if row.ok else 'FAIL' if row.ok is False else '-'}")
        print(json.dumps({k: round(v, 1) for k, v in figures.items()}))
        failed += sum(row.ok is False for row in rows)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
