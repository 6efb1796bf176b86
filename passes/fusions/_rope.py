"""Matching the rotate-half rotary embedding ``x * cos + rotate_half(x) * sin`` and its cos/sin tables.

rotate_half(x) = Concat(Neg(x2), x1) on the last axis, where x1, x2 are x's two halves on that axis: one Split
(equal halves, by ``num_outputs`` or by sizes) or two Slices. The tables are those dstc's exporter (like
transformers) computes from position_ids::

    freqs = Unsqueeze(Cast(position_ids, float), [-1]) * inv_freq        # [B, S, D/2]
    emb = Concat(freqs, freqs, axis=-1)                                   # [B, S, D]
    cos = Unsqueeze(Cos(emb) [* attention_scaling], [1])                  # [B, 1, S, D], sin likewise
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from passes.base import node_label
from passes.fusions._common import axis_is_last, dims, int_list, is_op, other_input, producer, scalar
from passes.graph import constant_array

INT64_MAX = np.iinfo(np.int64).max


@dataclasses.dataclass
class RotateHalf:
    """``root = Add(Mul(x, cos), Mul(Concat(Neg(x2), x1), sin))``; ``halves`` are the nodes making x1, x2."""

    root: ir.Node
    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    half: int | None  # None when the halves come from Split(num_outputs=2) and x's last dim is unknown
    halves: list[ir.Node]
    nodes: list[ir.Node]  # every node of the pattern, root last


def _halves(x1: ir.Value, x2: ir.Value) -> tuple[ir.Value, int | None, list[ir.Node]] | str:
    """(x, half, nodes) when x1, x2 are the first and second half of one tensor's last axis."""
    split = x1.producer()
    if is_op(split, "Split") and x2.producer() is split:
        if len(split.outputs) != 2 or split.outputs[0] is not x1 or split.outputs[1] is not x2:
            return f"{split.op_type} does not cut x into (first half, second half)"
        x = split.inputs[0]
        if not axis_is_last(split.attributes.get_int("axis", 0), len(dims(x) or []) or None):
            return "the Split is not on the last axis"
        sizes = int_list(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
        width = (dims(x) or [None])[-1]
        if sizes is not None:
            if len(sizes) != 2 or sizes[0] != sizes[1]:
                return f"the Split sizes {sizes} are not two equal halves"
            return x, sizes[0], [split]
        if len(split.inputs) > 1 and split.inputs[1] is not None:
            return "the Split sizes are not constant"
        return x, (width // 2 if isinstance(width, int) and width % 2 == 0 else None), [split]
    first, second = producer(x1, "Slice"), producer(x2, "Slice")
    if first is None or second is None or first.inputs[0] is not second.inputs[0]:
        return "x1, x2 are not the two outputs of one Split nor two Slices of one tensor"
    x = first.inputs[0]
    rank = len(dims(x) or []) or None
    bounds = []
    for node in (first, second):
        args = [int_list(v) if v is not None else None for v in list(node.inputs[1:]) + [None] * (5 - len(node.inputs))]
        starts, ends, axes, steps = args[0], args[1], args[2], args[3]
        if starts is None or ends is None or len(starts) != 1 or (axes is not None and len(axes) != 1):
            return "the Slices do not cut one constant range"
        if axes is None or not axis_is_last(axes[0], rank) or (steps is not None and steps != [1]):
            return "the Slices are not unit-step slices of the last axis"
        bounds.append((starts[0], ends[0]))
    (s1, e1), (s2, e2) = bounds
    width = (dims(x) or [None])[-1]
    if s1 != 0 or s2 != e1 or (e2 < INT64_MAX // 2 and e2 != 2 * e1) or (isinstance(width, int) and width != 2 * e1):
        return f"the Slices [{s1}:{e1}] and [{s2}:{e2}] are not the two halves"
    return x, e1, [first, second]


def match_rotate_half(add: ir.Node) -> RotateHalf | str | None:
    """The rotate-half pattern rooted at ``add``; the reason it is not one when an operand of the Add is
    Mul(Concat(Neg(_), _), _) (a candidate); None for any other node."""
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return None
    reason = None
    for mul_sin_value in add.inputs:
        mul_sin = producer(mul_sin_value, "Mul")
        if mul_sin is None:
            continue
        for rotated in mul_sin.inputs:
            concat = producer(rotated, "Concat")
            if concat is None or len(concat.inputs) != 2:
                continue
            neg = producer(concat.inputs[0], "Neg")
            if neg is None:
                continue
            rank = len(dims(rotated) or []) or None
            if not axis_is_last(concat.attributes.get_int("axis", 0), rank):
                reason = "the rotate-half Concat is not on the last axis"
                continue
            halves = _halves(concat.inputs[1], neg.inputs[0])
            if isinstance(halves, str):
                reason = halves
                continue
            x, half, half_nodes = halves
            mul_cos = producer(other_input(add, mul_sin_value), "Mul")
            if mul_cos is None or x not in mul_cos.inputs:
                reason = "the other operand of the Add is not Mul(x, cos) of the same x"
                continue
            sin, cos = other_input(mul_sin, rotated), other_input(mul_cos, x)
            inner = [*half_nodes, neg, concat, mul_sin, mul_cos]
            for node in inner:
                for out in node.outputs:
                    users = {use[0] for use in out.uses()}
                    if out.is_graph_output() or not users <= set(inner) | {add}:
                        return f"{node_label(node)} of the pattern has uses outside it"
            return RotateHalf(add, x, cos, sin, half, half_nodes, [*inner, add])
    return reason


@dataclasses.dataclass
class RopeTables:
    """cos/sin computed from ``position_ids`` and a constant ``inv_freq`` [D/2], times ``scaling``."""

    position_ids: ir.Value
    inv_freq: np.ndarray
    scaling: float
    nodes: list[ir.Node]


def _table(value: ir.Value, fn: str) -> tuple[ir.Value, float, list[ir.Node]] | str:
    """(emb, scaling, nodes) for value = Unsqueeze(fn(emb) [* scaling], [1])."""
    unsqueeze = producer(value, "Unsqueeze")
    if unsqueeze is None or int_list(unsqueeze.inputs[1]) != [1]:
        return f"the {fn} table is not Unsqueeze(_, [1]) of a [B, S, D] table"
    inner, scaling, nodes = unsqueeze.inputs[0], 1.0, [unsqueeze]
    mul = producer(inner, "Mul")
    if mul is not None:
        for operand in mul.inputs:
            s = scalar(operand)
            if s is not None and producer(other_input(mul, operand), fn) is not None:
                inner, scaling, nodes = other_input(mul, operand), float(s), nodes + [mul]
                break
        else:
            return f"the {fn} table is scaled by a non-constant"
    trig = producer(inner, fn)
    if trig is None:
        return f"the {fn} table is not {fn}(emb)"
    return trig.inputs[0], scaling, nodes + [trig]


def match_tables(cos: ir.Value, sin: ir.Value) -> RopeTables | str:
    """The position_ids / inv_freq computation behind a rotary embedding's cos and sin, or why it is not one."""
    cos_table, sin_table = _table(cos, "Cos"), _table(sin, "Sin")
    for table in (cos_table, sin_table):
        if isinstance(table, str):
            return table
    (emb, scaling, cos_nodes), (sin_emb, sin_scaling, sin_nodes) = cos_table, sin_table
    if emb is not sin_emb or scaling != sin_scaling:
        return "cos and sin are not computed from the same angles and scaling"
    concat = producer(emb, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.inputs[0] is not concat.inputs[1]:
        return "the angles are not Concat(freqs, freqs)"
    freqs = producer(concat.inputs[0], "Mul")
    if freqs is None:
        return "freqs is not position * inv_freq (a Mul)"
    for operand in freqs.inputs:
        inv_freq = constant_array(operand)
        if inv_freq is None or inv_freq.ndim != 1:
            continue
        unsqueeze = producer(other_input(freqs, operand), "Unsqueeze")
        cast = producer(unsqueeze.inputs[0], "Cast") if unsqueeze is not None else None
        if cast is None or int_list(unsqueeze.inputs[1]) not in ([-1], [2]):
            return "the positions are not Unsqueeze(Cast(position_ids), [-1])"
        if cast.attributes.get_int("to", 0) != ir.DataType.FLOAT:
            return "the positions are not cast to float"
        position_ids = cast.inputs[0]
        if position_ids.dtype != ir.DataType.INT64 or len(dims(position_ids) or []) != 2:
            return "position_ids is not an int64 [batch, sequence] tensor"
        nodes = [*cos_nodes, *sin_nodes, concat, freqs, unsqueeze, cast]
        return RopeTables(position_ids, inv_freq.astype(np.float32), scaling, nodes)
    return "freqs is not a product with a constant 1-D inv_freq"
