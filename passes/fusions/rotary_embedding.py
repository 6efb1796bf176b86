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

from passes.fusions._common import FusionPass, MS_DOMAIN, Emitter, dims, is_op, remove_dead, use_opset
from passes.fusions._rope import match_rotate_half, match_tables
from passes.graph import bypass, drop_orphaned_initializers, initializers_in_use
from passes.registry import register


@register("fuse-rotary-embedding", targets=("onnxruntime",),
          description="x*cos + rotate_half(x)*sin from position_ids -> ORT RotaryEmbedding with in-graph caches.")
class FuseRotaryEmbedding(FusionPass):
    """Counts: ``rotary_embedding`` (RotaryEmbedding nodes created), ``cos_sin_caches`` (cache pairs built)."""

    def apply(self, model: ir.Model) -> Counter:
        graph = model.graph
        counts: Counter = Counter()
        emit = Emitter(graph)
        used_before = initializers_in_use(graph)
        caches: dict[tuple, tuple[ir.Value, ir.Value]] = {}
        dead: list[ir.Node] = []
        for add in [n for n in graph if is_op(n, "Add")]:
            match = match_rotate_half(add)
            if match is None:
                continue
            if isinstance(match, str):
                self.near_miss("rotary_embedding", add, match, 1)
                continue
            x_dims = dims(match.x)
            if x_dims is None or len(x_dims) != 4:
                self.near_miss("rotary_embedding", add, f"x has shape {x_dims}, not [B, heads, S, D]", 2)
                continue
            tables = match_tables(match.cos, match.sin)
            if isinstance(tables, str):
                self.near_miss("rotary_embedding", add, tables, 3)
                continue
            half = tables.inv_freq.size
            if match.half not in (None, half) or (isinstance(x_dims[3], int) and x_dims[3] != 2 * half):
                self.near_miss("rotary_embedding", add, f"x's last dim {x_dims[3]} is not twice inv_freq's {half}", 4)
                continue
            key = (tables.position_ids, tables.inv_freq.tobytes(), tables.scaling)
            if key not in caches:
                caches[key] = self._caches(emit, add, tables)
                counts["cos_sin_caches"] += 1
            cos_cache, sin_cache = caches[key]
            rope = emit.node(add, "RotaryEmbedding", [match.x, tables.position_ids, cos_cache, sin_cache],
                             {"interleaved": 0}, domain=MS_DOMAIN)
            out = rope.outputs[0]
            out.dtype, out.shape = add.outputs[0].dtype, match.x.shape
            bypass(graph, add.outputs[0], out)
            dead += match.nodes + tables.nodes
            counts["rotary_embedding"] += 1
        if counts:
            use_opset(model, MS_DOMAIN, 1)
            remove_dead(graph, dead)
            drop_orphaned_initializers(graph, used_before)
            graph.sort()
        return counts

    @staticmethod
    def _caches(emit: Emitter, anchor: ir.Node, tables) -> tuple[ir.Value, ir.Value]:
        pos = tables.position_ids
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
