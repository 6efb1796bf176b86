"""fuse-matmul-add-gemm: 2-D MatMul with a constant weight plus a bias broadcastable to [N] becomes Gemm."""

from __future__ import annotations

import numpy as np
import pytest
from passes_helpers import check_pass, make_model, node, op_counts, rand

from passes.generic.fuse_matmul_add_gemm import FuseMatMulAddGemm


def matmul_add(x_shape=(3, 6), bias=(5,), *, bias_first=False, weight_input=False, extra_consumer=False):
    add_inputs = ["b", "m"] if bias_first else ["m", "b"]
    nodes = [node("MatMul", ["x", "W"], ["m"]), node("Add", add_inputs, ["y"])]
    outputs = ["y"]
    if extra_consumer:
        nodes.append(node("Relu", ["m"], ["z"]))
        outputs.append("z")
    inputs = {"x": list(x_shape)}
    inits = {"b": rand(*bias, seed=1)}
    if weight_input:
        inputs["W"] = [6, 5]
    else:
        inits["W"] = rand(6, 5)
    return make_model(nodes, inputs, outputs, inits)


def near_misses(model) -> str:
    return " | ".join(str(m) for m in FuseMatMulAddGemm().near_misses(model))


@pytest.mark.parametrize("bias", [(5,), (1, 5), (1,), ()])
@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_add_becomes_gemm(bias, bias_first):
    model = matmul_add(bias=bias, bias_first=bias_first)
    stats = check_pass(model, "fuse-matmul-add-gemm")
    assert stats.counts == {"gemm": 1} and (stats.nodes_before, stats.nodes_after) == (2, 1)
    assert op_counts(model) == {"Gemm": 1}


def test_transposed_weight_becomes_trans_b():
    model = make_model(
        [node("Transpose", ["W"], ["wt"], perm=[1, 0]), node("MatMul", ["x", "wt"], ["m"]),
         node("Add", ["m", "b"], ["y"])],
        {"x": [3, 6]}, ["y"], {"W": rand(5, 6), "b": rand(5, seed=1)},
    )
    assert check_pass(model, "fuse-matmul-add-gemm").counts == {"gemm_trans_b": 1}
    (gemm,) = model.graph
    assert gemm.op_type == "Gemm" and gemm.attributes.get_int("transB") == 1


def test_no_gemm_for_3d_input():
    model = matmul_add(x_shape=(2, 3, 6))
    assert check_pass(model, "fuse-matmul-add-gemm").counts == {}
    assert op_counts(model) == {"MatMul": 1, "Add": 1}
    assert "input A has rank 3, Gemm needs 2" in near_misses(model)


def test_no_gemm_for_bias_not_broadcastable_to_n():
    model = matmul_add(bias=(3, 5))
    assert check_pass(model, "fuse-matmul-add-gemm").counts == {}
    assert "does not broadcast to [5]" in near_misses(model)


def test_no_gemm_for_non_constant_weight():
    model = matmul_add(weight_input=True)
    assert check_pass(model, "fuse-matmul-add-gemm").counts == {}
    assert "not a constant 2-D tensor" in near_misses(model)


def test_no_gemm_when_matmul_output_has_another_consumer():
    model = matmul_add(extra_consumer=True)
    assert check_pass(model, "fuse-matmul-add-gemm").counts == {}
    assert "'m' is also used by Relu 'z'" in near_misses(model)


def test_gemm_runs_once_per_pair_in_a_chain():
    """Two stacked linear layers: both fuse in one run; the second run finds nothing."""
    nodes = [node("MatMul", ["x", "W1"], ["m1"]), node("Add", ["m1", "b1"], ["h"]), node("Relu", ["h"], ["r"]),
             node("MatMul", ["r", "W2"], ["m2"]), node("Add", ["m2", "b2"], ["y"])]
    inits = {"W1": rand(6, 5), "b1": rand(5, seed=1), "W2": rand(5, 4, seed=2), "b2": rand(4, seed=3)}
    model = make_model(nodes, {"x": [3, 6]}, ["y"], inits)
    assert check_pass(model, "fuse-matmul-add-gemm").counts == {"gemm": 2}
    assert op_counts(model) == {"Gemm": 2, "Relu": 1}
    assert np.all([v.const_value is not None for v in model.graph.initializers.values()])
