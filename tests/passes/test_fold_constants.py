"""fold-constants: wraps onnxscript's constant folder; counts the nodes folded away."""

from __future__ import annotations

import numpy as np
from passes_helpers import check_pass, make_model, node, op_counts, rand


def test_constant_subgraph_is_folded():
    nodes = [
        node("Constant", [], ["two"], value_float=2.0),
        node("Mul", ["w", "two"], ["w2"]),
        node("Transpose", ["w2"], ["w2t"], perm=[1, 0]),
        node("MatMul", ["x", "w2t"], ["y"]),
    ]
    model = make_model(nodes, {"x": [3, 4]}, ["y"], {"w": rand(5, 4)})
    stats = check_pass(model, "fold-constants")
    assert stats.counts == {"nodes_replaced": 2} and stats.modified
    assert op_counts(model) == {"MatMul": 1, "Constant": 1}  # the unused Constant is left for remove-unused
    (folded,) = model.graph.initializers.values()
    np.testing.assert_allclose(folded.const_value.numpy(), (rand(5, 4) * 2).T)


def test_shape_computation_on_static_input_is_folded():
    nodes = [node("Shape", ["x"], ["s"]), node("Reshape", ["x", "s"], ["y"])]
    model = make_model(nodes, {"x": [3, 4]}, ["y"])
    assert check_pass(model, "fold-constants").counts == {"nodes_replaced": 2}
    assert "Shape" not in op_counts(model) and "Reshape" not in op_counts(model)  # Reshape to own shape: Identity


def test_nothing_to_fold():
    model = make_model([node("Add", ["x", "c"], ["y"])], {"x": [3, 4]}, ["y"], {"c": rand(4)})
    stats = check_pass(model, "fold-constants")
    assert (stats.modified, stats.counts) == (False, {})
    assert op_counts(model) == {"Add": 1}


def test_inputs_are_forwarded_past_identity():
    nodes = [node("Identity", ["x"], ["i"]), node("Relu", ["i"], ["y"])]
    model = make_model(nodes, {"x": [3, 4]}, ["y"])
    assert check_pass(model, "fold-constants").counts == {"inputs_rewired": 1}
    (relu,) = [n for n in model.graph if n.op_type == "Relu"]
    assert relu.inputs[0] is model.graph.inputs[0]
