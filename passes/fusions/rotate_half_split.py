"""rotate-half-split: the halves of a rotary embedding's rotate_half(x) taken by a Split with explicit sizes on a
non-negative axis, the form OpenVINO's RoPE fusion recognises.

OpenVINO fuses ``x * cos + Concat(-x2, x1) * sin`` into its RoPE kernel at compile time (RoPEFusionGPTNEOX, run
by the CPU plugin) when x1, x2 come from a VariadicSplit on axis 3 (or from Slices). dstc's exporter writes
``Split(x, axis=-1, num_outputs=2)``, which the ONNX frontend turns into a plain Split that the fusion does not
match: on the exported graphs OpenVINO fuses no RoPE at all. The same halves as ``Split(x, [D/2, D/2],
axis=rank-1)`` become a VariadicSplit on axis 3 and the fusion fires on every q and k rotation, MLA's
partial-head rotations included (checked by compiling with OpenVINO in the tests).

Standard ONNX in, standard ONNX out; the values are the same, so the rewrite is exact on any runtime.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.fusions._common import FusionPass, Miss, dims, int_list, is_op
from passes.fusions._rope import match_rotate_half
from passes.registry import register


@register("rotate-half-split", targets=("openvino",),
          description="Rotary rotate_half halves by Split with sizes on a positive axis (OpenVINO RoPE fusion).")
class RotateHalfSplit(FusionPass):
    """Counts: ``rotate_half_split`` (Splits rewritten)."""

    rule = "rotate_half_split"

    def match(self, add: ir.Node):
        match = match_rotate_half(add) if is_op(add, "Add") else None
        if match is None or isinstance(match, str):
            return None if match is None else Miss(match)
        split = match.halves[0]
        if not is_op(split, "Split"):
            return None  # Slices: already a form OpenVINO matches
        x_dims = dims(match.x)
        if x_dims is None or match.half is None:
            return Miss("x's rank or last dim unknown (run infer-shapes first)", 2)
        sizes = int_list(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
        if split.attributes.get_int("axis", 0) == len(x_dims) - 1 and sizes == [match.half, match.half]:
            return None  # already canonical
        return match, len(x_dims) - 1

    def rewrite(self, found) -> tuple[str, list[ir.Node]]:
        match, axis = found
        split = match.halves[0]
        new = self.emit.node(split, "Split", [match.x, self.emit.const([match.half, match.half])], {"axis": axis},
                             num_outputs=2)
        for old, value in zip(split.outputs, new.outputs):
            value.dtype, value.shape = old.dtype, old.shape
            old.replace_all_uses_with(value)
        return "rotate_half_split", [split]
