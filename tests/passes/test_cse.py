"""cse: wraps onnx_ir's common-subexpression elimination; counts nodes merged."""

from __future__ import annotations

from passes_helpers import check_pass, make_model, node, op_counts


def test_duplicate_nodes_are_merged():
    nodes = [
        node("Transpose", ["x"], ["t1"], perm=[1, 0]), node("Transpose", ["x"], ["t2"], perm=[1, 0]),
        node("Relu", ["t1"], ["r1"]), node("Relu", ["t2"], ["r2"]), node("Add", ["r1", "r2"], ["y"]),
    ]
    model = make_model(nodes, {"x": [3, 4]}, ["y"])
    stats = check_pass(model, "cse")
    assert stats.counts == {"nodes_merged": 2}
    assert op_counts(model) == {"Transpose": 1, "Relu": 1, "Add": 1}


def test_different_attributes_are_not_merged():
    nodes = [node("Transpose", ["x"], ["t1"], perm=[1, 0, 2]), node("Transpose", ["x"], ["t2"], perm=[0, 2, 1]),
             node("Relu", ["t1"], ["y"]), node("Relu", ["t2"], ["z"])]
    model = make_model(nodes, {"x": [3, 3, 3]}, ["y", "z"])
    stats = check_pass(model, "cse")
    assert (stats.modified, stats.counts) == (False, {})
    assert op_counts(model) == {"Transpose": 2, "Relu": 2}
