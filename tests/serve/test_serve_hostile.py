"""dstc serve under hostile clients: issue #22's server cases, against servers started here on free localhost ports
(the embedded DeepSeek-V3 model on ONNX Runtime and OpenVINO, as tests/serve/test_serve.py builds them).

1. sampling values a runtime refuses are a 400 naming the field; an error inside the engine fails its request only;
2. bounded work per request: body size (declared and as it arrives), prompt characters before tokenizing,
   tokenization off the event loop, stop / messages limits; /health answers meanwhile; memory comes back;
3. deeply nested JSON is a 400; 4. a client that closes early leaves nothing in the log;
5. slow headers, slow bodies and a stream nobody reads are closed by their timeouts while real requests are served;
6. API keys (Bearer), and no unauthenticated server on an address other than the loopback's;
7. a 500 says "internal error" and a request id, which the log line with the details carries; every response has
   an X-Request-Id.

Only 127.0.0.1 gets traffic.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_helpers import BACKENDS, ROOT, Server, build_artifacts

from toolchain.errors import InputError

pytestmark = pytest.mark.timeout(300)

openai = pytest.importorskip("openai")
KEY, SECOND_KEY = "sk-dstc-test-0123456789", "sk-dstc-test-rotated"
TIMEOUT_S = 2  # the test servers' header, body and stream-idle timeouts
PROMPT = "321+654="


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, stage_cache):
    return build_artifacts(tmp_path_factory.mktemp("serve-hostile"), stage_cache)


@pytest.fixture(scope="module")
def servers(artifacts, tmp_path_factory):
    """{backend: Server} with an API key and short timeouts: ONNX Runtime's takes the keys of a file (two),
    OpenVINO's one --api-key. Started on first use, stopped with the module."""
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"{KEY}\n\n{SECOND_KEY}\n")
    timeouts = ("--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S), "--stream-idle-timeout",
                str(TIMEOUT_S), "--keep-alive-timeout", "1")
    keys = {"onnxruntime": ("--api-key-file", str(key_file)), "openvino": ("--api-key", KEY),
            "openvino-latent": ("--api-key", KEY)}
    started: dict[str, Server] = {}

    class Lazy(dict):
        def __missing__(self, backend):
            self[backend] = started[backend] = Server(artifacts[backend], *keys[backend], *timeouts, api_key=KEY)
            return started[backend]

    yield Lazy()
    for server in started.values():
        server.stop()


def expected_alone(server: Server, max_tokens: int) -> str:
    reply = server.client().completions.create(model=server.name, prompt=PROMPT, max_tokens=max_tokens,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == max_tokens
    return reply.choices[0].text


def same_answer(backend: str, batched: str, alone: str) -> bool:
    """Whether a long text generated in a batch is the one generated alone: all of it on ONNX Runtime (fp32, the
    batched runner gives every sequence its batch-one tokens), its first line (the sum) on OpenVINO, whose bf16
    compute and batched kernels flip the untrained model's near-tied tokens after a while."""
    if backend == "onnxruntime":
        return batched == alone
    return batched.split("\n")[0] == alone.split("\n")[0] == "9750"


def in_threads(n: int, work) -> tuple[list, list[str]]:
    """work(i) for i < n, concurrently: (results, errors)."""
    results: list = [None] * n
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except Exception as e:  # reported by the caller
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, errors


def raw_request(server: Server, head: str, body: bytes = b"") -> socket.socket:
    """A connection that has sent ``head`` (request line and headers, CRLF-separated) and ``body``, as is."""
    sock = socket.create_connection(server.address, timeout=30)
    sock.sendall(head.encode() + body)
    return sock


def post_head(path: str, *headers: str) -> str:
    return "\r\n".join([f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", *headers,
                        "", ""])


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response, read to the end of the connection or of its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (whatever it sends first is read and dropped)."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def settled_rss(server: Server, before: int, within: float = 10.0, bound: float = 1.1) -> int:
    """The server's resident set once back within ``bound`` times ``before``, or after ``within`` seconds: memory
    is given back after the response has been sent."""
    deadline = time.monotonic() + within
    while (rss := server.rss_bytes()) > bound * before and time.monotonic() < deadline:
        time.sleep(0.2)
    return rss


class HealthProbe:
    """GET /health every 20 ms in a thread, its latencies kept (seconds), until stopped."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.latencies: list[float] = []
        self.failures: list[str] = []
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
                    status = client.get(self.server.base + "/health").status_code
                except httpx.TransportError as e:
                    self.failures.append(repr(e))
                    continue
                self.latencies.append(time.perf_counter() - started)
                if status != 200:
                    self.failures.append(f"status {status}")
                time.sleep(0.02)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(60)
        assert not self.failures, self.failures
        return self.latencies


# -- case 1: sampling values, and isolation inside the engine --------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_values_a_runtime_refuses_are_a_400_naming_the_field_and_leave_the_batch_alone(servers, backend):
    server = servers[backend]
    n_tokens = 200
    expected = expected_alone(server, n_tokens)
    long = {"model": server.name, "prompt": PROMPT, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
    before = server.metrics()["dstc_requests_total{finish_reason=length}"]
    refused: dict[str, httpx.Response] = {}

    def work(i: int):
        if i < 4:
            return server.post("/v1/completions", long)
        server.wait_for(lambda m: m["dstc_running_batch_size"] >= 1, timeout=30)  # while the long ones run
        for field, value in (("seed", -1), ("seed", 2**64), ("top_p", 1e-300), ("temperature", 1e-300),
                             ("top_p", 0), ("temperature", 2.5)):
            refused[f"{field}={value}"] = server.post("/v1/completions", {**long, "temperature": 1.0, field: value})
        refused["temperature=NaN"] = server.post("/v1/completions", json.dumps(long).replace(
            '"temperature": 0', '"temperature": NaN').encode())
        return None

    results, errors = in_threads(5, work)
    assert not errors
    for case, response in refused.items():
        field = case.split("=")[0]
        assert response.status_code == 400, (case, response.text)
        assert response.json()["error"]["param"] == field and field in response.json()["error"]["message"], case
    for response in results[:4]:
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == n_tokens and body["choices"][0]["finish_reason"] == "length"
        assert same_answer(backend, body["choices"][0]["text"], expected)
    assert server.metrics()["dstc_requests_total{finish_reason=length}"] == before + 4
    # the bounds themselves are taken by both runtimes
    for field, value in (("seed", 0), ("seed", 2**64 - 1), ("top_p", 1e-6), ("temperature", 0.01),
                         ("temperature", 2.0)):
        sampled = {**long, "max_tokens": 4, "temperature": 1.0, field: value}
        response = server.post("/v1/completions", sampled)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, \
            (field, value, response.text)


BAD_SAMPLING = {  # values validation refuses, handed to the engine below it: each fails inside the runtime
    "onnxruntime": {"a seed numpy refuses": dict(temperature=1.0, seed=-1),
                    "probabilities the temperature makes NaN": dict(temperature=1e-320)},
    "openvino": {"a seed past size_t": dict(temperature=1.0, seed=2**64),
                 "a top_p float32 rounds to 0": dict(temperature=1.0, top_p=1e-300)},
}
BAD_SAMPLING["openvino-latent"] = BAD_SAMPLING["onnxruntime"]  # dstc's runner samples, as on ONNX Runtime
RUNTIME_ERRORS = {"a seed numpy refuses": "ValueError", "probabilities the temperature makes NaN": "ValueError",
                  "a seed past size_t": "TypeError", "a top_p float32 rounds to 0": "top_p > 0"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_error_inside_the_engine_fails_that_request_only(artifacts, backend, caplog):
    """Defence in depth under the validation: requests the runtime refuses, given straight to the engine (its own
    process, the real runtime) while four long HTTP requests run in the same batch; the four complete in full."""
    from fastapi.testclient import TestClient

    from toolchain.runtime.sampling import Sampling
    from toolchain.serve.api import create_app
    from toolchain.serve.engine import Request as EngineRequest
    from toolchain.serve.server import Service
    from toolchain.serve.settings import ServeSettings

    artifact = artifacts[backend]
    service = Service(artifact, ServeSettings(threads=2))
    ids = artifact.tokenizer()(PROMPT)["input_ids"]
    n_tokens = 300
    body = {"model": service.model_name, "prompt": ids, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}
    with TestClient(create_app(service)) as client:
        assert service.engine.wait_ready(120), service.engine.load_error
        alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        events: dict[str, list] = {case: [] for case in BAD_SAMPLING[backend]}

        def work(i: int):
            if i < 4:
                return client.post("/v1/completions", json=body)
            deadline = time.monotonic() + 30
            while service.engine.running < 4:  # all four in the running batch
                assert time.monotonic() < deadline, "the long requests did not start"
                time.sleep(0.005)
            for case, sampling in BAD_SAMPLING[backend].items():
                service.engine.submit(EngineRequest(prompt=ids, max_tokens=n_tokens, sampling=Sampling(**sampling),
                                                    stop_ids=frozenset(), sink=events[case].append))
            return None

        results, errors = in_threads(5, work)
        assert not errors
        for response in results[:4]:
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == n_tokens
            assert same_answer(backend, response.json()["choices"][0]["text"], alone)
        for case, got in events.items():
            assert [e.finish for e in got] == ["error"], (case, got)
            assert "Traceback" in got[0].error and RUNTIME_ERRORS[case] in got[0].error, (case, got[0].error)
        after = client.post("/v1/completions", json={**body, "max_tokens": 4})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


# -- case 2: bounded work per request --------------------------------------------------------------------------------


def test_oversized_requests_are_refused_early_while_health_answers_and_memory_comes_back(servers):
    server = servers["onnxruntime"]
    name = server.name
    server.post("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4})
    rss_before = server.rss_bytes()
    probe = HealthProbe(server)
    try:
        # 50 MB declared: refused on its Content-Length, before a byte of it is read
        sock = raw_request(server, post_head("/v1/completions", f"Content-Length: {50 << 20}",
                                             f"Authorization: Bearer {KEY}"))
        status, headers, reply = read_reply(sock)
        assert status == 413 and headers["connection"] == "close" and headers["x-request-id"].startswith("req-")
        assert json.loads(reply)["error"]["code"] == "request_too_large"
        assert closed_by_server(sock, 5)
        # 50 MB chunked (no length to check first): refused as it arrives, once past the limit
        sock = raw_request(server, post_head("/v1/completions", "Transfer-Encoding: chunked",
                                             f"Authorization: Bearer {KEY}"))
        chunk = b"x" * (1 << 20)
        sent = 0
        try:
            for _ in range(50):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 50, "the server read the whole 50 MB"
        sock.close()
        # within the body limit, a prompt of more characters than the context can hold: refused on its characters,
        # not tokenized (that would have said tokens, after 2.8 s on this machine)
        too_long = server.post("/v1/completions", {"model": name, "prompt": "1+1=" * 250_000})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        assert too_long.json()["error"]["message"].startswith("the prompt is 1000000 characters")
        chat = {"model": name, "messages": [{"role": "user", "content": "x" * 50_000}] * 10}
        assert server.post("/v1/chat/completions", chat).json()["error"]["code"] == "context_length_exceeded"
        one = {"role": "user", "content": "1"}
        many = server.post("/v1/chat/completions", {"model": name, "messages": [one] * 257})
        assert many.status_code == 400 and many.json()["error"]["param"] == "messages"
        for stop in (["a", "b", "c", "d", "e"], ["x" * 257]):
            refused = server.post("/v1/completions", {"model": name, "prompt": PROMPT, "stop": stop})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
    finally:
        latencies = probe.stop()
    assert len(latencies) > 5
    assert max(latencies) < 1.0, f"/health took {max(latencies) * 1e3:.0f} ms"  # generous: ~10 ms measured
    ok = server.post("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert ok.json()["choices"][0]["text"] == "9750"
    assert settled_rss(server, rss_before) <= 1.1 * rss_before


def test_prompts_are_parsed_and_tokenized_off_the_event_loop(artifacts):
    """Limits raised far above the defaults: a 50 MB prompt is read and refused on its characters, a 2-million
    character one tokenized in full (seconds), and /health answers all the while; memory comes back."""
    server = Server(artifacts["onnxruntime"], "--max-body-bytes", str(60 << 20), "--max-prompt-chars", "2000000")
    try:
        name = server.name
        server.post("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4})
        rss_before = server.rss_bytes()
        probe = HealthProbe(server)
        try:
            huge = server.post("/v1/completions", {"model": name, "prompt": "1+1=" * (50 << 18)})
            assert huge.status_code == 400 and "52428800 characters" in huge.json()["error"]["message"]
            started = time.perf_counter()
            long = server.post("/v1/completions", {"model": name, "prompt": "1+1=" * 500_000})
            tokenizing = time.perf_counter() - started
            assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
            assert "tokens" in long.json()["error"]["message"]  # counted in tokens: it was tokenized
        finally:
            latencies = probe.stop()
        during = len(latencies)
        assert tokenizing > 1.0 and during > 10
        assert max(latencies) < 1.0, f"/health took {max(latencies) * 1e3:.0f} ms"  # generous
        # A 2-million token prompt leaves 9-14 % behind (measured: Python's and the tokenizer's allocators keep
        # part of it); without the intake's malloc_trim, glibc kept all of it: +100 %.
        assert settled_rss(server, rss_before, bound=1.25) <= 1.25 * rss_before
    finally:
        server.stop()


# -- cases 3 and 4: nested JSON, a client that closes early ----------------------------------------------------------


ACCESS_LINE = re.compile(r'dstc serve: \S+ "[A-Z]+ \S+" (\d{3}) ')


def test_deeply_nested_json_is_a_400_and_early_closes_leave_nothing_in_the_log(servers):
    server = servers["onnxruntime"]
    lines_before = len(server.log)
    for depth in (1000, 100_000):
        nested = b'{"model": "' + server.name.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        response = server.post("/v1/completions", nested)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", response.text
        assert "nested too deeply" in response.json()["error"]["message"]
    for _i in range(200):  # each declares 1000 bytes and sends 10
        sock = raw_request(server, post_head("/v1/completions", "Content-Length: 1000", f"Authorization: Bearer {KEY}"),
                           b'{"model": ')
        sock.close()
    time.sleep(0.5)
    assert server.process.poll() is None
    # the access log's one line per request (400 for the deep bodies, 499 for the closes) and nothing else: no
    # traceback, no warning
    assert [line for line in server.log[lines_before:] if not ACCESS_LINE.match(line)] == []
    statuses = [ACCESS_LINE.match(line).group(1) for line in server.log[lines_before:]]
    assert statuses.count("400") == 2 and set(statuses) <= {"400", "499"}
    ok = server.post("/v1/completions", {"model": server.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert ok.json()["choices"][0]["text"] == "9750"


# -- case 5: slow clients ------------------------------------------------------------------------------------------


def test_slow_headers_and_slow_bodies_are_closed_by_their_timeouts_while_real_requests_are_served(servers):
    server = servers["onnxruntime"]
    bodies = [raw_request(server, post_head("/v1/completions", "Content-Length: 1000", f"Authorization: Bearer {KEY}"),
                          b'{"model"') for _ in range(300)]
    heads = [raw_request(server, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n") for _ in range(100)]
    idle = [socket.create_connection(server.address) for _ in range(100)]  # sends nothing at all
    opened = time.monotonic()
    client = server.client()
    texts = [client.completions.create(model=server.name, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
             for _ in range(5)]
    assert texts == ["9750"] * 5 and time.monotonic() - opened < TIMEOUT_S  # served while all 500 were held
    statuses = []
    for sock in bodies:
        status, _headers, reply = read_reply(sock)
        statuses.append(status)
        assert json.loads(reply)["error"]["code"] == "request_timeout"
    assert set(statuses) == {408}
    assert all(closed_by_server(sock, 5) for sock in bodies + heads + idle)
    elapsed = time.monotonic() - opened
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10, elapsed
    assert server.metrics()["dstc_rejected_requests_total{reason=body_timeout}"] >= 300


def test_a_stream_nobody_reads_is_disconnected_and_its_request_freed(servers):
    server = servers["onnxruntime"]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once: the server's writes back up
    sock.connect(server.address)
    body = json.dumps({"model": server.name, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    sock.sendall(post_head("/v1/completions", f"Content-Length: {len(body)}", f"Authorization: Bearer {KEY}").encode()
                 + body.encode())
    time.sleep(TIMEOUT_S + 3)  # never reading
    assert closed_by_server(sock, 10)
    drained = server.wait_for(lambda m: m["dstc_running_batch_size"] == 0, timeout=10)
    assert drained["dstc_queue_depth"] == 0


def test_non_streaming_requests_whose_clients_went_away_leave_the_batch(servers):
    """Issue #39: each step brought a piece of text, so the check for a gone client (made only after a quiet
    half-second) never ran: abandoned requests kept their slots and generated all their tokens."""
    server = servers["onnxruntime"]
    before = server.metrics()
    body = json.dumps({"model": server.name, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0,
                       "ignore_eos": True})
    head = post_head("/v1/completions", f"Content-Length: {len(body)}", f"Authorization: Bearer {KEY}").encode()
    clients = [socket.create_connection(server.address) for _ in range(4)]
    for sock in clients:
        sock.sendall(head + body.encode())
    server.wait_for(lambda m: m["dstc_running_batch_size"] == 4, timeout=30)
    for sock in clients:
        sock.close()
    after = server.wait_for(lambda m: m["dstc_running_batch_size"] == 0, timeout=30)
    cancelled = "dstc_requests_total{finish_reason=cancelled}"
    assert after[cancelled] - before.get(cancelled, 0) == 4
    assert after["dstc_generation_tokens_total"] - before["dstc_generation_tokens_total"] < 4 * 1000


# -- case 6: authentication ------------------------------------------------------------------------------------------


def test_requests_need_an_api_key_and_health_and_metrics_stay_open(servers):
    server = servers["onnxruntime"]
    completion = {"model": server.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    for headers, message in (({"Authorization": ""}, "didn't provide an API key"),
                             ({"Authorization": "Bearer sk-wrong"}, "Incorrect API key"),
                             ({"Authorization": f"Basic {KEY}"}, "Incorrect API key"),
                             ({"Authorization": f"Bearer {KEY}x"}, "Incorrect API key")):
        response = httpx.post(server.base + "/v1/completions", json=completion, headers=headers)
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer", response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert message in error["message"] and KEY not in response.text
    for path in ("/v1/models", "/v1/nowhere"):
        assert httpx.get(server.base + path).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    for key in (KEY, SECOND_KEY):  # both lines of the key file
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0)
        assert client.completions.create(**completion).choices[0].text == "9750"
    assert httpx.get(server.base + "/health").status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 200
    assert server.metrics()["dstc_rejected_requests_total{reason=unauthorized}"] >= 7
    ov = servers["openvino"]  # --api-key
    assert httpx.get(ov.base + "/v1/models").status_code == 401
    assert httpx.get(ov.base + "/v1/models", headers=ov.auth).status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "example.invalid"])
def test_an_address_other_than_the_loopback_is_not_served_without_a_key(artifacts, host):
    result = subprocess.run([sys.executable, "-m", "toolchain", "serve", str(artifacts["onnxruntime"].path),
                             "--host", host, "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"dstc: error: --host {host} is reachable")
    assert "--api-key" in result.stderr and "--allow-unauthenticated" in result.stderr


def test_api_keys_and_addresses(tmp_path):
    from toolchain.serve.auth import authorized, check_exposure, is_loopback, load_api_keys

    keys = tmp_path / "keys"
    keys.write_text(f"  {KEY}  \n\n{SECOND_KEY}\n")
    assert load_api_keys(None, keys) == [KEY, SECOND_KEY]
    assert load_api_keys("k1", None) == ["k1"] and load_api_keys(None, None) == []
    (tmp_path / "empty").write_text("\n \n")
    for bad_key, bad_file, message in ((None, tmp_path / "empty", "holds no key"),
                                       (None, tmp_path / "missing", "cannot read the API key file"),
                                       ("two words", None, "visible ASCII"), ("clé", None, "visible ASCII")):
        with pytest.raises(InputError, match=message):
            load_api_keys(bad_key, bad_file)
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))
    check_exposure("127.0.0.1", (), False)
    check_exposure("0.0.0.0", (KEY,), False)
    check_exposure("0.0.0.0", (), True)
    with pytest.raises(InputError, match="reachable from other machines"):
        check_exposure("0.0.0.0", (), False)
    assert authorized(f"Bearer {KEY}".encode(), (SECOND_KEY, KEY))
    assert authorized(f"bearer  {KEY} ".encode(), (KEY,))
    for header in (None, b"", KEY.encode(), f"Bearer {KEY[:-1]}".encode(), b"Bearer ", f"Token {KEY}".encode()):
        assert not authorized(header, (KEY,)), header


def test_a_port_in_use_is_refused_in_one_line_before_the_artifact_is_opened(monkeypatch, capsys, tmp_path):
    from conftest import run_cli

    from toolchain.serve import server as server_module

    opened = []
    real_open = server_module.open_artifact

    def open_artifact(path):
        opened.append(path)
        return real_open(path)

    monkeypatch.setattr(server_module, "open_artifact", open_artifact)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(monkeypatch, capsys, "serve", tmp_path / "artifact", "--port", port)
    assert (code, out) == (2, "")
    assert err == f"dstc: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert opened == []  # nor its tokenizer read, nor an engine started


# -- case 7: internal errors -----------------------------------------------------------------------------------------


def test_a_500_says_internal_error_and_the_request_id_the_log_carries(servers):
    server = servers["onnxruntime"]
    result: dict = {}

    def long_request() -> None:
        result["response"] = server.post("/v1/completions", {"model": server.name, "prompt": PROMPT,
                                                             "max_tokens": 1000, "ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    server.wait_for(lambda m: m["dstc_running_batch_size"] == 1, timeout=30)
    pid = httpx.get(server.base + "/health").json()["engine_pid"]
    os.kill(pid, signal.SIGKILL)  # the runtime crashing under the request
    thread.join(60)
    response = result["response"]
    request_id = response.headers["X-Request-Id"]
    assert re.fullmatch(r"req-[0-9a-f]{24}", request_id)
    assert response.status_code == 500 and response.json()["error"] == {
        "message": f"internal error (request id {request_id})", "type": "server_error", "param": None, "code": None}
    assert server.logged(request_id, "the engine process died (killed by SIGKILL)")
    deadline = time.monotonic() + 60
    while httpx.get(server.base + "/health").status_code != 200:  # the engine process is started again
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_an_unexpected_exception_is_a_500_with_the_id_its_traceback_is_logged_with(artifacts, caplog):
    from fastapi.testclient import TestClient

    from toolchain.serve.api import create_app
    from toolchain.serve.server import Service

    service = Service(artifacts["onnxruntime"])

    def broken(model: str) -> None:  # a bug in the server, with internals in its message
        raise RuntimeError("/opt/build/private/path: incompatible function arguments")

    service.check_model = broken
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"model": service.model_name, "prompt": PROMPT})
        request_id = response.headers["X-Request-Id"]
        assert response.status_code == 500
        assert response.json()["error"]["message"] == f"internal error (request id {request_id})"
        assert "/opt/build" not in response.text and "RuntimeError" not in response.text
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info is not None
        assert "RuntimeError: /opt/build/private/path" in logging.Formatter().formatException(logged[0].exc_info)
        ids = {client.get(path).headers["X-Request-Id"] for path in ("/health", "/metrics", "/v1/models", "/nowhere")}
        assert len(ids) == 4 and all(re.fullmatch(r"req-[0-9a-f]{24}", i) for i in ids)
