"""infer-shapes: records ONNX shape inference on values, without changing the graph."""

from __future__ import annotations

from passes_helpers import check_pass, make_model, node, op_counts


def test_values_get_shapes():
    nodes = [node("Transpose", ["x"], ["t"], perm=[1, 0]), node("Relu", ["t"], ["y"])]
    model = make_model(nodes, {"x": [3, 4]}, ["y"], infer_shapes=False)
    stats = run_without_ort(model)
    assert stats.counts == {"values_annotated": 2}
    assert [tuple(n.outputs[0].shape) for n in model.graph] == [(4, 3), (4, 3)]
    assert op_counts(model) == {"Transpose": 1, "Relu": 1}


def run_without_ort(model):
    """The un-annotated model has an output of undefined type, which ORT rejects, so no before/after run."""
    from passes import create_pass, run_pass

    return run_pass("infer-shapes", create_pass("infer-shapes"), model)


def test_annotated_model_is_unchanged():
    model = make_model([node("Relu", ["x"], ["y"])], {"x": [3, 4]}, ["y"])
    stats = check_pass(model, "infer-shapes")
    assert (stats.modified, stats.counts) == (False, {})
