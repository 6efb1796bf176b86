"""A long prompt prefilled in query chunks through the KV cache (toolchain/runtime/prefill_chunks.py): the chunks'
budget, and the same logits, greedy tokens, extra outputs and batched runs as one forward, on both backends, for
MLA's latent graph (DeepSeek-V3 and V2-Lite) and a per-head one (Qwen)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from toolchain.runtime.batching import batched_decoder
from toolchain.runtime.batching_openvino import StatefulBatch
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.generate import answer_record, greedy_logits, left_pad
from toolchain.runtime.prefill_chunks import BUDGET_FLOOR, PrefillChunking
from toolchain.runtime.routing import router_outputs
from toolchain.verify.parity import PROMPTS

BACKENDS = ("onnxruntime", "openvino")
MODELS = ("deepseek-v3-tiny", "deepseek-v2-lite-tiny", "r1-distill-qwen-tiny")


def test_chunks_cover_the_prompt_within_the_budget_and_shrink_as_the_cache_grows():
    chunking = PrefillChunking(heads=128, budget_bytes=256 << 20)
    spans = chunking.spans(batch=1, past=0, new=16384)
    assert spans[0][0] == 0 and spans[-1][1] == 16384
    assert all(a == b for (_, a), (b, _) in itertools.pairwise(spans))  # contiguous
    sizes = [end - start for start, end in spans]
    assert all(4 * 128 * (end - start) * end <= 256 << 20 for start, end in spans)
    assert sizes[0] == 724 and sizes[-2] == 32  # 4·128·724·724 ≤ 256 MiB < 4·128·725·725; the last: what is left
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True)
    assert chunking.spans(batch=1, past=0, new=500) == [(0, 500)]  # a prompt that fits: one forward
    assert chunking.spans(batch=4, past=10**6, new=3) == [(0, 1), (1, 2), (2, 3)]  # never less than a position


def test_deepseek_v32_chunks_count_the_gathered_latent_rows():
    """V3.2's latent graph gathers k = min(index_topk, past + C) rows of 576 floats per query beside the scores: its
    chunks are smaller than V3's under index_topk and every chunk's bytes stay within the budget."""
    config = {"num_attention_heads": 128, "index_topk": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    v32 = PrefillChunking.for_model(config, 0)
    assert v32 is not None and v32.gathered == (2048, 576)
    v3 = PrefillChunking.for_model({"num_attention_heads": 128, "kv_lora_rank": 512}, 0)
    assert v3 is not None and v3.gathered == (0, 0)
    spans = v32.spans(batch=1, past=0, new=16384)
    assert spans[-1][1] == 16384 and all(a == b for (_, a), (b, _) in itertools.pairwise(spans))
    assert all(4 * (end - start) * (128 * end + 576 * min(end, 2048)) <= BUDGET_FLOOR for start, end in spans)
    assert spans[0][1] < v3.spans(batch=1, past=0, new=16384)[0][1]


def test_the_budget_is_the_floor_or_a_sixteenth_of_the_weights():
    assert PrefillChunking.for_model({"num_attention_heads": 16}, 10**6) == PrefillChunking(16, BUDGET_FLOOR)
    assert PrefillChunking.for_model({"num_attention_heads": 16}, 16 << 30).budget_bytes == 1 << 30
    assert PrefillChunking.for_model({}, 8 << 30) is None


def small_chunks(art, prompts: list[list[int]]) -> PrefillChunking:
    """A budget that splits the batch's prefill into chunks of about 5 positions."""
    heads = art.config["num_attention_heads"]
    width = max(len(p) for p in prompts)
    return PrefillChunking(heads, 4 * len(prompts) * heads * 5 * width)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", MODELS)
def test_only_a_graph_that_would_hold_its_scores_is_chunked(artifact, model, backend):
    """MLA's latent graph (MatMuls over the latent) on both backends and ONNX Runtime's per-head graph (its CPU
    attention holds the probabilities) are chunked; OpenVINO's per-head IR, whose SDPA kernel does not hold them,
    prefills in one forward."""
    art = artifact(model, backend)
    decoder = open_decoder(art, threads=2, openvino_f32=True)
    one_shot = backend == "openvino" and model == "r1-distill-qwen-tiny"
    assert (decoder.chunking is None) == one_shot
    if not one_shot:
        assert decoder.chunking == PrefillChunking.for_model(art.config, art.size_bytes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", MODELS)
def test_a_chunked_prefill_decodes_as_one_forward(artifact, model, backend):
    """A left-padded batch of two prompts (the longer one ~30 tokens, ~6 chunks): the prefill's logits at every
    position, the next 16 greedy tokens and their logits, and the routers' expert choices (an extra output joined
    over the chunks) as one forward gives them, at exact numerics."""
    art = artifact(model, backend)
    tok = art.tokenizer()
    prompts = [tok(PROMPTS[1])["input_ids"], tok(PROMPTS[2] + " " + PROMPTS[0])["input_ids"]]
    routers = list(router_outputs(art).values())
    decoder = open_decoder(art, threads=2, openvino_f32=True, extra_outputs=routers)
    chunking, runs = small_chunks(art, prompts), {}
    for chunked in (False, True):
        decoder.chunking = chunking if chunked else None
        tokens, logits = greedy_logits(decoder, prompts, 17, art.pad_token_id)  # prefill + 16 decode steps
        decoder.reset()
        decoder.forward(*left_pad(prompts, art.pad_token_id))
        runs[chunked] = tokens, logits, decoder.chunks, {name: decoder.extras[name] for name in routers}
    (tokens, logits, one, extras), (chunked_tokens, chunked_logits, chunks, chunked_extras) = runs[False], runs[True]
    assert len(one) == 1 and len(chunks) >= 5 and sum(chunks) == max(len(p) for p in prompts)
    np.testing.assert_array_equal(chunked_tokens, tokens)
    scale = max(float(r.max() - r.min()) for r in logits)
    assert max(float(np.abs(a - b).max()) for a, b in zip(chunked_logits, logits)) / scale <= 1e-5
    for name in routers:
        assert chunked_extras[name].shape == extras[name].shape
        real = left_pad(prompts, art.pad_token_id)[1].reshape(-1).astype(bool)
        same = (np.sort(chunked_extras[name][real], -1) == np.sort(extras[name][real], -1)).all(-1)
        assert same.mean() >= 0.95  # a near-tied router score may flip at float rounding


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_joining_batch_is_prefilled_in_chunks_to_the_same_tokens(artifact, backend):
    """The server's runners (PersistentBatch on ONNX Runtime, StatefulBatch on OpenVINO) prefill joining sequences
    in the decoder's chunks: a join of two prompts, then 8 steps, give one forward's tokens."""
    art = artifact("deepseek-v3-tiny", backend)
    tok = art.tokenizer()
    prompts = {0: tok(PROMPTS[1])["input_ids"], 1: tok(PROMPTS[2] + " " + PROMPTS[0])["input_ids"]}
    decoder = open_decoder(art, threads=2, openvino_f32=True)
    chunking, runs = small_chunks(art, list(prompts.values())), {}
    for chunked in (False, True):
        decoder.chunking = chunking if chunked else None
        batch = StatefulBatch(decoder, art.pad_token_id) if backend == "openvino" else \
            batched_decoder(decoder, art.pad_token_id)
        logits = batch.join(prompts)
        out = {key: [int(row.argmax())] for key, row in logits.items()}
        first = np.stack([logits[key] for key in prompts])
        for _ in range(8):
            for key, row in batch.step({key: out[key][-1] for key in prompts}).items():
                out[key].append(int(row.argmax()))
        runs[chunked] = first, out
    (first, out), (chunked_first, chunked_out) = runs[False], runs[True]
    assert chunked_out == out
    np.testing.assert_allclose(chunked_first, first, atol=1e-5 * float(first.max() - first.min()))


def test_generate_records_the_prefill_chunks_it_used(artifact):
    """`dstc generate --json`'s record: the prefill's chunks and time to the first token, the same answer."""
    art = artifact("deepseek-v3-tiny", "onnxruntime")
    decoder = open_decoder(art, threads=2)
    one = answer_record(art, decoder, PROMPTS[2] + " " + PROMPTS[0], max_new_tokens=6, chat=False)
    decoder.chunking = small_chunks(art, [[0] * one["prompt_tokens"]])
    chunked = answer_record(art, decoder, PROMPTS[2] + " " + PROMPTS[0], max_new_tokens=6, chat=False)
    assert (one["prefill_chunks"], one["largest_prefill_chunk"]) == (1, one["prompt_tokens"])
    assert chunked["prefill_chunks"] > 1 and chunked["largest_prefill_chunk"] < one["prompt_tokens"]
    assert chunked["tokens"] == one["tokens"] and 0 < chunked["ttft_seconds"] <= chunked["seconds"]
