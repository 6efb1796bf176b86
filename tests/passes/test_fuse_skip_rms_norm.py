"""fuse-skip-rms-norm: residual Add + SimplifiedLayerNormalization -> SkipSimplifiedLayerNormalization."""

from __future__ import annotations

import numpy as np
from passes_helpers import check_pass, make_model, node, op_counts, rand

import passes.fusions  # noqa: F401  (registers SimplifiedLayerNormalization's schema for make_model)
from passes import run_pipeline
from passes.fusions.skip_rms_norm import FuseSkipRmsNorm


def residual_norm(skip_shape=(2, 3, 8), *, sum_used=True, bias=False):
    """h = a + b (+ bias); y = RMSNorm(h) * w; the residual stream continues as Relu(h)."""
    nodes = [node("Add", ["a", "b"], ["h0"])]
    if bias:
        nodes.append(node("Add", ["h0", "bias"], ["h"]))
    else:
        nodes[0].output[0] = "h"
    nodes.append(node("SimplifiedLayerNormalization", ["h", "w"], ["y"], axis=-1, epsilon=1e-6, stash_type=1))
    outputs = ["y"]
    if sum_used:
        nodes.append(node("Relu", ["h"], ["next"]))
        outputs.append("next")
    inits = {"w": rand(8, seed=1, positive=True)}
    if bias:
        inits["bias"] = rand(8, seed=2)
    return make_model(nodes, {"a": [2, 3, 8], "b": list(skip_shape)}, outputs, inits)


def near_misses(model) -> str:
    return " | ".join(str(m) for m in FuseSkipRmsNorm().near_misses(model))


def test_residual_add_and_norm_fuse_and_the_sum_carries_on():
    model = residual_norm()
    stats = check_pass(model, "fuse-skip-rms-norm")
    assert stats.counts == {"skip_rms_norm": 1} and (stats.nodes_before, stats.nodes_after) == (3, 2)
    assert op_counts(model) == {"SkipSimplifiedLayerNormalization": 1, "Relu": 1}
    skip, relu = model.graph
    assert skip.domain == "com.microsoft" and relu.inputs[0] is skip.outputs[3]
    assert model.opset_imports["com.microsoft"] == 1


def test_bias_after_the_sum_fuses_too():
    model = residual_norm(bias=True)
    assert check_pass(model, "fuse-skip-rms-norm").counts == {"skip_rms_norm_bias": 1}
    assert op_counts(model) == {"SkipSimplifiedLayerNormalization": 1, "Relu": 1}


def test_no_fusion_when_the_add_broadcasts():
    model = residual_norm(skip_shape=(2, 1, 8))
    assert check_pass(model, "fuse-skip-rms-norm").counts == {}
    assert "the Add broadcasts input [2, 1, 8] with skip [2, 3, 8]" in near_misses(model)


def test_after_fuse_rms_norm_on_the_unfused_form():
    """The exporter's form: Add then Pow/ReduceMean/Add/Sqrt/Div/Mul; both passes together leave one node."""
    nodes = [node("Add", ["a", "b"], ["h"]), node("Pow", ["h", "two"], ["sq"]),
             node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1), node("Add", ["mean", "eps"], ["var"]),
             node("Sqrt", ["var"], ["rms"]), node("Div", ["h", "rms"], ["normed"]),
             node("Mul", ["w", "normed"], ["y"]), node("Relu", ["h"], ["next"])]
    inits = {"two": np.float32(2.0), "axes": np.array([-1]), "eps": np.float32(1e-5), "w": rand(8, seed=1)}
    model = make_model(nodes, {"a": [2, "s", 8], "b": [2, "s", 8]}, ["y", "next"], inits)
    stats = run_pipeline(model, ["fuse-rms-norm", "fuse-skip-rms-norm"])
    assert [s.counts for s in stats] == [{"rms_norm": 1}, {"skip_rms_norm": 1}]
    assert op_counts(model) == {"SkipSimplifiedLayerNormalization": 1, "Relu": 1}
