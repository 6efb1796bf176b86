"""fuse-silu: x * Sigmoid(x) -> com.microsoft QuickGelu(alpha=1)."""

from __future__ import annotations

import pytest
from passes_helpers import check_pass, make_model, node, op_counts, rand

from passes.fusions.silu import FuseSilu


def gated_mlp(*, sigmoid_first=False, sigmoid_reused=False, other_operand=False):
    """down(silu(x @ Wg) * (x @ Wu)), the exporter's gated MLP."""
    gate = "u" if other_operand else "g"
    nodes = [node("MatMul", ["x", "Wg"], ["g"]), node("MatMul", ["x", "Wu"], ["u"]), node("Sigmoid", ["g"], ["s"]),
             node("Mul", ["s", gate] if sigmoid_first else [gate, "s"], ["act"]), node("Mul", ["act", "u"], ["h"]),
             node("MatMul", ["h", "Wd"], ["y"])]
    outputs = ["y"]
    if sigmoid_reused:
        nodes.append(node("Neg", ["s"], ["z"]))
        outputs.append("z")
    inits = {"Wg": rand(8, 12, seed=1), "Wu": rand(8, 12, seed=2), "Wd": rand(12, 8, seed=3)}
    return make_model(nodes, {"x": [2, 3, 8]}, outputs, inits)


@pytest.mark.parametrize("sigmoid_first", [False, True])
def test_silu_becomes_quick_gelu(sigmoid_first):
    model = gated_mlp(sigmoid_first=sigmoid_first)
    stats = check_pass(model, "fuse-silu")
    assert stats.counts == {"silu": 1} and (stats.nodes_before, stats.nodes_after) == (6, 5)
    assert op_counts(model) == {"MatMul": 3, "QuickGelu": 1, "Mul": 1}
    quick_gelu = next(n for n in model.graph if n.op_type == "QuickGelu")
    assert quick_gelu.domain == "com.microsoft" and quick_gelu.attributes.get_float("alpha") == 1.0


def test_no_fusion_when_the_sigmoid_is_used_elsewhere():
    model = gated_mlp(sigmoid_reused=True)
    assert check_pass(model, "fuse-silu").counts == {}
    assert "'s' is also used by Neg 'z'" in " | ".join(str(m) for m in FuseSilu().near_misses(model))


def test_no_fusion_for_a_sigmoid_gate_of_another_value():
    model = gated_mlp(other_operand=True)  # u * Sigmoid(g): a GLU, not SiLU
    assert check_pass(model, "fuse-silu").counts == {}
    assert "Sigmoid" in op_counts(model)
