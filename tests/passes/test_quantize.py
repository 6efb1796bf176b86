"""passes.quantize: int8-per-head (scales never straddle a head) and to-matmul-nbits (ORT's quantized-weight
kernels, NNCF's 4-bit zero points packed), on small graphs and on the tiny exports of every architecture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from passes import create_pass, get_pass
from passes.quantize._weights import dequantize_linear, group_bounds, matmul_nbits_weight, quantize_int8
from passes.quantize.int8_per_head import Int8PerHead, projection_of
from passes.quantize.matmul_nbits import ToMatMulNBits, nbits_layout, pack_nibbles
from passes_helpers import make_model, node, op_counts, run_ort, to_bytes

from conftest import make_checkpoint, tiny_configs

ARCHS = ("llama", "qwen2", "deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module")
def tiny_exports(tmp_path_factory):
    from toolchain.stages.alone import export

    root = tmp_path_factory.mktemp("quantize-exports")
    configs = tiny_configs()
    out = {}
    for arch in ARCHS:
        export(str(make_checkpoint(configs[arch], root / "ckpt" / arch)), root / arch, parity=())
        out[arch] = root / arch
    return out


def head_widths(config: dict) -> dict[str, int]:
    """Head width of each projection whose outputs are heads, from the checkpoint config."""
    if config["model_type"].startswith("deepseek"):
        qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        return {"q_proj": qk, "q_b_proj": qk, "kv_b_proj": config["qk_nope_head_dim"] + config["v_head_dim"]}
    d = config["hidden_size"] // config["num_attention_heads"]
    return {"q_proj": d, "k_proj": d, "v_proj": d}


def test_passes_are_registered():
    assert get_pass("int8-per-head").targets == ("any",)
    assert get_pass("to-matmul-nbits").targets == ("onnxruntime",)
    assert isinstance(create_pass("int8-per-head"), Int8PerHead)


def test_quantize_int8_groups_share_one_scale():
    w = np.random.default_rng(0).normal(size=(32, 12)).astype(np.float32)
    for sym in (False, True):
        q = quantize_int8(w, 4, sym=sym)
        assert np.unique(q.scale.reshape(3, 4), axis=1).shape == (3, 1)
        assert np.abs(q.dequantize() - w).max() <= q.scale.max() * 0.51
    with pytest.raises(ValueError):
        group_bounds(12, 5)


@pytest.mark.parametrize("arch", ARCHS)
def test_per_head_scales_never_straddle_a_head(arch, tiny_exports):
    config = json.loads((tiny_exports[arch] / "export.json").read_text())
    checkpoint = json.loads((Path(config["source"]["path"]) / "config.json").read_text())
    widths = head_widths(checkpoint)
    model = ir.load(tiny_exports[arch] / "model.onnx")
    pass_ = Int8PerHead()  # head widths inferred from the graph's Reshapes
    counts = pass_(model).counts
    assert not pass_.near_misses(model)
    per_head = {name: groups for name, groups in pass_.groups.items() if projection_of(name) in widths}
    assert counts["per_head"] == len(per_head) > 0
    for name, groups in per_head.items():
        width = widths[projection_of(name)]
        assert all(end - start == width and start % width == 0 for start, end in groups), name
    # the scales in the graph: one value per head, the same on every channel of the head
    for dq in (n for n in model.graph if n.op_type == "DequantizeLinear"):
        weight = dq.inputs[0].name.removesuffix("_quantized")
        if weight in per_head:
            scale = dq.inputs[1].const_value.numpy()
            width = widths[projection_of(weight)]
            assert (scale.reshape(-1, width) == scale.reshape(-1, width)[:, :1]).all()
            assert len(np.unique(scale)) == len(scale) // width


def test_per_head_uses_given_head_widths_over_the_graph():
    w = np.random.default_rng(1).normal(size=(16, 24)).astype(np.float32)
    model = make_model([node("MatMul", ["x", "layers.0/self_attn/q_proj/weight"], ["y"])], {"x": [2, 16]}, ["y"],
                       {"layers.0/self_attn/q_proj/weight": w})
    pass_ = Int8PerHead({"q_proj": 8})
    assert pass_(model).counts == {"per_head": 1}
    assert pass_.groups["layers.0/self_attn/q_proj/weight"] == [(0, 8), (8, 16), (16, 24)]
    model = make_model([node("MatMul", ["x", "layers.0/self_attn/q_proj/weight"], ["y"])], {"x": [2, 16]}, ["y"],
                       {"layers.0/self_attn/q_proj/weight": w})
    pass_ = Int8PerHead()  # no Reshape to heads: per channel, and said so
    assert pass_(model).counts == {"per_channel": 1}
    assert "no head width" in str(pass_.near_misses(model)[0])


def test_given_head_widths_name_the_projections_with_heads():
    """The exporter's record (head_blocks) decides which projections have heads, whatever their names: an
    indexer's wq_b is quantized per head, a q_proj it does not list per channel."""
    w = np.random.default_rng(2).normal(size=(16, 24)).astype(np.float32)
    weights = {"layers.0/self_attn/indexer/wq_b/weight": w, "layers.0/self_attn/q_proj/weight": w.copy()}
    model = make_model([node("MatMul", ["x", "layers.0/self_attn/indexer/wq_b/weight"], ["a"]),
                        node("MatMul", ["x", "layers.0/self_attn/q_proj/weight"], ["b"])],
                       {"x": [2, 16]}, ["a", "b"], weights)
    pass_ = Int8PerHead({"wq_b": 6})
    assert pass_(model).counts == {"per_head": 1, "per_channel": 1}
    assert pass_.groups["layers.0/self_attn/indexer/wq_b/weight"] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert pass_.groups["layers.0/self_attn/q_proj/weight"] == group_bounds(24, 1)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("k, block", [(64, 64), (96, 32), (40, 64)])  # one block, 3 unpadded blocks, one padded
def test_to_matmul_nbits_is_exact_for_8_bit_weights(sym, k, block):
    rng = np.random.default_rng(k)
    w = rng.normal(size=(k, 40)).astype(np.float32)
    table = rng.normal(size=(50, 40)).astype(np.float32)
    model = make_model([node("Gather", ["table", "ids"], ["e"], axis=0), node("MatMul", ["x", "w"], ["y"]),
                        node("MatMul", ["e", "w2"], ["z"])],
                       {"x": [3, k], "ids": ([2, 5], np.int64)}, ["y", "z"],
                       {"w": w, "table": table, "w2": rng.normal(size=(40, 8)).astype(np.float32)})
    Int8PerHead(sym=sym)(model)
    feeds = {"x": rng.normal(size=(3, k)).astype(np.float32), "ids": rng.integers(0, 50, (2, 5))}
    expected = run_ort(model, feeds)
    counts = ToMatMulNBits(accuracy_level=0)(model).counts
    assert counts == {"matmul_nbits_8bit": 2, "gather_dequantize": 1}
    assert op_counts(model)["MatMulNBits"] == 2 and "DequantizeLinear" not in op_counts(model)
    nbits = next(n for n in model.graph if n.op_type == "MatMulNBits" and n.attributes["K"].as_int() == k)
    assert nbits.attributes["block_size"].as_int() == block
    assert nbits.inputs[1].const_value.size == 40 * max(k, block)  # padded only where k has no divisor to block by
    for got, want in zip(run_ort(model, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(matmul_nbits_weight(nbits) - w).max() < np.abs(w).max() / 100


def test_nbits_layout_takes_the_fewest_bytes():
    assert nbits_layout(1536, 5) == (512, 3)  # R1-Distill-Qwen's lm_head: 3 blocks, where one padded was 2048
    assert nbits_layout(8960, 5) == (256, 35)
    assert nbits_layout(2048, 4) == (2048, 1)
    assert nbits_layout(40, 5) == (64, 1)  # no power-of-two divisor >= 16
    assert nbits_layout(16 * 111, 5) == (2048, 1)  # 111 blocks of 16 cost more than padding to 2048


def test_pack_nibbles_low_first():
    assert pack_nibbles(np.array([[1, 2, 3]])).tolist() == [[0x21, 0x03]]


def nncf_int4(model_proto: onnx.ModelProto, mode: str, group_size: int, **kwargs) -> onnx.ModelProto:
    import nncf

    return nncf.compress_weights(model_proto, mode=getattr(nncf.CompressWeightsMode, mode), group_size=group_size,
                                 all_layers=True, **kwargs)


def test_trap_nncf_int4_asym_zero_points_are_packed_for_ort():
    """NNCF 3.4 writes MatMulNBits zero points one per byte; ORT 1.32 refuses them; the pass packs them."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(256, 48)).astype(np.float32)
    base = make_model([node("MatMul", ["x", "w"], ["y"])], {"x": [2, 256]}, ["y"], {"w": w})
    proto = nncf_int4(ir.serde.serialize_model(base), "INT4_ASYM", 32)
    with pytest.raises(Exception, match="zero_points initializer shape"):
        ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    model = ir.serde.deserialize_model(proto)
    nbits = next(n for n in model.graph if n.op_type == "MatMulNBits")
    w_hat = matmul_nbits_weight(nbits)  # the reader takes both layouts
    assert ToMatMulNBits(accuracy_level=0)(model).counts["zero_points_packed"] == 1
    np.testing.assert_array_equal(matmul_nbits_weight(nbits), w_hat)
    x = rng.normal(size=(2, 256)).astype(np.float32)
    y = ort.InferenceSession(to_bytes(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ w_hat, rtol=1e-4, atol=1e-4)
    assert np.linalg.norm(w_hat - w) / np.linalg.norm(w) < 0.15


def test_dequantize_linear_reader_matches_onnx_runtime():
    rng = np.random.default_rng(2)
    q = rng.integers(0, 255, (6, 4)).astype(np.uint8)
    scale, zp = rng.random(4).astype(np.float32), rng.integers(0, 255, 4).astype(np.uint8)
    model = make_model([node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1)], {}, ["y"],
                       {"q": q, "s": scale, "z": zp})
    (expected,) = run_ort(model, {})
    np.testing.assert_allclose(dequantize_linear(next(iter(model.graph))), expected, rtol=1e-6)


def test_trap_nncf_bias_is_not_added_twice():
    """NNCF 3.4 puts the bias of MatMul -> Add(bias) into MatMulNBits and keeps the Add; the pass drops the copy."""
    rng = np.random.default_rng(3)
    w, b = rng.normal(size=(128, 32)).astype(np.float32), rng.normal(size=32).astype(np.float32) * 10
    base = make_model([node("MatMul", ["x", "w"], ["h"], name="mm"), node("Add", ["h", "b"], ["y"], name="add")],
                      {"x": [2, 128]}, ["y"], {"w": w, "b": b})
    model = ir.serde.deserialize_model(nncf_int4(ir.serde.serialize_model(base), "INT4_SYM", 32))
    nbits = next(n for n in model.graph if n.op_type == "MatMulNBits")
    assert len(nbits.inputs) == 6 and op_counts(model)["Add"] == 1  # bias in both places
    w_hat = matmul_nbits_weight(nbits)
    assert ToMatMulNBits(accuracy_level=0)(model).counts["double_bias_dropped"] == 1
    x = rng.normal(size=(2, 128)).astype(np.float32)
    (y,) = run_ort(model, {"x": x})
    np.testing.assert_allclose(y, x @ w_hat + b, rtol=1e-4, atol=1e-3)


def tied_model(k: int, vocab: int = 50):
    """An embedding table read by a Gather and, transposed, by the lm_head Gemm (tied embeddings)."""
    table = np.random.default_rng(k).normal(size=(vocab, k)).astype(np.float32)
    return make_model([node("Gather", ["table", "ids"], ["e"], axis=0),
                       node("Gemm", ["x", "table"], ["logits"], transB=1)],
                      {"x": [3, k], "ids": ([2, 5], np.int64)}, ["e", "logits"], {"table": table})


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("k, block", [(64, 64), (96, 32), (40, 64)])  # one block, 3 blocks, padded and sliced
def test_tied_table_stays_one_8_bit_tensor_for_gather_and_lm_head(sym, k, block):
    model = tied_model(k)
    assert Int8PerHead(sym=sym)(model).counts == {"per_row": 1}
    assert op_counts(model)["DequantizeLinear"] == 1  # the lm_head reads the same quantized table
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(3, k)).astype(np.float32), "ids": rng.integers(0, 50, (2, 5))}
    expected = run_ort(model, feeds)
    pass_ = ToMatMulNBits(accuracy_level=0)
    assert pass_(model).counts == {"tied_table": 1}
    assert op_counts(model)["MatMulNBits"] == 1 and "DequantizeLinear" not in op_counts(model)
    tables = [v for v in model.graph.initializers.values() if v.const_value.size >= 50 * k]
    assert len(tables) == 1 and tables[0].dtype == ir.DataType.UINT8
    assert tables[0].const_value.size == 50 * max(k, block)  # padded only where k has no power-of-two divisor >= 16
    assert {n.op_type for n, _ in tables[0].uses()} == {"Gather", "MatMulNBits"}
    nbits = next(n for n in model.graph if n.op_type == "MatMulNBits")
    assert nbits.attributes["block_size"].as_int() == block
    for got, want in zip(run_ort(model, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert ToMatMulNBits(accuracy_level=0)(model).counts == {}


def test_table_read_by_a_gemm_without_trans_b_is_not_rewritten():
    """Gemm(x, w) reads a [K, N] weight, not the table's rows: the DequantizeLinear is left for both readers."""
    model = make_model([node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=0),
                        node("Gather", ["w", "ids"], ["e"], axis=0), node("Gemm", ["x", "w"], ["y"])],
                       {"x": [3, 50], "ids": ([2, 5], np.int64)}, ["e", "y"],
                       {"q": np.random.default_rng(1).integers(0, 255, (50, 8)).astype(np.uint8),
                        "s": np.full(50, 0.01, np.float32), "z": np.full(50, 128, np.uint8)})
    before = to_bytes(model)
    assert ToMatMulNBits(accuracy_level=0)(model).counts == {}
    assert to_bytes(model) == before
