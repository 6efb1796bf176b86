"""fuse-rms-norm: RMSNorm (Div or Reciprocal form, x^2 as Pow or Mul) -> SimplifiedLayerNormalization."""

from __future__ import annotations

import numpy as np
import pytest
from passes_helpers import check_pass, make_model, node, op_counts, rand

from passes.fusions.rms_norm import FuseRmsNorm

EPS = 1e-6


def rms_norm(*, reciprocal=False, mul_square=False, weight_first=True, axes=(-1,), weight_shape=(8,),
             eps_input=False):
    nodes = [node("Mul", ["x", "x"], ["sq"]) if mul_square else node("Pow", ["x", "two"], ["sq"]),
             node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1), node("Add", ["mean", "eps"], ["var"]),
             node("Sqrt", ["var"], ["rms"])]
    if reciprocal:
        nodes += [node("Reciprocal", ["rms"], ["inv"]), node("Mul", ["x", "inv"], ["normed"])]
    else:
        nodes.append(node("Div", ["x", "rms"], ["normed"]))
    nodes.append(node("Mul", ["w", "normed"] if weight_first else ["normed", "w"], ["y"]))
    inputs = {"x": [2, 3, 8]}
    inits = {"axes": np.array(axes, np.int64), "w": rand(*weight_shape, seed=1)}
    if not mul_square:
        inits["two"] = np.float32(2.0)
    if eps_input:
        inputs["eps"] = []
    else:
        inits["eps"] = np.float32(EPS)
    return make_model(nodes, inputs, ["y"], inits)


def near_misses(model) -> str:
    return " | ".join(str(m) for m in FuseRmsNorm().near_misses(model))


@pytest.mark.parametrize("reciprocal, mul_square, weight_first", [
    (False, False, True), (False, False, False), (True, False, True), (False, True, True), (True, True, False)])
def test_rms_norm_becomes_simplified_layer_norm(reciprocal, mul_square, weight_first):
    model = rms_norm(reciprocal=reciprocal, mul_square=mul_square, weight_first=weight_first)
    nodes_before = len(model.graph)
    stats = check_pass(model, "fuse-rms-norm")
    expected = "rms_norm" + ("_reciprocal" if reciprocal else "") + ("_mul_square" if mul_square else "")
    assert stats.counts == {expected: 1} and (stats.nodes_before, stats.nodes_after) == (nodes_before, 1)
    assert op_counts(model) == {"SimplifiedLayerNormalization": 1}
    (fused,) = model.graph
    assert fused.domain == "" and fused.attributes.get_int("axis") == -1
    assert fused.attributes.get_int("stash_type") == 1
    assert fused.attributes.get_float("epsilon") == pytest.approx(EPS)
    assert set(model.graph.initializers) == {"w"}


def test_last_axis_may_be_positive():
    model = rms_norm(axes=(2,))
    assert check_pass(model, "fuse-rms-norm").counts == {"rms_norm": 1}


def test_no_fusion_over_another_axis():
    model = rms_norm(axes=(1,))
    assert check_pass(model, "fuse-rms-norm").counts == {}
    assert "ReduceMean axes [1] are not the last axis alone" in near_misses(model)


def test_no_fusion_for_a_scale_that_is_not_1d():
    model = rms_norm(weight_shape=(3, 8))
    assert check_pass(model, "fuse-rms-norm").counts == {}
    assert "the fused op needs a 1-D scale" in near_misses(model)


def test_no_fusion_for_a_non_constant_epsilon():
    model = rms_norm(eps_input=True)
    feeds = {"x": rand(2, 3, 8), "eps": np.array(EPS, np.float32)}
    assert check_pass(model, "fuse-rms-norm", feeds=feeds).counts == {}
    assert "epsilon is not a constant float scalar" in near_misses(model)
