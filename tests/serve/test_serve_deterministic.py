"""dstc serve --deterministic (toolchain/runtime/batch_rows.py): on an ONNX Runtime INT4 artifact, whose MatMulNBits
and QMoE give a row other bits beside other rows than alone, a request decodes to the bits and tokens it gets alone
whatever else runs; a no-op on fp32 artifacts (refused with --speculate: test_serve_speculative.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from serve_helpers import Server

from toolchain.models.corpus import task_examples
from toolchain.runtime.batch_rows import RowByRow, batch_variance
from toolchain.runtime.batching import batched_decoder
from toolchain.runtime.decoder import open_decoder

pytestmark = pytest.mark.timeout(300)

MODEL = "deepseek-v3-tiny"
ORT_INT4 = {"compress": {"scheme": "int4-grouped", "group_size": 128, "sym": False, "backup": "int8"},
            "compile": {"backend": "onnxruntime", "verify": False}}


def texts(count: int) -> list[str]:
    """Held-out problems after one to three solved ones: prompts of different lengths."""
    ex = task_examples("heldout", count + 4)
    return ["".join(p + a + "\n" for p, a in ex[i:i + 1 + i % 3]) + ex[i + 3][0] for i in range(count)]


@pytest.fixture(scope="module")
def int4(artifact):
    return artifact(MODEL, "onnxruntime", ORT_INT4)


def test_a_row_decodes_to_its_bits_alone_beside_rows_that_join_and_leave(int4):
    assert "MatMulNBits" in batch_variance(int4) and "QMoE" in batch_variance(int4)
    decoder = open_decoder(int4, threads=2)
    pad = int4.pad_token_id
    tokenizer = int4.tokenizer()
    prompts = {i: tokenizer(text)["input_ids"] for i, text in enumerate(texts(4))}

    def rows() -> RowByRow:
        return RowByRow(lambda: batched_decoder(decoder, pad), pad)

    alone_batch = rows()
    alone = [alone_batch.join({0: prompts[0]})[0]]
    for _ in range(6):
        alone.append(alone_batch.step({0: int(np.argmax(alone[-1]))})[0])
    # row 0 beside others: two join with it, one more after two steps, one leaves after three
    batch = rows()
    joined = batch.join({0: prompts[0], 1: prompts[1], 2: prompts[2]})
    seen, last = [joined[0]], {key: int(np.argmax(row)) for key, row in joined.items()}
    for step in range(6):
        if step == 2:
            last[3] = int(np.argmax(batch.join({3: prompts[3]})[3]))
        if step == 3:
            batch.leave([1])
            del last[1]
        out = batch.step(last)
        last = {key: int(np.argmax(row)) for key, row in out.items()}
        seen.append(out[0])
    assert len(batch) == 3 and batch.tokens_held() > 0
    assert all(np.array_equal(a, b) for a, b in zip(alone, seen, strict=True))


def test_concurrent_greedy_requests_get_their_text_alone(int4):
    server = Server(int4, "--deterministic", "--max-batch", "8")
    try:
        assert server.logged("--deterministic: each request in a batch of its own", "MatMulNBits")
        prompts = texts(6)

        def complete(prompt: str) -> str:
            response = server.post("/v1/completions", {"model": server.name, "prompt": prompt, "max_tokens": 16,
                                                       "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        alone = [complete(p) for p in prompts]
        before = server.metrics()
        together: list[str | None] = [None] * len(prompts)

        def send(i: int) -> None:
            together[i] = complete(prompts[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for thread in threads:  # staggered: each joins the running batch at another step
            thread.start()
            time.sleep(0.01)
        for thread in threads:
            thread.join(120)
        assert together == alone
        after = server.metrics()
        tokens = after["dstc_generation_tokens_total"] - before["dstc_generation_tokens_total"]
        steps = after["dstc_decode_step_seconds_count"] - before["dstc_decode_step_seconds_count"]
        # one request alone takes 15 decode steps after its prefill: fewer in all means some steps held several
        # requests (how many overlap depends on the machine's load; that any did is what the check needs)
        alone_steps = 15 * len(prompts)
        assert tokens == 16 * len(prompts) and steps < alone_steps, f"{steps} steps: they did not run together"
    finally:
        server.stop()


def test_fp32_is_already_invariant(artifact):
    """No batch-variant op in an fp32 graph: --deterministic changes nothing there (its startup line is checked in
    test_serve_conventions.py, whose server runs with it)."""
    assert batch_variance(artifact(MODEL, "onnxruntime")) is None
