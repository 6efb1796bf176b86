"""onnxscript patterns for scaled dot-product attention over a concatenated KV cache, as dstc's ``blocks.sdpa``
writes it, and the checks and replacement helpers the attention fusions share::

    present_k = Concat(past_k, k, axis=2); present_v = Concat(past_v, v, axis=2)      # [B, kv_heads, T, D]
    K = repeat_kv(present_k)        # optional: Reshape(Expand(Unsqueeze(_, [2]), [1,1,n,1,1]), [0, heads, -1, D])
    out = MatMul(Softmax(Add(Mul(MatMul(q, Transpose(K, [0,1,3,2])), scale), mask)), V)   # [B, heads, S, Dv]
    out3 = Reshape(Transpose(out, [0,2,1,3]), [0, 0, -1])                                # optional, [B, S, hidden]

repeat_kv, the scale (a Mul by a constant either side, a Div by one, or none) and the mask Add (either way round)
are ``OrValue`` s; the pattern also takes attention without a mask, which the checks reject with a reason
(causality unknown). Its output is the attention's; the fused ops' present outputs take the place of the cache
Concats through ``GraphEdit.replace``.

onnxscript's own SDPA pattern (ort_fusions.sdpa) covers the attention core but neither the cache nor repeat_kv,
and its GQA fusion wants RotaryEmbedding inside and a causal mask it replaces by sequence lengths, where dstc
keeps the graph's own mask (left padding stays exact); hence these patterns.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.base import node_label
from passes.fusions._common import (
    MS_DOMAIN,
    axis_is_last,
    dims,
    int_list,
    is_op,
    only_consumer,
    producer,
    scalar,
    static_dim,
)
from passes.graph import set_dtype


def _repeat_kv(op, present, axes, reps, shape, kv: str):
    unsqueezed = op.Unsqueeze(present, axes, _outputs=[f"{kv}_unsqueezed"])
    return op.Reshape(op.Expand(unsqueezed, reps, _outputs=[f"{kv}_expanded"]), shape, _outputs=[f"{kv}_repeated"])


def attention(op, q, past_k, new_k, past_v, new_v, mask, scale, k_axes, k_reps, k_shape, v_axes, v_reps, v_shape):
    """Pattern: the attention output [B, H, S, Dv]; K and V are KV cache Concats, read through repeat_kv or not."""
    present_k = op.Concat(past_k, new_k, _outputs=["present_k"])
    present_v = op.Concat(past_v, new_v, _outputs=["present_v"])
    key = pattern.OrValue([_repeat_kv(op, present_k, k_axes, k_reps, k_shape, "k"), present_k])
    value = pattern.OrValue([_repeat_kv(op, present_v, v_axes, v_reps, v_shape, "v"), present_v])
    qk = op.MatMul(q, op.Transpose(key, _outputs=["key_t"]), _outputs=["qk"])
    scores = pattern.OrValue([op.Mul(qk, scale), op.Mul(scale, qk), op.Div(qk, scale), qk], name="scores",
                             tag_var="scaling", tag_values=["Mul", "Mul", "Div", None])
    masked = pattern.OrValue([op.Add(scores, mask), op.Add(mask, scores), scores], name="masked",
                             tag_var="has_mask", tag_values=[True, True, False])
    probs = op.Softmax(masked, _outputs=["probs"])
    return op.MatMul(probs, value, _outputs=["attention"])


@dataclasses.dataclass
class Cache:
    """One of K/V: ``present = Concat(past, new, axis=2)``, read through repeat_kv ``n_rep`` times (1: directly)."""

    present: ir.Value
    past: ir.Value
    new: ir.Value
    n_rep: int


@dataclasses.dataclass
class Sdpa:
    q: ir.Value
    key: Cache
    value: Cache
    mask: ir.Value
    scale: float
    root: ir.Node  # the MatMul with V


def _cache(b: dict, kv: str) -> Cache | str:
    present = b[f"present_{kv}"]
    n_rep = 1
    if b.get(f"{kv}_repeated") is not None:
        reps, target = int_list(b[f"{kv}_reps"]), int_list(b[f"{kv}_shape"])
        if int_list(b[f"{kv}_axes"]) != [2] or reps is None or len(reps) != 5:
            return "K/V is reshaped, but not by repeat_kv (Reshape(Expand(Unsqueeze(cache, [2]), reps)))"
        if reps[:2] != [1, 1] or reps[3:] != [1, 1] or target is None or len(target) != 4 or target[2] != -1:
            return f"repeat_kv's Expand {reps} / Reshape {target} do not repeat whole heads"
        for name in (f"{kv}_unsqueezed", f"{kv}_expanded"):
            if only_consumer(b[name]) is None:
                return f"repeat_kv's {b[name].producer().op_type} output has other uses"
        n_rep = reps[2]
    concat = present.producer()
    if concat.attributes.get_int("axis", 0) not in (2, -2):
        return "K/V is not Concat(past, new) on the sequence axis (a KV cache)"
    return Cache(present, concat.inputs[0], concat.inputs[1], n_rep)


def sdpa(b: dict) -> Sdpa | str:
    """The attention :func:`attention` matched (bindings ``b``), or why it is not one a fusion can take."""
    softmax = b["probs"].producer()
    if not axis_is_last(softmax.attributes.get_int("axis", -1), len(dims(softmax.inputs[0]) or []) or None):
        return "Softmax is not over the last axis"
    if not b["has_mask"]:
        return "no additive mask before the Softmax (causality unknown)"
    scale = 1.0
    if b["scaling"] is not None:
        c = scalar(b["scale"])
        if c is None:
            return "the Softmax input is not (q·K^T) * scale + mask"
        scale = float(c) if b["scaling"] == "Mul" else 1.0 / float(c)
    transpose = b["key_t"].producer()
    if list(transpose.attributes.get_ints("perm", [])) != [0, 1, 3, 2]:
        return "K^T is not Transpose(K, [0, 1, 3, 2])"
    scaled = [b["scores"].producer()] if b["scaling"] is not None else []
    for node in [transpose, b["qk"].producer(), *scaled, b["masked"].producer(), softmax]:
        if only_consumer(node.outputs[0]) is None:
            return f"{node_label(node)} of the attention has other uses"
    key, value = _cache(b, "k"), _cache(b, "v")
    if isinstance(key, str):
        return key
    if isinstance(value, str):
        return value
    if key.n_rep != value.n_rep:
        return f"K and V are repeated differently ({key.n_rep} vs {value.n_rep})"
    return Sdpa(b["q"], key, value, b["mask"], scale, b["attention"].producer())


def shared_key_part(cache: Cache) -> bool:
    """Whether the new K is a last-axis Concat with a part shared by every head (Expand from one head): MLA's
    decoupled RoPE key, ``Concat(k_nope, Expand(k_rope [B, 1, S, r], [1, heads, 1, 1]))``. It tells MLA apart
    where its K and V head sizes happen to be equal."""
    concat = producer(cache.new, "Concat")
    if concat is None or not axis_is_last(concat.attributes.get_int("axis", 0), len(dims(cache.new) or []) or None):
        return False
    return any((expand := producer(part, "Expand")) is not None and static_dim(expand.inputs[0], 1) == 1
               for part in concat.inputs)


def merged(out: ir.Value) -> ir.Node | None:
    """The Reshape merging the attention output to [B, S, heads * Dv] (Reshape(Transpose(out, [0, 2, 1, 3]),
    [0, 0, -1])), if nothing else reads the output on the way."""
    transpose = only_consumer(out)
    if not is_op(transpose, "Transpose") or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    reshape = only_consumer(transpose.outputs[0])
    target = int_list(reshape.inputs[1]) if is_op(reshape, "Reshape") else None
    return reshape if target is not None and len(target) == 3 and target[:2] == [0, 0] else None


def merged_pattern(op, out, merge_shape):
    """Pattern: Reshape(Transpose(out), merge_shape), the merge :func:`merged` checks."""
    return op.Reshape(op.Transpose(out), merge_shape)


class _SplitHeads(pattern.PatternBase):
    """Pattern: Transpose(Reshape(x3, shape), [0, 2, 1, 3]), [B, S, heads * D] split to [B, heads, S, D]."""

    def pattern(self, op, x3, shape):
        return op.Transpose(op.Reshape(x3, shape, _outputs=["split"]), perm=[0, 2, 1, 3])


class _RotatedHeads(pattern.PatternBase):
    """Pattern: a 4-D RotaryEmbedding of split heads."""

    def pattern(self, op, x3, shape, position_ids, cos_cache, sin_cache):
        heads = op.Transpose(op.Reshape(x3, shape, _outputs=["split"]), perm=[0, 2, 1, 3])
        return op.RotaryEmbedding(heads, position_ids, cos_cache, sin_cache, _domain=MS_DOMAIN, _outputs=["rope"])


_SPLIT_HEADS, _ROTATED_HEADS = _SplitHeads(), _RotatedHeads()


@dataclasses.dataclass
class To3d:
    """How the [B, S, heads * head_dim] form of a [B, heads, S, head_dim] value ``x4`` is had: ``x3`` directly,
    a 3-D RotaryEmbedding of ``x3`` in place of the 4-D ``rope``, or (``x3`` None) Transpose + Reshape of x4."""

    x4: ir.Value
    heads: int
    head_dim: int
    x3: ir.Value | None = None
    rope: ir.Node | None = None
    nodes: tuple[ir.Node, ...] = ()  # that may be dead afterwards


def _head_split(shape: ir.Value, heads: int, head_dim: int) -> bool:
    target = int_list(shape)
    return target is not None and len(target) == 4 and target[:2] == [0, 0] and target[2:] in (
        [heads, head_dim], [heads, -1], [-1, head_dim])


def plan_3d(context, x4: ir.Value, heads: int, head_dim: int) -> To3d:
    """How :func:`to_3d` gets x4 to 3-D: undoing the head split when x4 was made by one (also through a 4-D
    RotaryEmbedding with a full, non-interleaved rotation, which becomes a 3-D one with ``num_heads``)."""
    node = x4.producer()
    if node is None:
        return To3d(x4, heads, head_dim)
    model, graph = context.model, context.graph_or_function
    split = _SPLIT_HEADS.match(model, graph, node, check_nodes_are_removable=False)
    if split and _head_split(split.bindings["shape"], heads, head_dim):
        return To3d(x4, heads, head_dim, split.bindings["x3"], nodes=tuple(split.nodes))
    rope = _ROTATED_HEADS.match(model, graph, node, check_nodes_are_removable=False)
    if rope and only_consumer(x4) is not None and _head_split(rope.bindings["shape"], heads, head_dim):
        attrs = node.attributes
        if attrs.get_int("interleaved", 0) == 0 and attrs.get_int("rotary_embedding_dim", 0) in (0, head_dim):
            return To3d(x4, heads, head_dim, rope.bindings["x3"], node, tuple(rope.nodes))
    return To3d(x4, heads, head_dim)


def to_3d(emit, plan: To3d) -> ir.Value:
    """The [B, S, heads * head_dim] value :func:`plan_3d` planned."""
    if plan.x3 is not None:
        if plan.rope is None:
            return plan.x3
        rope3 = emit.node("RotaryEmbedding", [plan.x3, *plan.rope.inputs[1:]],
                          {"interleaved": 0, "num_heads": plan.heads}, domain=MS_DOMAIN).outputs[0]
        rope3.dtype, rope3.shape = plan.x3.dtype, plan.x3.shape
        return rope3
    x4 = plan.x4
    transposed = emit.op("Transpose", x4, perm=[0, 2, 1, 3])
    x3 = emit.op("Reshape", transposed, emit.const([0, 0, plan.heads * plan.head_dim]))
    d = dims(x4)
    x3.dtype = x4.dtype
    if d is not None and len(d) == 4:
        x3.shape = ir.Shape([d[0], d[2], plan.heads * plan.head_dim])
    return x3


def take_over_caches(edit, sdpa: Sdpa, present_k: ir.Value, present_v: ir.Value) -> None:
    """A fused op's present outputs take the place of the cache Concats' (their types and shapes, and graph
    output names), after the sweep."""
    for new, old in ((present_k, sdpa.key.present), (present_v, sdpa.value.present)):
        set_dtype(new, old.dtype)
        new.shape = old.shape
        edit.replace(old, new)
