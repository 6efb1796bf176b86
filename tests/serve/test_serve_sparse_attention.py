"""dstc serve end to end on the embedded DeepSeek-V3.2 and V4 models (sparse and compressed attention, whose caches
only dstc's runner batches): chat completions, streamed and not, and continuous batching that gives each request its
batch-1 greedy tokens. Slow: each model's artifacts are exported and compiled here (about a minute per model)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from serve_helpers import Server

from toolchain.models.corpus import task_examples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODELS = ("deepseek-v32-tiny", "deepseek-v4-tiny")
# fp32 on ONNX Runtime; INT4 on OpenVINO, run at f32 (--openvino-f32): at the CPU plugin's bf16 default a row's
# rounding depends on the batch it runs in (tests/serve/test_serve.py)
BACKENDS = {
    "onnxruntime": ({"compile": {"backend": "onnxruntime", "verify": False}}, ()),
    "openvino": ({"compress": {"scheme": "int4-grouped", "group_size": 128},
                  "compile": {"backend": "openvino", "verify": False}}, ("--openvino-f32",)),
}


def _completion(server: Server, prompt: str) -> tuple[int, str]:
    response = httpx.post(server.base + "/v1/completions", timeout=60, json={
        "model": server.name, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    return response.status_code, response.json()["choices"][0]["text"] if response.status_code == 200 else ""


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("model", MODELS)
def test_chat_streamed_chat_and_four_concurrent_requests_as_alone(artifact, model, backend):
    art = artifact(model, backend, BACKENDS[backend][0])
    server = Server(art, *BACKENDS[backend][1])
    try:
        messages = [{"role": "user", "content": "321+654="}]
        chat = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
            "model": server.name, "messages": messages, "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200
        text = chat.json()["choices"][0]["message"]["content"]
        assert text

        with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=60, json={
                "model": server.name, "messages": messages, "max_tokens": 8, "temperature": 0,
                "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        deltas = [json.loads(e)["choices"] for e in events[:-1]]
        pieces = [c[0]["delta"].get("content") or "" for c in deltas if c]
        assert "".join(pieces) == text and sum(bool(p) for p in pieces) > 1

        # long prompts as well as problems: past the V3.2 indexer's top-k and V4's window and compression blocks
        prompts = [p for p, _ in task_examples("heldout", 2)] + [
            "The old man walked to the harbor in the evening. Alice found the red lamp near the bridge. " * k
            for k in (1, 2)]
        alone = [_completion(server, p) for p in prompts]
        assert all(code == 200 and t for code, t in alone), alone
        together: list[tuple[int, str] | None] = [None] * len(prompts)
        go = threading.Barrier(len(prompts))

        def run(i: int) -> None:
            go.wait(10)
            together[i] = _completion(server, prompts[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert together == alone
        assert server.metrics()["dstc_decode_step_seconds_count"] > 0
    finally:
        server.stop()
