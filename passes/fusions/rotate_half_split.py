"""rotate-half-split: the halves of a rotary embedding's rotate_half(x) taken by a Split with explicit sizes on a
non-negative axis, the form OpenVINO's RoPE fusion recognises.

OpenVINO fuses ``x * cos + Concat(-x2, x1) * sin`` into its RoPE kernel at compile time (RoPEFusionGPTNEOX, run
by the CPU plugin) when x1, x2 come from a VariadicSplit on axis 3 (or from Slices). dstc's exporter writes
``Split(x, axis=-1, num_outputs=2)``, which the ONNX frontend turns into a plain Split that the fusion does not
match: on the exported graphs OpenVINO fuses no RoPE at all. The same halves as ``Split(x, [D/2, D/2],
axis=rank-1)`` become a VariadicSplit on axis 3 and the fusion fires on every q and k rotation, MLA's
partial-head rotations included (checked by compiling with OpenVINO in the tests).

Standard ONNX in, standard ONNX out; the values are the same, so the rewrite is exact on any runtime. The rule's
pattern is the Split, the value it replaces; its check matches the rotation the Split feeds with the patterns of
``passes.fusions._rope`` (a Split that feeds none is not a candidate).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from passes.fusions._common import dims, int_list, is_op
from passes.fusions._rope import ROTATIONS, Rotation, rotation
from passes.graph import set_dtype
from passes.registry import register
from passes.rewrite import FusionRule, RewriteRulesPass


def _rotation_of(context, split: ir.Node) -> tuple[ir.Node, Rotation | str] | None:
    """The Add (reached through Neg, Concat and Mul) of the rotation whose halves ``split`` makes, with the
    rotation or why it is none; None when ``split`` makes the halves of no rotation."""
    x1, x2 = split.outputs[:2] if len(split.outputs) >= 2 else (None, None)
    for neg in (n for n in (x2.consumers() if x2 is not None else ()) if is_op(n, "Neg")):
        for concat in (n for n in neg.outputs[0].consumers() if is_op(n, "Concat")):
            for mul in (n for n in concat.outputs[0].consumers() if is_op(n, "Mul")):
                for add in (n for n in mul.outputs[0].consumers() if is_op(n, "Add")):
                    for variant in ROTATIONS:
                        match = variant.match(context.model, context.graph_or_function, add,
                                              check_nodes_are_removable=False)
                        if match and match.bindings["x1"] is x1 and match.bindings["x2"] is x2:
                            return add, rotation(add, match.bindings)
    return None


class _RotateHalfSplit(FusionRule):
    def pattern(self, op, x):
        return op.Split(x, _allow_other_inputs=True, _outputs=["x1", "x2"])

    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, x, **_) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        split = context.root
        rotation_of = _rotation_of(context, split)
        if rotation_of is None:
            return self.decline("the Split does not make the halves of a rotate_half")
        self.where, found = rotation_of  # near-misses name the Add, as the rotary fusion's do
        if isinstance(found, str):
            return result.fail(found)
        x_dims = dims(found.x)
        if x_dims is None or found.half is None:
            return result.fail("x's rank or last dim unknown (run infer-shapes first)")
        sizes = int_list(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
        if split.attributes.get_int("axis", 0) == len(x_dims) - 1 and sizes == [found.half, found.half]:
            return self.decline("the halves are already split by sizes on a positive axis")
        self.found = found, len(x_dims) - 1
        return result

    def rewrite(self, op, **_):
        (found, axis), emit = self.found, self.emit(op)
        split = found.halves[0]
        new = emit.node("Split", [found.x, emit.const([found.half, found.half])], {"axis": axis}, num_outputs=2)
        for old, value in zip(split.outputs, new.outputs):
            set_dtype(value, old.dtype)
            value.shape = old.shape
        return tuple(new.outputs)


@register("rotate-half-split", targets=("openvino",),
          description="Rotary rotate_half halves by Split with sizes on a positive axis (OpenVINO RoPE fusion).")
class RotateHalfSplit(RewriteRulesPass):
    """Counts: ``rotate_half_split`` (Splits rewritten)."""

    def __init__(self) -> None:
        super().__init__([_RotateHalfSplit("rotate_half_split")])
