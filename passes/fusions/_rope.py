"""onnxscript patterns for the rotate-half rotary embedding ``x * cos + rotate_half(x) * sin`` and its cos/sin
tables, and the checks the fusions built on them share.

rotate_half(x) = Concat(Neg(x2), x1) on the last axis, where x1, x2 are x's two halves on that axis: one Split
(equal halves, by ``num_outputs`` or by sizes) or two Slices (an ``OrValue`` of the two forms). The tables are
those dstc's exporter (like transformers) computes from position_ids::

    freqs = Unsqueeze(Cast(position_ids, float), [-1]) * inv_freq        # [B, S, D/2]
    emb = Concat(freqs, freqs, axis=-1)                                   # [B, S, D]
    cos = Unsqueeze(Cos(emb) [* attention_scaling], [1])                  # [B, 1, S, D], sin likewise

onnxscript's own ort_fusions do not fit these graphs: their RotaryEmbeddingFusion wants Slices on axis 3 (the
exporter writes one Split on axis -1), their CosSinCacheFusion the tables as MatMul(inv_freq, positions) and a
Transpose (the exporter multiplies, as above).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule, pattern

from passes.base import node_label
from passes.fusions._common import axis_is_last, dims, int_list, is_op, producer, scalar, uses_outside
from passes.graph import constant_array

INT64_MAX = np.iinfo(np.int64).max


def rotate_half(op, x, cos, sin, x1, x2):
    """Pattern: x * cos + Concat(Neg(x2), x1) * sin (commute the rule set for the operand orders)."""
    rotated = op.Concat(op.Neg(x2, _outputs=["neg"]), x1, _outputs=["rotated"])
    return op.Add(op.Mul(x, cos, _outputs=["x_cos"]), op.Mul(rotated, sin, _outputs=["rotated_sin"]))


def halves(op, x):
    """Pattern: (x1, x2), the two outputs of one Split of x or two Slices of x (checked by :func:`rotation`)."""
    split = op.Split(x, _allow_other_inputs=True, _outputs=["split_x1", "split_x2"])
    x1 = pattern.OrValue([split[0], op.Slice(x, _allow_other_inputs=True)], name="x1")
    x2 = pattern.OrValue([split[1], op.Slice(x, _allow_other_inputs=True)], name="x2")
    return x1, x2


def rotation_pattern(op, x, cos, sin):
    """Pattern: the whole rotate-half rotary embedding of x."""
    return rotate_half(op, x, cos, sin, *halves(op, x))


# The rotation with every operand order of its Add and Muls, for matching at an Add found otherwise.
ROTATIONS = RewriteRule(rotation_pattern, lambda op, **_: None).commute()


@dataclasses.dataclass
class Rotation:
    """``root = Add(Mul(x, cos), Mul(Concat(Neg(x2), x1), sin))``; ``halves`` are the nodes making x1, x2."""

    root: ir.Node
    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    half: int | None  # None when the halves come from Split(num_outputs=2) and x's last dim is unknown
    halves: list[ir.Node]


def _halves(x1: ir.Value, x2: ir.Value) -> tuple[int | None, list[ir.Node]] | str:
    """(half, nodes) when x1, x2 are the first and second half of one tensor's last axis."""
    split = x1.producer()
    if is_op(split, "Split") and x2.producer() is split:
        if len(split.outputs) != 2:
            return f"{split.op_type} does not cut x into (first half, second half)"
        x = split.inputs[0]
        if not axis_is_last(split.attributes.get_int("axis", 0), len(dims(x) or []) or None):
            return "the Split is not on the last axis"
        sizes = int_list(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
        width = (dims(x) or [None])[-1]
        if sizes is not None:
            if len(sizes) != 2 or sizes[0] != sizes[1]:
                return f"the Split sizes {sizes} are not two equal halves"
            return sizes[0], [split]
        if len(split.inputs) > 1 and split.inputs[1] is not None:
            return "the Split sizes are not constant"
        return (width // 2 if isinstance(width, int) and width % 2 == 0 else None), [split]
    first, second = producer(x1, "Slice"), producer(x2, "Slice")
    if first is None or second is None:
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
    return e1, [first, second]


def rotation(root: ir.Node, b: dict) -> Rotation | str:
    """The rotation :func:`rotation_pattern` matched at ``root`` (bindings ``b``), or why it is none."""
    rotated = b["rotated"]
    if not axis_is_last(rotated.producer().attributes.get_int("axis", 0), len(dims(rotated) or []) or None):
        return "the rotate-half Concat is not on the last axis"
    found = _halves(b["x1"], b["x2"])
    if isinstance(found, str):
        return found
    half, half_nodes = found
    inner = [*half_nodes, b["neg"].producer(), rotated.producer(), b["rotated_sin"].producer(), b["x_cos"].producer()]
    escaped = uses_outside([*inner, root], root, "pattern")
    if escaped:
        return escaped
    return Rotation(root, b["x"], b["cos"], b["sin"], half, half_nodes)


class _Table(pattern.PatternBase):
    """Pattern: Unsqueeze(fn(Concat(freqs, freqs)) [* scaling], [1]), freqs = Unsqueeze(Cast(ids), axes) * inv_freq."""

    def __init__(self, fn: str) -> None:
        super().__init__(f"rope_{fn.lower()}_table")
        self.fn = fn

    def pattern(self, op, position_ids, positions_axes, inv_freq, scaling):
        positions = op.Unsqueeze(op.Cast(position_ids, _outputs=["cast"]), positions_axes)
        freqs = pattern.OrValue([op.Mul(positions, inv_freq), op.Mul(inv_freq, positions)], name="freqs")
        trig = getattr(op, self.fn)(op.Concat(freqs, freqs, _outputs=["emb"]), _outputs=["trig"])
        table = pattern.OrValue([op.Mul(trig, scaling), op.Mul(scaling, trig), trig], tag_var="scaled",
                                tag_values=[True, True, False])
        return op.Unsqueeze(table, [1])


_TABLES = {"Cos": _Table("Cos"), "Sin": _Table("Sin")}


def _failure(match) -> str:
    """The matcher's reason for a failed match, with the node or value it failed at."""
    sources = match.failure_nodes_and_values
    if not sources:
        return match.reason
    at = sources[0]
    return f"{match.reason.rstrip('.')} at {node_label(at) if isinstance(at, ir.Node) else repr(at.name)}"


@dataclasses.dataclass
class RopeTables:
    """cos/sin computed from ``position_ids`` and a constant ``inv_freq`` [D/2], times ``scaling``."""

    position_ids: ir.Value
    inv_freq: np.ndarray
    scaling: float
    nodes: list[ir.Node]


def match_tables(context, cos: ir.Value, sin: ir.Value) -> RopeTables | str:
    """The position_ids / inv_freq computation behind a rotary embedding's cos and sin, or why it is not one."""
    found = {}
    for fn, value in (("Cos", cos), ("Sin", sin)):
        node = value.producer()
        match = None if node is None else _TABLES[fn].match(
            context.model, context.graph_or_function, node, check_nodes_are_removable=False)
        if not match:
            why = f"{value.name!r} is not computed by a node" if match is None else _failure(match)
            return (f"the {fn} table is not Unsqueeze(_, [1]) of a [B, S, D] table {fn}(Concat(freqs, freqs)) [* "
                    f"scaling], freqs = Unsqueeze(Cast(position_ids), [-1]) * inv_freq ({why})")
        b = match.bindings
        scaling = scalar(b["scaling"]) if b["scaled"] else 1.0
        if scaling is None:
            return f"the {fn} table is scaled by a non-constant"
        found[fn] = (b, float(scaling), list(match.nodes))
    (b, scaling, cos_nodes), (sin_b, sin_scaling, sin_nodes) = found["Cos"], found["Sin"]
    if b["emb"] is not sin_b["emb"] or scaling != sin_scaling:
        return "cos and sin are not computed from the same angles and scaling"
    inv_freq = constant_array(b["inv_freq"])
    if inv_freq is None or inv_freq.ndim != 1:
        return "freqs is not a product with a constant 1-D inv_freq"
    if int_list(b["positions_axes"]) not in ([-1], [2]):
        return "the positions are not Unsqueeze(Cast(position_ids), [-1])"
    if b["cast"].producer().attributes.get_int("to", 0) != ir.DataType.FLOAT:
        return "the positions are not cast to float"
    position_ids = b["position_ids"]
    if position_ids.dtype != ir.DataType.INT64 or len(dims(position_ids) or []) != 2:
        return "position_ids is not an int64 [batch, sequence] tensor"
    nodes = list(dict.fromkeys([*cos_nodes, *sin_nodes]))
    return RopeTables(position_ids, inv_freq.astype(np.float32), scaling, nodes)
