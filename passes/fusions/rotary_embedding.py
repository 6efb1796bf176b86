"""fuse-rotary-embedding: x * cos + rotate_half(x) * sin -> com.microsoft RotaryEmbedding(x, position_ids, cos_cache,
sin_cache), for ONNX Runtime.

The exported graph computes cos/sin per token from ``position_ids`` (``passes.fusions._rope``); ORT's
RotaryEmbedding instead gathers rows of 2-D caches [max_position, D/2] by ``position_ids`` [B, S] and rotates
the two halves (``interleaved=0``: DeepSeek's interleaved RoPE was already de-interleaved into the projection
weights at export, so every rotary embedding in a dstc graph is rotate-half). The caches are built in the graph,
once for all layers, from the same inv_freq and attention scaling::

    rows = Cast(Range(0, ReduceMax(position_ids) + 1, 1), float)         # [P]
    cos_cache = Cos(Unsqueeze(rows, [-1]) * inv_freq) [* scaling]        # [P, D/2]; sin_cache likewise

so the angle of position p is the same float32 product p * inv_freq as before, the caches cover every position
the step uses (no max-length limit baked in), left padding keeps its per-row positions, and the results agree
with the unfused graph to rounding. Computing the caches costs P * D/2 cos and sin per step, shared by every
layer, where the unfused graph computed B * S * D of each.

x stays 4-D [B, heads, S, D] (ORT's 4-D input form); the attention fusions move it to the 3-D [B, S, hidden]
form where they consume it. One rule, its pattern the rotation (commuted: every operand order of the Add and
Muls); its check matches the tables with the patterns of ``_rope`` and gives the near-miss reasons; the caches
are built once per graph, by the first rewrite, and shared through the pass's ``GraphEdit``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from passes.fusions._common import MS_DOMAIN, dims
from passes.fusions._rope import match_tables, rotation, rotation_pattern
from passes.graph import set_dtype
from passes.registry import register
from passes.rewrite import FusionRule, RewriteRulesPass


class _RotaryEmbedding(FusionRule):
    def pattern(self, op, x, cos, sin):
        return rotation_pattern(op, x, cos, sin)

    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, **b) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        found = rotation(context.root, b)
        if isinstance(found, str):
            return result.fail(found)
        x_dims = dims(found.x)
        if x_dims is None or len(x_dims) != 4:
            return result.fail(f"x has shape {x_dims}, not [B, heads, S, D]")
        tables = match_tables(context, found.cos, found.sin)
        if isinstance(tables, str):
            return result.fail(tables)
        half = tables.inv_freq.size
        if found.half not in (None, half) or (isinstance(x_dims[3], int) and x_dims[3] != 2 * half):
            return result.fail(f"x's last dim {x_dims[3]} is not twice inv_freq's {half}")
        self.found = found, tables
        return result

    def rewrite(self, op, **_):
        (found, tables), emit = self.found, self.emit(op)
        key = ("rope_caches", tables.position_ids, tables.inv_freq.tobytes(), tables.scaling)
        if key not in self.edit.shared:
            self.edit.shared[key] = _caches(emit, tables)
            self.counted = ("rotary_embedding", "cos_sin_caches")
        cos_cache, sin_cache = self.edit.shared[key]
        rope = emit.node("RotaryEmbedding", [found.x, tables.position_ids, cos_cache, sin_cache], {"interleaved": 0},
                         domain=MS_DOMAIN)
        out = rope.outputs[0]
        set_dtype(out, found.root.outputs[0].dtype)
        out.shape = found.x.shape
        self.edit.dead += tables.nodes
        return out


def _caches(emit, tables) -> tuple[ir.Value, ir.Value]:
    pos = tables.position_ids
    last = emit.op("ReduceMax", pos, keepdims=0, name="rope_cache/ReduceMax")
    rows = emit.op("Range", emit.const(0), emit.op("Add", last, emit.const(1)), emit.const(1))
    rows = emit.op("Unsqueeze", emit.op("Cast", rows, to=ir.DataType.FLOAT), emit.const([-1]))
    angles = emit.op("Mul", rows, emit.const(tables.inv_freq, np.float32, "inv_freq"))
    cos, sin = emit.op("Cos", angles), emit.op("Sin", angles)
    if tables.scaling != 1.0:
        scaling = emit.const(tables.scaling, np.float32, "attention_scaling")
        cos, sin = emit.op("Mul", cos, scaling), emit.op("Mul", sin, scaling)
    half = tables.inv_freq.size
    for value in (cos, sin):
        value.dtype, value.shape = ir.DataType.FLOAT, ir.Shape([None, half])
    return cos, sin


@register("fuse-rotary-embedding", targets=("onnxruntime",),
          description="x*cos + rotate_half(x)*sin from position_ids -> ORT RotaryEmbedding with in-graph caches.")
class FuseRotaryEmbedding(RewriteRulesPass):
    """Counts: ``rotary_embedding`` (RotaryEmbedding nodes created), ``cos_sin_caches`` (cache pairs built)."""

    def __init__(self) -> None:
        super().__init__([_RotaryEmbedding("rotary_embedding")], commute=True)
