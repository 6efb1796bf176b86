"""eliminate-transposes: cancel, merge, identity, constants, Gemm flags, push-through elementwise chains."""

from __future__ import annotations

import numpy as np
from passes_helpers import check_pass, make_model, node, op_counts, rand

from passes.generic.eliminate_transposes import EliminateTransposes


def transpose(x: str, y: str, perm: list[int]):
    return node("Transpose", [x], [y], perm=perm)


def near_misses(model) -> str:
    pass_ = EliminateTransposes()
    pass_(model)
    return " | ".join(str(m) for m in pass_.near_misses(model))


def test_inverse_pair_cancels():
    model = make_model([transpose("x", "t1", [0, 2, 1]), transpose("t1", "t2", [0, 2, 1]), node("Relu", ["t2"], ["y"])],
                       {"x": [2, 3, 4]}, ["y"])
    stats = check_pass(model, "eliminate-transposes")
    assert stats.counts == {"pairs_cancelled": 1}
    assert op_counts(model) == {"Relu": 1}


def test_inverse_pair_between_graph_input_and_output_keeps_an_identity():
    model = make_model([transpose("x", "t1", [1, 2, 0]), transpose("t1", "y", [2, 0, 1])], {"x": [2, 3, 4]}, ["y"])
    assert check_pass(model, "eliminate-transposes").counts == {"pairs_cancelled": 1}
    assert op_counts(model) == {"Identity": 1}
    assert model.graph.outputs[0].name == "y"


def test_consecutive_transposes_merge_into_one():
    model = make_model([transpose("x", "t1", [1, 0, 2]), transpose("t1", "t2", [0, 2, 1]), node("Relu", ["t2"], ["y"])],
                       {"x": [2, 3, 4]}, ["y"])
    assert check_pass(model, "eliminate-transposes").counts == {"pairs_merged": 1}
    assert op_counts(model) == {"Transpose": 1, "Relu": 1}
    (merged,) = [n for n in model.graph if n.op_type == "Transpose"]
    assert list(merged.attributes["perm"].as_ints()) == [1, 2, 0]


def test_identity_permutation_is_dropped():
    model = make_model([transpose("x", "t", [0, 1, 2]), node("Relu", ["t"], ["y"])], {"x": [2, 3, 4]}, ["y"])
    assert check_pass(model, "eliminate-transposes").counts == {"identity_removed": 1}
    assert op_counts(model) == {"Relu": 1}


def test_transpose_of_constant_weight_feeding_matmul_is_folded():
    model = make_model([transpose("W", "wt", [1, 0]), node("MatMul", ["x", "wt"], ["y"])], {"x": [3, 6]}, ["y"],
                       {"W": rand(5, 6)})
    assert check_pass(model, "eliminate-transposes").counts == {"constants_folded": 1}
    assert op_counts(model) == {"MatMul": 1}
    assert [tuple(v.shape) for v in model.graph.initializers.values()] == [(6, 5)]


def test_transposes_feeding_gemm_become_trans_flags():
    model = make_model(
        [transpose("a", "at", [1, 0]), transpose("b", "bt", [1, 0]), node("Gemm", ["at", "bt", "c"], ["y"], transB=1)],
        {"a": [6, 3], "b": [6, 5]}, ["y"], {"c": rand(5)},
    )
    assert check_pass(model, "eliminate-transposes").counts == {"gemm_folded": 2}
    assert op_counts(model) == {"Gemm": 1}
    (gemm,) = model.graph
    assert (gemm.attributes.get_int("transA", 0), gemm.attributes.get_int("transB", 0)) == (1, 0)


def test_transpose_pushed_through_elementwise_chain_cancels():
    """NHWC round trip around Relu, Add(constant), Mul(same-perm Transpose) and Clip(scalars)."""
    nodes = [
        transpose("x", "t", [0, 2, 3, 1]),
        node("Relu", ["t"], ["r"]),
        node("Add", ["r", "c"], ["a"]),
        transpose("z", "zt", [0, 2, 3, 1]),
        node("Mul", ["a", "zt"], ["m"]),
        node("Clip", ["m", "lo", "hi"], ["k"]),
        transpose("k", "y", [0, 3, 1, 2]),
    ]
    inits = {"c": rand(5, 4, seed=1), "lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)}
    model = make_model(nodes, {"x": [2, 4, 3, 5], "z": [2, 4, 3, 5]}, ["y"], inits)
    assert check_pass(model, "eliminate-transposes").counts == {"pushed_through": 1}
    assert op_counts(model) == {"Relu": 1, "Add": 1, "Mul": 1, "Clip": 1}
    assert tuple(model.graph.outputs[0].shape) == (2, 4, 3, 5)


def test_non_inverse_pair_around_elementwise_op_is_kept():
    model = make_model([transpose("x", "t1", [0, 2, 1]), node("Relu", ["t1"], ["r"]), transpose("r", "y", [1, 0, 2])],
                       {"x": [2, 3, 4]}, ["y"])
    stats = check_pass(model, "eliminate-transposes")
    assert (stats.modified, stats.counts) == (False, {})
    assert op_counts(model) == {"Transpose": 2, "Relu": 1}
    assert "does not undo perm [0, 2, 1]" in near_misses(model)


def test_non_inverse_pair_with_shared_first_transpose_is_kept():
    model = make_model(
        [transpose("x", "t1", [0, 2, 1]), transpose("t1", "y", [1, 0, 2]), node("Relu", ["t1"], ["z"])],
        {"x": [2, 3, 4]}, ["y", "z"],
    )
    assert check_pass(model, "eliminate-transposes").counts == {}
    assert op_counts(model) == {"Transpose": 2, "Relu": 1}
    assert "has other consumers and perms do not cancel" in near_misses(model)


def test_push_through_stops_at_operand_in_another_layout():
    nodes = [transpose("x", "t", [0, 2, 1]), node("Add", ["t", "z"], ["a"]), transpose("a", "y", [0, 2, 1])]
    model = make_model(nodes, {"x": [2, 3, 4], "z": [2, 4, 3]}, ["y"])
    assert check_pass(model, "eliminate-transposes").counts == {}
    assert "operand 'z' of Add 'a' is neither constant" in near_misses(model)


def test_large_shared_constant_is_not_duplicated():
    weight = rand(80, 64)  # 5120 elements > small_constant
    model = make_model(
        [transpose("W", "wt", [1, 0]), node("MatMul", ["x", "wt"], ["y"]), node("MatMul", ["v", "W"], ["z"])],
        {"x": [2, 64], "v": [2, 80]}, ["y", "z"], {"W": weight},
    )
    assert check_pass(model, "eliminate-transposes").counts == {}
    assert "is shared; not duplicated" in near_misses(model)
