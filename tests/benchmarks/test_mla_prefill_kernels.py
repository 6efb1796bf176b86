"""benchmarks/mla_prefill_kernels.py's graphs at tiny widths: the per-head form on ONNX Runtime's fused kernels
(MultiHeadAttention in query blocks, the normaliser through an extra key; GroupQueryAttention, V padded) gives
today's chunked absorbed output and a numpy reference, and holds the fused op and no Softmax over a score row."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from benchmark_modules import load

TOKENS, BLOCK = 40, 16  # three query blocks, the last one short


@pytest.fixture(scope="module")
def bench():
    return load("mla_prefill_kernels", "mla_prefill_kernels")


@pytest.fixture(scope="module")
def tiny(bench):
    return bench.Widths(heads=4, nope=16, rope=8, v=16, rank=32)


def numpy_reference(w, x: dict[str, np.ndarray]) -> np.ndarray:
    """Causal attention of the per-head form in float64: [1, H, S, v]."""
    kv = (x["latent"][0].astype(np.float64) @ x["kv_b"]).reshape(TOKENS, w.heads, w.nope + w.v)
    keys = np.concatenate([kv[..., :w.nope], np.broadcast_to(x["k_rot"][0][:, None], (TOKENS, w.heads, w.rope))],
                          axis=-1).transpose(1, 0, 2)
    q = np.concatenate([x["q_nope"][0], x["q_rot"][0]], axis=-1).astype(np.float64)
    scores = q @ keys.transpose(0, 2, 1) * w.scale + np.triu(np.full((TOKENS, TOKENS), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ kv[..., w.nope:].transpose(1, 0, 2))[None]


@pytest.mark.parametrize("spread", [1.0, 4.0])  # 4: scores spread over tens, rows whose maximum lies before the block
def test_flash_blocks_match_the_absorbed_chunks_and_the_reference(bench, tiny, spread):
    x = bench.inputs(tiny, TOKENS, seed=1)
    x["q_nope"], x["q_rot"] = x["q_nope"] * spread, x["q_rot"] * spread
    feeds = {k: v for k, v in x.items() if k != "kv_b"}
    flash = bench.session(bench.flash_graph(tiny, x["kv_b"], TOKENS, BLOCK)).run(None, feeds)[0]
    gqa = bench.session(bench.gqa_graph(tiny, x["kv_b"], TOKENS)).run(None, feeds)[0]
    absorbed = bench.absorbed_chunked(bench.session(bench.absorbed_graph(tiny, x["kv_b"])), x,
                                      [(0, 13), (13, 29), (29, TOKENS)])
    reference = numpy_reference(tiny, x)
    assert flash.shape == gqa.shape == absorbed.shape == (1, tiny.heads, TOKENS, tiny.v)
    scale = np.abs(reference).max()
    assert np.abs(flash - reference).max() <= 1e-5 * scale
    assert np.abs(gqa - reference).max() <= 1e-5 * scale
    assert np.abs(absorbed - reference).max() <= 1e-5 * scale
    # the first row sees one key: its value row exactly
    first = reference[0, :, 0]
    np.testing.assert_allclose(flash[0, :, 0], first, rtol=1e-5, atol=1e-6 * scale)


def test_flash_graph_holds_one_fused_attention_per_query_block(bench, tiny):
    x = bench.inputs(tiny, TOKENS)
    graph = onnx.load_from_string(bench.flash_graph(tiny, x["kv_b"], TOKENS, BLOCK)).graph
    fused = [n for n in graph.node if n.op_type == "MultiHeadAttention"]
    assert len(fused) == -(-TOKENS // BLOCK) == 3
    assert {n.domain for n in fused} == {"com.microsoft"}
    # the flash path's conditions: no mask, no attention bias, no past (inputs 4-7 absent), not causal
    assert all(len(n.input) == 3 for n in fused)
    assert all(a.name != "unidirectional" or a.i == 0 for n in fused for a in n.attribute)
    assert not [n for n in graph.node if n.op_type == "Softmax"]
    plain = onnx.load_from_string(bench.plain_graph(tiny, x["kv_b"], TOKENS)).graph
    assert [n.op_type for n in plain.node].count("Softmax") == 1
    assert not [n for n in plain.node if n.op_type == "MultiHeadAttention"]


def test_gqa_graph_holds_one_fused_causal_attention(bench, tiny):
    x = bench.inputs(tiny, TOKENS)
    graph = onnx.load_from_string(bench.gqa_graph(tiny, x["kv_b"], TOKENS)).graph
    fused = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(fused) == 1 and fused[0].domain == "com.microsoft"
    assert not [n for n in graph.node if n.op_type in ("Softmax", "MultiHeadAttention")]
