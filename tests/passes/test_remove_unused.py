"""remove-unused: wraps onnx_ir's dead-code elimination; counts nodes and initializers removed."""

from __future__ import annotations

from passes_helpers import check_pass, make_model, node, op_counts, rand


def test_dead_nodes_and_initializers_are_removed():
    nodes = [node("Add", ["x", "c"], ["y"]), node("Mul", ["x", "d"], ["dead"]), node("Relu", ["dead"], ["dead2"])]
    model = make_model(nodes, {"x": [3, 4]}, ["y"], {"c": rand(4), "d": rand(4, seed=1), "unused": rand(2, seed=2)})
    stats = check_pass(model, "remove-unused")
    assert stats.counts == {"nodes_removed": 2, "initializers_removed": 2}
    assert op_counts(model) == {"Add": 1}
    assert list(model.graph.initializers) == ["c"]


def test_live_graph_is_untouched():
    nodes = [node("Add", ["x", "c"], ["y"]), node("Relu", ["y"], ["z"])]
    model = make_model(nodes, {"x": [3, 4]}, ["y", "z"], {"c": rand(4)})
    stats = check_pass(model, "remove-unused")
    assert (stats.modified, stats.counts) == (False, {})
    assert op_counts(model) == {"Add": 1, "Relu": 1}
