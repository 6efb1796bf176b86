"""dstc serve's serving conventions (issue #41), as OpenAI's API and vLLM have them: --served-model-name, an unknown
model a 404 with OpenAI's error body, an access log line per request, SIGTERM a drain and exit 0."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest
from serve_helpers import Server

pytestmark = pytest.mark.timeout(300)

MODEL = "deepseek-v3-tiny"


@pytest.fixture(scope="module")
def fp32(artifact):
    return artifact(MODEL, "onnxruntime")


def test_served_model_names_unknown_ones_404_and_an_access_line_per_request(fp32):
    server = Server(fp32, "--served-model-name", "dsv3", "--served-model-name", "tiny", "--deterministic")
    try:
        assert server.logged("dstc serve: --deterministic: nothing to do")  # fp32: batch-invariant as it is
        assert [m["id"] for m in httpx.get(server.base + "/v1/models").json()["data"]] == ["dsv3", "tiny"]
        ok = server.post("/v1/completions", {"model": "tiny", "prompt": "321+654=", "max_tokens": 4,
                                             "temperature": 0})
        assert ok.status_code == 200 and ok.json()["model"] == "dsv3" and ok.json()["choices"][0]["text"] == "9750"
        prompt_tokens = ok.json()["usage"]["prompt_tokens"]
        # the directory's name is not served once names are given
        unknown = server.post("/v1/completions", {"model": fp32.path.name, "prompt": "1+1="})
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert error == {"message": error["message"], "type": "invalid_request_error", "param": "model",
                         "code": "model_not_found"} and "'dsv3', 'tiny'" in error["message"]
        line = server.logged(ok.headers["x-request-id"])
        assert len(line) == 1 and '"POST /v1/completions" 200 ' in line[0] and \
            f" {prompt_tokens}+4 tokens " in line[0] and line[0].startswith("dstc serve: 127.0.0.1 ")
        assert server.logged(unknown.headers["x-request-id"], '"POST /v1/completions" 404 ')
        assert server.logged('"GET /v1/models" 200 ')
    finally:
        server.stop()


def test_sigterm_drains_the_requests_in_flight_and_exits_0(fp32):
    server = Server(fp32)
    result = {}

    def long_request() -> None:
        result["response"] = server.post("/v1/completions", {"model": server.name, "prompt": "321+654=",
                                                             "max_tokens": 400, "temperature": 0,
                                                             "ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    server.wait_for(lambda m: m.get("dstc_running_batch_size", 0) >= 1, timeout=30)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    thread.join(10)
    response = result["response"]
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 400
    assert server.logged("dstc serve: SIGTERM: draining (")
    assert server.logged("dstc serve: stopped (SIGTERM)")
    with pytest.raises(httpx.TransportError):
        httpx.get(server.base + "/health", timeout=2)
