"""prefill-int8 (passes/quantize/prefill_int8.py): the span of 4-bit MatMulNBits under one If(tokens >= 8), its
copy for prompts on int8 per-column DynamicQuantizeMatMul; decode rows run the span as before, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from passes_helpers import make_model, node, op_counts, run_ort, to_bytes

from passes import create_pass, get_pass, validate_model
from passes.quantize._weights import matmul_nbits_weight
from passes.quantize.matmul_nbits import pack_nibbles
from passes.quantize.prefill_int8 import INT8_COPY_MAX, PrefillInt8, int8_per_column

K, N, BLOCK = 96, 40, 32  # 3 blocks: an odd count, so the packed zero points have a padded nibble


def nbits_model(bits: int = 4, bias: bool = False, zero_points: bool = True, seed: int = 0) -> ir.Model:
    """x [B, S, K] -> MatMulNBits(bits, K x N, block 32, accuracy_level 4) -> Relu -> y (Relu: the output is not
    the MatMulNBits' own, as in a decoder)."""
    rng = np.random.default_rng(seed)
    blocks = K // BLOCK
    q = rng.integers(0, 2 ** bits, (N, blocks, BLOCK), dtype=np.uint8)
    b = pack_nibbles(q) if bits == 4 else q
    inits = {"B": b, "scales": (rng.random((N, blocks), dtype=np.float32) * 0.05 + 0.01)}
    inputs = ["x", "B", "scales"]
    if zero_points:
        zp = rng.integers(0, 2 ** bits, (N, blocks), dtype=np.uint8)
        inits["zp"] = pack_nibbles(zp) if bits == 4 else zp
        inputs.append("zp")
    if bias:
        inputs += [""] * (5 - len(inputs)) + ["bias"]
        inits["bias"] = rng.standard_normal(N).astype(np.float32)
    nodes = [node("MatMulNBits", inputs, ["mm"], domain="com.microsoft", name="proj", K=K, N=N, bits=bits,
                  block_size=BLOCK, accuracy_level=4),
             node("Relu", ["mm"], ["y"])]
    # ONNX's shape inference does not know contrib ops: the output's type is set by hand
    model = make_model(nodes, {"x": ["batch", "seq", K]}, ["y"], inits, infer_shapes=False)
    model.opset_imports["com.microsoft"] = 1
    y = model.graph.outputs[0]
    y.dtype, y.shape = ir.DataType.FLOAT, ir.Shape(["batch", "seq", N])
    return model


def x_of(rows: int, batch: int = 1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, rows, K)).astype(np.float32)


def test_registered_for_onnxruntime():
    assert get_pass("prefill-int8").targets == ("onnxruntime",)
    assert isinstance(create_pass("prefill-int8"), PrefillInt8)


@pytest.mark.parametrize("bias,zero_points", [(False, True), (True, True), (False, False)])
def test_wraps_each_4bit_matmul_and_keeps_decode_exact(bias, zero_points):
    model = nbits_model(bias=bias, zero_points=zero_points)
    weight = matmul_nbits_weight(next(n for n in model.graph if n.op_type == "MatMulNBits"))
    before = to_bytes(model)
    result = PrefillInt8()(model)
    assert result.modified and result.counts == {"prefill_int8": 1}
    validate_model(model)
    assert op_counts(model)["If"] == 1 and op_counts(model)["MatMulNBits"] == 0
    branch_ops = {attr.name: [n.op_type for n in attr.as_graph()] for n in model.graph if n.op_type == "If"
                  for attr in n.attributes.values()}
    assert branch_ops == {"then_branch": ["DynamicQuantizeMatMul"], "else_branch": ["MatMulNBits"]}
    after = to_bytes(model)
    # decode: 1 to 7 tokens a row take the MatMulNBits branch, however many rows (a server's batch of steps):
    # identical outputs
    for batch, rows in ((1, 1), (4, 1), (16, 1), (2, 7)):
        x = x_of(rows, batch)
        np.testing.assert_array_equal(run_ort(after, {"x": x})[0], run_ort(before, {"x": x})[0])
    # a prompt: int8 weights per column and uint8 activations per tensor, close to the 4-bit product
    x = x_of(16, 2)
    exact = np.maximum(x @ weight + (model.graph.initializers["bias"].const_value.numpy() if bias else 0), 0)
    prompt, nbits = run_ort(after, {"x": x})[0], run_ort(before, {"x": x})[0]
    assert not np.array_equal(prompt, nbits)  # the other branch ran
    scale = np.abs(exact).max()
    assert np.abs(prompt - exact).max() < 0.03 * scale and np.abs(nbits - exact).max() < 0.03 * scale


def test_a_second_run_changes_nothing():
    model = nbits_model()
    PrefillInt8()(model)
    once = to_bytes(model)
    again = PrefillInt8()(model)
    assert (again.modified, again.counts) == (False, {}) and to_bytes(model) == once


def chain_model(seed: int = 0) -> ir.Model:
    """x [B, S, K] -> a (K x K) -> Relu r -> b (K x K) -> Add x -> Neg h -> l (K x K) -> logits; r is an
    output too (as a present KV cache is): the span is a..b, the lm_head l stays out of it."""
    rng = np.random.default_rng(seed)
    blocks = K // BLOCK
    nodes, inits = [], {}
    for name, src, dst in (("a", "x", "ya"), ("b", "r", "yb"), ("l", "h", "logits")):
        inits[f"B_{name}"] = pack_nibbles(rng.integers(0, 16, (K, blocks, BLOCK), dtype=np.uint8))
        inits[f"s_{name}"] = rng.random((K, blocks), dtype=np.float32) * 0.05 + 0.01
        nodes.append(node("MatMulNBits", [src, f"B_{name}", f"s_{name}"], [dst], domain="com.microsoft", name=name,
                          K=K, N=K, bits=4, block_size=BLOCK, accuracy_level=4))
    nodes[1:1] = [node("Relu", ["ya"], ["r"])]
    nodes[3:3] = [node("Add", ["yb", "x"], ["res"]), node("Neg", ["res"], ["h"])]
    model = make_model(nodes, {"x": ["batch", "seq", K]}, ["logits", "r"], inits, infer_shapes=False)
    model.opset_imports["com.microsoft"] = 1
    for out in model.graph.outputs:
        out.dtype, out.shape = ir.DataType.FLOAT, ir.Shape(["batch", "seq", K])
    return model


def test_the_span_goes_under_one_if_and_the_lm_head_stays_out():
    model = chain_model()
    before = to_bytes(model)
    weights = {n.name: matmul_nbits_weight(n) for n in model.graph if n.op_type == "MatMulNBits"}
    pass_ = PrefillInt8()
    result = pass_(model)
    assert result.counts == {"prefill_int8": 2}
    validate_model(model)
    assert [n.op_type for n in model.graph] == ["Shape", "ReduceProd", "Greater", "If", "Add", "Neg", "MatMulNBits"]
    choose = next(n for n in model.graph if n.op_type == "If")
    branches = {name: attr.as_graph() for name, attr in choose.attributes.items()}
    assert [n.op_type for n in branches["then_branch"]] == ["DynamicQuantizeMatMul", "Relu", "DynamicQuantizeMatMul"]
    assert [n.op_type for n in branches["else_branch"]] == ["MatMulNBits", "Relu", "MatMulNBits"]
    # every weight stored once, in the main graph: the 4-bit ones, the int8 copies of a and b (not of l)
    assert all(not g.initializers for g in branches.values())
    assert sorted(n for n in model.graph.initializers if n.endswith("_prefill_int8")) == ["B_a_prefill_int8",
                                                                                          "B_b_prefill_int8"]
    assert [m.reason for m in pass_.near_misses(model)] == [
        "it computes a graph output (the lm_head reads one row a step)"]
    assert [v.name for v in model.graph.outputs] == ["logits", "r"]
    after = to_bytes(model)
    for batch, rows in ((1, 1), (16, 1), (2, 7)):  # decode: the span as it was, bit for bit
        x = x_of(rows, batch)
        for got, want in zip(run_ort(after, {"x": x}), run_ort(before, {"x": x})):
            np.testing.assert_array_equal(got, want)
    x = x_of(16, 2)  # a prompt: close to the 4-bit weights' exact product
    r = np.maximum(x @ weights["a"], 0)
    exact = [-(r @ weights["b"] + x) @ weights["l"], r]  # logits, r
    prompt, nbits = run_ort(after, {"x": x}), run_ort(before, {"x": x})
    for want, got, old in zip(exact, prompt, nbits):
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 0.03 * scale and np.abs(old - want).max() < 0.03 * scale
        assert not np.array_equal(got, old)  # the prompt branch ran


def test_a_node_with_subgraphs_in_the_span_is_left_alone():
    model = chain_model()
    relu = next(n for n in model.graph if n.op_type == "Relu")
    branch = ir.Graph([], [], nodes=[], name="empty")
    relu.attributes["body"] = ir.AttrGraph("body", branch)
    before = to_bytes(model)
    pass_ = PrefillInt8()
    result = pass_(model)
    assert (result.modified, result.counts) == (False, {}) and to_bytes(model) == before
    assert "a node with subgraphs between the 4-bit MatMulNBits" in [m.reason for m in pass_.near_misses(model)]


@pytest.mark.parametrize("case", ["8-bit", "g_idx"])
def test_other_matmul_nbits_are_left_alone(case):
    model = nbits_model(bits=8) if case == "8-bit" else nbits_model()
    if case == "g_idx":
        proj = next(n for n in model.graph if n.op_type == "MatMulNBits")
        g_idx = ir.Value(name="g_idx", const_value=ir.tensor(np.arange(K, dtype=np.int32) // BLOCK, name="g_idx"))
        model.graph.register_initializer(g_idx)
        proj.resize_inputs(5)
        proj.replace_input_with(4, g_idx)
    before = to_bytes(model)
    pass_ = PrefillInt8()
    result = pass_(model)
    assert (result.modified, result.counts) == (False, {}) and to_bytes(model) == before
    assert [m.reason for m in pass_.near_misses(model)] == (["8-bit weights (4-bit only)"] if case == "8-bit"
                                                             else ["g_idx (act-order) weights"])


def test_int8_per_column_rule():
    w = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32)
    w[:, 3] = 0
    q, scale = int8_per_column(w)
    # 7-bit codes: the u8s8 GEMM of a CPU without an int8 dot product saturates pairs of larger ones in int16
    assert q.dtype == np.int8 and np.abs(q).max() == INT8_COPY_MAX == 63 and scale[3] == 1.0 and not q[:, 3].any()
    assert np.abs(q * scale - w).max() <= scale.max() / 2 + 1e-7


def test_a_value_inside_the_span_can_be_asked_for():
    """dstc's runners ask for inner values as extra outputs (a router's choice: toolchain/runtime/engines.py
    with_extra_outputs): inside the If, each branch gives its own, the decode branch the span's as it was."""
    from toolchain.runtime.engines import with_extra_outputs

    model = chain_model()
    before = with_extra_outputs(model, ["ya"])
    PrefillInt8()(model)
    after = with_extra_outputs(model, ["ya"])
    x = x_of(1, 2)
    np.testing.assert_array_equal(run_ort(after, {"x": x})[2], run_ort(before, {"x": x})[2])
    x = x_of(16, 2)
    prompt, nbits = run_ort(after, {"x": x})[2], run_ort(before, {"x": x})[2]
    assert not np.array_equal(prompt, nbits) and np.abs(prompt - nbits).max() < 0.03 * np.abs(nbits).max()
    with pytest.raises(ValueError, match="no value named 'nowhere'"):
        with_extra_outputs(model, ["nowhere"])
