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
form where they consume it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from passes.fusions._common import MS_DOMAIN, FusionPass, Miss, dims, is_op
from passes.fusions._rope import match_rotate_half, match_tables
from passes.graph import bypass
from passes.registry import register


@register("fuse-rotary-embedding", targets=("onnxruntime",),
          description="x*cos + rotate_half(x)*sin from position_ids -> ORT RotaryEmbedding with in-graph caches.")
class FuseRotaryEmbedding(FusionPass):
    """Counts: ``rotary_embedding`` (RotaryEmbedding nodes created), ``cos_sin_caches`` (cache pairs built)."""

    rule, domain = "rotary_embedding", MS_DOMAIN

    def start(self, model: ir.Model) -> None:
        self.caches: dict[tuple, tuple[ir.Value, ir.Value]] = {}

    def match(self, add: ir.Node):
        match = match_rotate_half(add) if is_op(add, "Add") else None
        if match is None or isinstance(match, str):
            return None if match is None else Miss(match)
        x_dims = dims(match.x)
        if x_dims is None or len(x_dims) != 4:
            return Miss(f"x has shape {x_dims}, not [B, heads, S, D]", 2)
        tables = match_tables(match.cos, match.sin)
        if isinstance(tables, str):
            return Miss(tables, 3)
        half = tables.inv_freq.size
        if match.half not in (None, half) or (isinstance(x_dims[3], int) and x_dims[3] != 2 * half):
            return Miss(f"x's last dim {x_dims[3]} is not twice inv_freq's {half}", 4)
        return match, tables

    def rewrite(self, found) -> tuple[str, list[ir.Node]]:
        match, tables = found
        add = match.root
        key = (tables.position_ids, tables.inv_freq.tobytes(), tables.scaling)
        if key not in self.caches:
            self.caches[key] = self._caches(add, tables)
        cos_cache, sin_cache = self.caches[key]
        rope = self.emit.node(add, "RotaryEmbedding", [match.x, tables.position_ids, cos_cache, sin_cache],
                              {"interleaved": 0}, domain=MS_DOMAIN)
        out = rope.outputs[0]
        out.dtype, out.shape = add.outputs[0].dtype, match.x.shape
        bypass(self.emit.graph, add.outputs[0], out)
        return "rotary_embedding", match.nodes + tables.nodes

    def apply(self, model: ir.Model) -> Counter:
        counts = super().apply(model)
        if counts:
            counts["cos_sin_caches"] = len(self.caches)
        return counts

    def _caches(self, anchor: ir.Node, tables) -> tuple[ir.Value, ir.Value]:
        emit, pos = self.emit, tables.position_ids
        last = emit.op(anchor, "ReduceMax", pos, keepdims=0, name="rope_cache/ReduceMax")
        rows = emit.op(anchor, "Range", emit.const(0), emit.op(anchor, "Add", last, emit.const(1)), emit.const(1))
        rows = emit.op(anchor, "Unsqueeze", emit.op(anchor, "Cast", rows, to=ir.DataType.FLOAT), emit.const([-1]))
        angles = emit.op(anchor, "Mul", rows, emit.const(tables.inv_freq, np.float32, "inv_freq"))
        cos, sin = emit.op(anchor, "Cos", angles), emit.op(anchor, "Sin", angles)
        if tables.scaling != 1.0:
            scaling = emit.const(tables.scaling, np.float32, "attention_scaling")
            cos, sin = emit.op(anchor, "Mul", cos, scaling), emit.op(anchor, "Mul", sin, scaling)
        half = tables.inv_freq.size
        for value in (cos, sin):
            value.dtype, value.shape = ir.DataType.FLOAT, ir.Shape([None, half])
        return cos, sin
