"""Matching scaled dot-product attention over a concatenated KV cache, as dstc's ``blocks.sdpa`` writes it::

    present_k = Concat(past_k, k, axis=2); present_v = Concat(past_v, v, axis=2)      # [B, kv_heads, T, D]
    K = repeat_kv(present_k)        # optional: Reshape(Expand(Unsqueeze(_, [2]), [1,1,n,1,1]), [0, heads, -1, D])
    out = MatMul(Softmax(Add(Mul(MatMul(q, Transpose(K, [0,1,3,2])), scale), mask)), V)   # [B, heads, S, Dv]
    out3 = Reshape(Transpose(out, [0,2,1,3]), [0, 0, -1])                                # optional, [B, S, hidden]

plus the helpers the fusions share: where the result goes, the [B, S, hidden] form of a [B, heads, S, D] input.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from passes.base import node_label
from passes.fusions._common import (
    MS_DOMAIN, Emitter, axis_is_last, dims, int_list, is_op, only_consumer, producer, scalar, static_dim,
)
from passes.graph import bypass


@dataclasses.dataclass
class Cache:
    """One of K/V: ``present = Concat(past, new, axis=2)``, read through repeat_kv ``n_rep`` times (1: directly)."""

    present: ir.Value
    past: ir.Value
    new: ir.Value
    n_rep: int
    nodes: list[ir.Node]  # Concat and the repeat_kv nodes


@dataclasses.dataclass
class Sdpa:
    q: ir.Value
    key: Cache
    value: Cache
    mask: ir.Value
    scale: float
    root: ir.Node  # the MatMul with V
    nodes: list[ir.Node]


def _scaled_scores(value: ir.Value) -> tuple[ir.Node, float, list[ir.Node]] | None:
    """(MatMul q·K^T, scale, scale nodes) for value = MatMul * c, MatMul / c or the MatMul itself."""
    node = value.producer()
    if is_op(node, "MatMul"):
        return node, 1.0, []
    if is_op(node, "Mul") or is_op(node, "Div"):
        for i, operand in enumerate(node.inputs):
            c = scalar(operand)
            qk = producer(node.inputs[1 - i], "MatMul")
            if c is None or qk is None or (node.op_type == "Div" and i == 0):
                continue
            return qk, (float(c) if node.op_type == "Mul" else 1.0 / float(c)), [node]
    return None


def _cache(value: ir.Value) -> Cache | str:
    nodes: list[ir.Node] = []
    n_rep = 1
    reshape = producer(value, "Reshape")
    if reshape is not None:
        expand = producer(reshape.inputs[0], "Expand")
        unsqueeze = producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
        target = int_list(reshape.inputs[1])
        reps = int_list(expand.inputs[1]) if expand is not None else None
        if unsqueeze is None or int_list(unsqueeze.inputs[1]) != [2] or reps is None or len(reps) != 5:
            return "K/V is reshaped, but not by repeat_kv (Reshape(Expand(Unsqueeze(cache, [2]), reps)))"
        if reps[:2] != [1, 1] or reps[3:] != [1, 1] or target is None or len(target) != 4 or target[2] != -1:
            return f"repeat_kv's Expand {reps} / Reshape {target} do not repeat whole heads"
        for node in (unsqueeze, expand):
            if only_consumer(node.outputs[0]) is None:
                return f"repeat_kv's {node.op_type} output has other uses"
        n_rep, nodes, value = reps[2], [reshape, expand, unsqueeze], unsqueeze.inputs[0]
    concat = producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (2, -2):
        return "K/V is not Concat(past, new) on the sequence axis (a KV cache)"
    return Cache(value, concat.inputs[0], concat.inputs[1], n_rep, [*nodes, concat])


def match_sdpa(matmul: ir.Node) -> Sdpa | str | None:
    """The attention pattern ending in ``matmul`` (probs · V); its mismatch reason, or None if ``matmul`` does not
    read a Softmax (not a candidate)."""
    if not is_op(matmul, "MatMul"):
        return None
    softmax = producer(matmul.inputs[0], "Softmax")
    if softmax is None:
        return None
    if not axis_is_last(softmax.attributes.get_int("axis", -1), len(dims(softmax.inputs[0]) or []) or None):
        return "Softmax is not over the last axis"
    add = producer(softmax.inputs[0], "Add")
    if add is None:
        return "no additive mask before the Softmax (causality unknown)"
    for i in (0, 1):
        scored = _scaled_scores(add.inputs[i])
        if scored is not None:
            break
    else:
        return "the Softmax input is not (q·K^T) * scale + mask"
    qk, scale, scale_nodes = scored
    mask = add.inputs[1 - i]
    transpose = producer(qk.inputs[1], "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != [0, 1, 3, 2]:
        return "K^T is not Transpose(K, [0, 1, 3, 2])"
    inner = [transpose, qk, *scale_nodes, add, softmax]
    for node in inner:
        if only_consumer(node.outputs[0]) is None:
            return f"{node_label(node)} of the attention has other uses"
    key, value = _cache(transpose.inputs[0]), _cache(matmul.inputs[1])
    for cache in (key, value):
        if isinstance(cache, str):
            return cache
    if key.n_rep != value.n_rep:
        return f"K and V are repeated differently ({key.n_rep} vs {value.n_rep})"
    return Sdpa(qk.inputs[0], key, value, mask, scale, matmul, [*inner, matmul])


def shared_key_part(cache: Cache) -> bool:
    """Whether the new K is a last-axis Concat with a part shared by every head (Expand from one head): MLA's
    decoupled RoPE key, ``Concat(k_nope, Expand(k_rope [B, 1, S, r], [1, heads, 1, 1]))``. It tells MLA apart
    where its K and V head sizes happen to be equal."""
    concat = producer(cache.new, "Concat")
    if concat is None or not axis_is_last(concat.attributes.get_int("axis", 0), len(dims(cache.new) or []) or None):
        return False
    return any(producer(part, "Expand") is not None and static_dim(part.producer().inputs[0], 1) == 1
               for part in concat.inputs)


def output_3d(sdpa: Sdpa) -> ir.Value | None:
    """The attention output merged to [B, S, heads * Dv] (Reshape(Transpose(out, [0, 2, 1, 3]), [0, 0, -1])), if
    that is the only use of the [B, heads, S, Dv] result."""
    transpose = only_consumer(sdpa.root.outputs[0])
    if not is_op(transpose, "Transpose") or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    reshape = only_consumer(transpose.outputs[0])
    target = int_list(reshape.inputs[1]) if is_op(reshape, "Reshape") else None
    if target is None or len(target) != 3 or target[:2] != [0, 0]:
        return None
    return reshape.outputs[0]


def take_over_caches(graph: ir.Graph, sdpa: Sdpa, present_k: ir.Value, present_v: ir.Value) -> None:
    """Make a fused op's present outputs replace the cache Concats' (graph output names included)."""
    for new, old in ((present_k, sdpa.key.present), (present_v, sdpa.value.present)):
        new.dtype, new.shape = old.dtype, old.shape
        bypass(graph, old, new)


def split_heads_source(x4: ir.Value, heads: int, head_dim: int) -> tuple[ir.Value, list[ir.Node]] | None:
    """x3 when x4 = Transpose(Reshape(x3, [0, 0, heads, head_dim]), [0, 2, 1, 3])."""
    transpose = producer(x4, "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    reshape = producer(transpose.inputs[0], "Reshape")
    target = int_list(reshape.inputs[1]) if reshape is not None else None
    if target is None or len(target) != 4 or target[:2] != [0, 0] or target[2:] not in ([heads, head_dim],
                                                                                          [heads, -1], [-1, head_dim]):
        return None
    return reshape.inputs[0], [transpose, reshape]


def to_3d(emit: Emitter, anchor: ir.Node, x4: ir.Value, heads: int, head_dim: int) -> tuple[ir.Value, list[ir.Node]]:
    """[B, S, heads * head_dim] for a [B, heads, S, head_dim] value, and the nodes that may become dead.

    Undoes the head split when x4 was made by one (also through a 4-D RotaryEmbedding, which becomes a 3-D one
    with ``num_heads``); otherwise adds Reshape(Transpose(x4, [0, 2, 1, 3]), [0, 0, heads * head_dim]).
    """
    direct = split_heads_source(x4, heads, head_dim)
    if direct is not None:
        return direct
    rope = producer(x4, "RotaryEmbedding", MS_DOMAIN)
    if rope is not None and only_consumer(x4) is not None:
        attrs = rope.attributes
        source = split_heads_source(rope.inputs[0], heads, head_dim)
        full = attrs.get_int("interleaved", 0) == 0 and attrs.get_int("rotary_embedding_dim", 0) in (0, head_dim)
        if source is not None and full:
            x3, nodes = source
            rope3 = emit.node(anchor, "RotaryEmbedding", [x3, *rope.inputs[1:]],
                              {"interleaved": 0, "num_heads": heads}, domain=MS_DOMAIN).outputs[0]
            rope3.dtype, rope3.shape = x3.dtype, x3.shape
            return rope3, [rope, *nodes]
    transposed = emit.op(anchor, "Transpose", x4, perm=[0, 2, 1, 3])
    x3 = emit.op(anchor, "Reshape", transposed, emit.const([0, 0, heads * head_dim]))
    d = dims(x4)
    x3.dtype = x4.dtype
    if d is not None and len(d) == 4:
        x3.shape = ir.Shape([d[0], d[2], heads * head_dim])
    return x3, []
