"""fuse-mla-attention: attention whose K and V head sizes differ (DeepSeek MLA) -> ONNX Attention (opset 23); the
ONNX Runtime limits that rule out its contrib attention ops for it; and the latent MLA cache, which it leaves alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from attention_helpers import attention_feeds, attention_model
from conftest import tiny_configs
from onnx import TensorProto, helper
from passes_helpers import check_pass, make_model, node, op_counts

from passes import run_pipeline
from passes.fusions.group_query_attention import FuseGroupQueryAttention
from passes.fusions.mla_attention import FuseMlaAttention
from toolchain.stages.alone import export


def near_misses(model) -> str:
    return " | ".join(str(m) for m in FuseMlaAttention().near_misses(model))


@pytest.mark.parametrize("seq, past", [(3, 4), (5, 0), (1, 6)], ids=["chunk-with-past", "prefill", "decode"])
def test_mla_attention_becomes_onnx_attention(seq, past):
    model = attention_model(heads=3, kv_heads=3, k_dim=12, v_dim=8)
    feeds = attention_feeds(model, seq=seq, past=past, padding=min(2, past))
    stats = check_pass(model, "fuse-mla-attention", feeds=feeds)
    assert stats.counts == {"mla": 1}
    counts = op_counts(model)
    assert counts["Attention"] == 1 and "Softmax" not in counts and "Concat" not in counts
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert attention.domain == "" and model.opset_imports[""] == 23
    assert [v.name for v in attention.inputs] == ["q4", "k4", "v4", "mask", "past_key", "past_value"]
    assert [v.name for v in model.graph.outputs] == ["out", "present_key", "present_value"]
    assert model.graph.outputs[1].producer() is attention and model.graph.outputs[2].producer() is attention


def test_gqa_shaped_attention_is_taken_too_without_repeat_kv():
    """ONNX Attention takes fewer kv heads natively in 4-D: what fuse-group-query-attention did not fuse."""
    model = attention_model(heads=4, kv_heads=2)
    assert check_pass(model, "fuse-mla-attention", feeds=attention_feeds(model)).counts == {"gqa": 1}
    assert "Expand" not in op_counts(model)


def test_no_fusion_when_raising_the_opset_would_change_an_op():
    extra = node("GroupNormalization", ["gn_x", "gn_scale", "gn_bias"], ["gn_y"], num_groups=1)
    model = attention_model(heads=3, kv_heads=3, k_dim=12, v_dim=8, extra_ops=[
        node("Constant", [], ["gn_x"], value=helper.make_tensor("v", TensorProto.FLOAT, [1, 2, 2], [1, 2, 3, 4])),
        node("Constant", [], ["gn_scale"], value=helper.make_tensor("s", TensorProto.FLOAT, [1], [1])),
        node("Constant", [], ["gn_bias"], value=helper.make_tensor("b", TensorProto.FLOAT, [1], [0])), extra])
    assert FuseMlaAttention()(model).counts == {}
    assert "raising the opset to 23 would change the meaning of GroupNormalization" in near_misses(model)
    assert model.opset_imports[""] == 18


def mla_model(heads=2, nope=8, rope=8, v_dim=16, shared_rope=True):
    """MLA attention as dstc exports it: K = Concat(k_nope, Expand(k_rope of one head, to every head)); with
    ``shared_rope=False`` the RoPE part comes per head instead (plain multi-head attention)."""
    k_dim = nope + rope
    nodes = [node("Reshape", ["q3", "split_q"], ["q_bsnd"]), node("Transpose", ["q_bsnd"], ["q4"], perm=[0, 2, 1, 3]),
             node("Reshape", ["kv3", "split_kv"], ["kv_bsnd"]),
             node("Transpose", ["kv_bsnd"], ["kv4"], perm=[0, 2, 1, 3]),
             node("Split", ["kv4", "nope_v"], ["k_nope", "v4"], axis=-1)]
    rope_part = "k_rope"
    if shared_rope:
        nodes.append(node("Expand", ["k_rope", "every_head"], ["k_rope_heads"]))
        rope_part = "k_rope_heads"
    nodes += [node("Concat", ["k_nope", rope_part], ["k4"], axis=-1),
              node("Concat", ["past_key", "k4"], ["present_key"], axis=2),
              node("Concat", ["past_value", "v4"], ["present_value"], axis=2),
              node("Transpose", ["present_key"], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q4", "kt"], ["qk"]),
              node("Mul", ["qk", "scale"], ["scores"]), node("Add", ["scores", "mask"], ["masked"]),
              node("Softmax", ["masked"], ["probs"], axis=-1), node("MatMul", ["probs", "present_value"], ["o4"]),
              node("Transpose", ["o4"], ["o_bsnd"], perm=[0, 2, 1, 3]), node("Reshape", ["o_bsnd", "merge"], ["out"])]
    inits = {"split_q": np.array([0, 0, heads, k_dim]), "split_kv": np.array([0, 0, heads, nope + v_dim]),
             "nope_v": np.array([nope, v_dim]), "every_head": np.array([1, heads, 1, 1]),
             "scale": np.float32(k_dim ** -0.5), "merge": np.array([0, 0, -1])}
    if not shared_rope:
        del inits["every_head"]
    inputs = {"q3": ["B", "S", heads * k_dim], "kv3": ["B", "S", heads * (nope + v_dim)],
              "k_rope": ["B", 1 if shared_rope else heads, "S", rope],
              "past_key": ["B", heads, "P", k_dim], "past_value": ["B", heads, "P", v_dim], "mask": ["B", 1, "S", "T"]}
    return make_model(nodes, inputs, ["out", "present_key", "present_value"], inits)


@pytest.mark.parametrize("seq, past", [(3, 4), (1, 6)], ids=["chunk-with-past", "decode"])
def test_mla_with_equal_head_sizes_goes_to_onnx_attention_not_gqa(seq, past):
    """qk_nope + qk_rope == v_head_dim (16, a size GQA takes): GQA declines it, for ONNX Attention's speed."""
    model = mla_model()
    feeds = attention_feeds(model, seq=seq, past=past, padding=2)
    assert check_pass(model.clone(), "fuse-group-query-attention", feeds=feeds).counts == {}
    gqa_misses = " | ".join(str(m) for m in FuseGroupQueryAttention().near_misses(model))
    assert "K has a part shared by every head, MLA's RoPE key" in gqa_misses
    stats = check_pass(model, "fuse-mla-attention", feeds=feeds)
    assert stats.counts == {"mla": 1}
    assert op_counts(model)["Attention"] == 1 and "Softmax" not in op_counts(model)


def test_per_head_rope_part_is_not_mla():
    """Without the shared (Expanded) RoPE key the same Concat is plain multi-head attention, which GQA takes."""
    model = mla_model(shared_rope=False)
    stats = run_pipeline(model, ["fuse-group-query-attention", "fuse-mla-attention"])
    assert [s.counts for s in stats] == [{"mha": 1}, {}]


def _run_contrib(op_type, inputs, feeds, **attrs):
    values = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(feeds[name].dtype),
                                            list(feeds[name].shape)) for name in inputs if name]
    op = helper.make_node(op_type, inputs, ["out", "pk", "pv"], domain="com.microsoft", **attrs)
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "pk", "pv")]
    graph = helper.make_graph([op], "g", values, outputs)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v for k, v in feeds.items() if k in inputs})


def test_ort_multi_head_attention_rejects_a_past_value_of_another_head_size():
    """Why MLA does not go to com.microsoft.MultiHeadAttention with past/present (ORT 1.32)."""
    rng = np.random.default_rng(0)
    shapes = {"q": (1, 2, 3 * 12), "k": (1, 2, 3 * 12), "v": (1, 2, 3 * 8),
              "past_k": (1, 3, 4, 12), "past_v": (1, 3, 4, 8)}
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    with pytest.raises(Exception, match="past_value' dimension 3 should be same as head_size"):
        _run_contrib("MultiHeadAttention", ["q", "k", "v", "", "", "", "past_k", "past_v"], feeds, num_heads=3)


def test_ort_group_query_attention_rejects_a_value_of_another_head_size():
    """Why MLA does not go to com.microsoft.GroupQueryAttention (ORT 1.32)."""
    rng = np.random.default_rng(0)
    shapes = {"q": (1, 2, 2 * 16), "k": (1, 2, 2 * 16), "v": (1, 2, 2 * 8),
              "past_k": (1, 2, 3, 16), "past_v": (1, 2, 3, 8)}
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    feeds.update(seqlens_k=np.array([4], np.int32), total=np.array(5, np.int32))
    with pytest.raises(Exception, match="'value' is expected to have same hidden size as key"):
        _run_contrib("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"], feeds,
                     num_heads=2, kv_num_heads=2)


def test_the_latent_mla_cache_is_left_as_it_is(tiny_checkpoints, tmp_path):
    """DeepSeek's latent cache scores q_lat latent^T + q_rot k_rot^T, two products over two cached tensors that are
    not softmax(q K^T) V: the pass reports no change, leaves the graph byte for byte as it was (check_pass) and the
    opset at 18, and does not fail."""
    config = tiny_configs()["deepseek_v3"]
    export(str(tiny_checkpoints["deepseek_v3"]), tmp_path / "exp", parity=(), mla_cache="latent")
    model = ir.load(tmp_path / "exp" / "model.onnx")
    assert model.metadata_props["dstc.kv_cache"] == "latent"
    run_pipeline(model, ["infer-shapes"])  # the pattern's check reads head sizes from inferred shapes
    rng = np.random.default_rng(0)
    seq, past = 3, 4
    feeds = {"input_ids": rng.integers(0, config.vocab_size, (1, seq)),
             "attention_mask": np.ones((1, past + seq), np.int64),
             "position_ids": np.arange(past, past + seq)[None]}
    for i in range(config.num_hidden_layers):
        feeds[f"past_key_values.{i}.key"] = rng.normal(size=(1, 1, past, config.qk_rope_head_dim)).astype(np.float32)
        feeds[f"past_key_values.{i}.value"] = rng.normal(size=(1, 1, past, config.kv_lora_rank)).astype(np.float32)
    stats = check_pass(model, "fuse-mla-attention", feeds=feeds)
    assert (stats.modified, stats.counts) == (False, {})
    assert model.opset_imports[""] == 18 and "Attention" not in op_counts(model)
