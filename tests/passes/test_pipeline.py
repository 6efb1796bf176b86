"""The pipeline runner: stats, validation naming the culprit pass, expectations with near-miss reasons."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from passes_helpers import make_model, node, op_counts, rand, random_feeds, run_ort, to_bytes

from passes import CountedResult, ExpectationError, PassError, PassValidationError, registry, run_pipeline


@pytest.fixture
def scratch_registry(monkeypatch):
    registry._load()
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def linear_model():
    """Transpose(W) feeding MatMul+Add, a duplicated Relu, and a dead node."""
    nodes = [
        node("Transpose", ["W"], ["wt"], perm=[1, 0]), node("MatMul", ["x", "wt"], ["m"]),
        node("Add", ["m", "b"], ["h"]),
        node("Relu", ["h"], ["r1"]), node("Relu", ["h"], ["r2"]), node("Add", ["r1", "r2"], ["y"]),
        node("Neg", ["x"], ["dead"]),
    ]
    return make_model(nodes, {"x": [3, 6]}, ["y"], {"W": rand(5, 6), "b": rand(5, seed=1)})


def conv_bn_with_shared_conv_output():
    inits = {"W": rand(4, 3, 3, 3), "g": rand(4, seed=1, positive=True), "bt": rand(4, seed=2),
             "mu": rand(4, seed=3), "var": rand(4, seed=4, positive=True)}
    nodes = [node("Conv", ["x", "W"], ["c"]), node("BatchNormalization", ["c", "g", "bt", "mu", "var"], ["y"]),
             node("Relu", ["c"], ["z"])]
    return make_model(nodes, {"x": [1, 3, 5, 5]}, ["y", "z"], inits)


PIPELINE = ["eliminate-transposes", "fuse-matmul-add-gemm", "cse", "remove-unused"]


def test_pipeline_stats():
    model = linear_model()
    feeds = random_feeds(model)
    expected = run_ort(model, feeds)
    stats = run_pipeline(model, PIPELINE, expectations={"fuse-matmul-add-gemm": {"min": 1, "max": 1}})
    assert [s.name for s in stats] == PIPELINE
    assert [s.counts for s in stats] == [
        {"constants_folded": 1}, {"gemm": 1}, {"nodes_merged": 1}, {"nodes_removed": 1}
    ]
    assert all(s.modified and s.seconds >= 0 for s in stats)
    assert stats[0].nodes_before == 7 and stats[-1].nodes_after == 3
    assert all(a.nodes_after == b.nodes_before for a, b in zip(stats, stats[1:]))
    assert op_counts(model) == {"Gemm": 1, "Relu": 1, "Add": 1}
    np.testing.assert_allclose(run_ort(model, feeds)[0], expected[0], atol=1e-5)
    rows = json.loads(json.dumps([s.to_dict() for s in stats]))
    assert rows[1] == {"name": "fuse-matmul-add-gemm", "modified": True, "counts": {"gemm": 1},
                       "nodes_before": 6, "nodes_after": 5, "seconds": stats[1].seconds}


def test_unknown_pass_fails_before_anything_runs():
    model = linear_model()
    before = to_bytes(model)
    with pytest.raises(PassError, match="unknown pass 'fold-everything'"):
        run_pipeline(model, ["remove-unused", "fold-everything"])
    assert to_bytes(model) == before


def test_validation_failure_names_the_pass(scratch_registry):
    @registry.register("break-shapes-test", description="Records a wrong shape on every Transpose output.")
    class BreakShapes(ir.passes.InPlacePass):
        def call(self, model):
            for n in model.graph:
                if n.op_type == "Transpose":
                    n.outputs[0].shape = ir.Shape([7, 7])
            return CountedResult(model, True, {"broken": 1})

    model = linear_model()
    with pytest.raises(PassValidationError, match="invalid after pass 'break-shapes-test'") as info:
        run_pipeline(model, ["cse", "break-shapes-test", "remove-unused"])
    assert info.value.pass_name == "break-shapes-test"
    assert "ShapeInferenceError" in str(info.value)


def test_invalid_input_is_not_blamed_on_a_pass():
    model = linear_model()
    next(n for n in model.graph if n.op_type == "Transpose").outputs[0].shape = ir.Shape([7, 7])
    with pytest.raises(PassValidationError, match="input model is invalid") as info:
        run_pipeline(model, ["cse"])
    assert info.value.pass_name is None


def test_failing_pass_is_named(scratch_registry):
    @registry.register("crash-test", description="Raises.")
    class Crash(ir.passes.InPlacePass):
        def call(self, model):
            raise RuntimeError("boom")

    with pytest.raises(PassError, match="pass 'crash-test' failed: RuntimeError: boom") as info:
        run_pipeline(linear_model(), ["crash-test"])
    assert info.value.pass_name == "crash-test"


def test_expectation_shortfall_reports_rewriter_near_miss():
    model = conv_bn_with_shared_conv_output()
    with pytest.raises(ExpectationError) as info:
        run_pipeline(model, ["fold-batchnorm", "remove-unused"], expectations={"fold-batchnorm": {"min": 1}})
    error = info.value
    assert error.pass_name == "fold-batchnorm" and error.actual == 0
    assert error.near_miss == (
        "conv at BatchNormalization 'y': Matched nodes have other uses preventing replacement. "
        "('c' is also used by Relu 'z')"
    )
    assert "pass 'fold-batchnorm': expected total count >= 1, got 0" in str(error)


def test_expectation_shortfall_reports_hand_written_near_miss():
    nodes = [node("Transpose", ["x"], ["t"], perm=[0, 2, 1]), node("Softmax", ["t"], ["s"], axis=-1),
             node("Transpose", ["s"], ["y"], perm=[0, 2, 1])]
    model = make_model(nodes, {"x": [2, 3, 4]}, ["y"])
    reason = r"stops at Softmax 's', not elementwise \(before Transpose 'y', which undoes it\)"
    with pytest.raises(ExpectationError, match=reason) as info:
        run_pipeline(model, ["eliminate-transposes"], expectations={"eliminate-transposes": {"min": 1}})
    assert info.value.pass_name == "eliminate-transposes"


def test_expectation_on_a_named_count_and_maximum():
    with pytest.raises(ExpectationError, match="expected 'gemm' count >= 1, got 0"):
        run_pipeline(linear_model(), ["fold-batchnorm"], expectations={"fold-batchnorm": {"min": 1, "count": "gemm"}})
    with pytest.raises(ExpectationError, match="expected total count <= 0, got 1") as info:
        run_pipeline(linear_model(), ["cse"], expectations={"cse": {"max": 0}})
    assert info.value.near_miss is None


@pytest.mark.parametrize(
    "expectations, message",
    [({"cse": {"min": 1}}, "not in the pipeline"), ({"remove-unused": {"min": -1}}, "int >= 0"),
     ({"remove-unused": {"least": 1}}, "keys among"), ({"remove-unused": {"count": "x"}}, "neither 'min' nor 'max'")],
)
def test_bad_expectations_are_rejected(expectations, message):
    with pytest.raises(PassError, match=message):
        run_pipeline(linear_model(), ["remove-unused"], expectations=expectations)
