"""DeepSeek-V4's attention: shared K=V MQA over a sliding window, plus the compressed entries of HCA (every
``compress_rate`` tokens pooled into one) or CSA (overlapping windows of 2 x rate, of which the lightning indexer
keeps ``index_topk`` per query).

The cache holds what grows by one entry per token (graph interface, toolchain/interface/graph.py), per layer:

* ``key`` [B, 1, T, head_dim]: each token's K=V after kv_norm and RoPE (the sliding window is a mask over it);
* ``compressor_kv`` / ``compressor_gate`` [B, 1, T, w]: each token's compressor projections (w = head_dim for
  HCA, 2 x head_dim for CSA's two series), before position bias;
* CSA only, ``indexer_kv`` / ``indexer_gate`` [B, 1, T, 2 x index_head_dim]: the indexer compressor's.

That is the ``per-token`` layout. At every step its graph pools every complete window from these (transformers'
DeepseekV4HCACache and CSACache hold exactly those pooled entries, emitted as windows complete), so it is exact by
construction whatever the prefill / decode split; the cost is that each step re-pools T / rate windows. Windows
are over each row's positions: a left-padded row's padding is skipped, so a row in a batch gets its answer alone
(both layouts). transformers 5.24 counts cache slots instead, pooling padding into a padded row's entries; the
reference runs such a batch row by row (DeepseekV4Architecture.reference_row_by_row).

The ``compressed`` layout (``export.v4_cache: compressed``; ``compressed_entries``) holds what V4's design holds
(each tensor's length rule in the graph's metadata, toolchain/interface/graph.py CACHE_LENGTHS), per layer:

* ``key`` [B, 1, min(T, sliding_window - 1), head_dim]: a shifted buffer of the last slots' K=V (window);
* ``compressed`` [B, 1, T // rate, head_dim]: the pooled entries (pooled); CSA also ``indexer_compressed``
  [B, 1, T // rate, index_head_dim], the indexer's keys;
* ``compressor_kv`` / ``compressor_gate`` (CSA also ``indexer_kv`` / ``indexer_gate``) [B, 1, R, w]: the tail,
  the projections of a row's positions [base, base + R) with base its incomplete window's first position (R = rate)
  or, where windows overlap (CSA), the window's before it (R = 2 x rate), so that it holds the previous window's
  first series too. Empty before the first step (the graph pads it), R entries after.

T is the attention mask's length (slots, padding included). Rows of a left-padded batch complete windows at
different steps, so the pooled tensor has a fixed capacity per slot count, T // rate, at least every row's count of
complete windows; a row's entry w pools its own positions [w rate, (w + 1) rate), is written (ScatterND) at the
step its window completes, and is masked from every query before that (after_threshold), so the zeros a row's
later entries hold until then are never read. A step gathers, per row, the tail and its new tokens into one run of
positions from base, pools the windows that complete in it, and keeps the run's last R positions from the new
base as the tail. Decode reads the pooled entries instead of re-pooling them.

transformers' interleaved RoPE on the trailing rope dims of each head is turned into the rotate-half form by
reordering those channels in every weight that produces or consumes them (``channel_order``): projections'
rows, norms' weights, position biases' columns and the output projection's input columns. RMSNorm, softmax
pooling and dot products do not depend on the order of channels, so the values are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir
import torch

from toolchain.export import blocks
from toolchain.export.graph import GraphBuilder
from toolchain.export.weights import LazyArray
from toolchain.interface.graph import POOLED, TAIL, WINDOW

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64


def cache_widths(config, layer_type: str, compressed_cache: bool = False) -> dict[str, int]:
    """Cache tensor name -> its width (last axis) for one layer of ``layer_type``; ``compressed_cache``: the
    compressed layout's, with the pooled entries (module docstring)."""
    widths = {"key": config.head_dim}
    if layer_type == HCA:
        widths |= {"compressor_kv": config.head_dim, "compressor_gate": config.head_dim}
        widths |= {"compressed": config.head_dim} if compressed_cache else {}
    elif layer_type == CSA:
        widths |= {"compressor_kv": 2 * config.head_dim, "compressor_gate": 2 * config.head_dim,
                   "indexer_kv": 2 * config.index_head_dim, "indexer_gate": 2 * config.index_head_dim}
        widths |= {"compressed": config.head_dim, "indexer_compressed": config.index_head_dim} \
            if compressed_cache else {}
    return widths


def cache_lengths(config, layer_type: str) -> dict[str, tuple[str, int]]:
    """The compressed layout's length rule (toolchain/interface/graph.py cache_length) of each of a layer's cache
    tensors."""
    rules = {"key": (WINDOW, config.sliding_window - 1)}
    if layer_type in (HCA, CSA):
        rate = config.compress_rates[layer_type]
        tail = (TAIL, 2 * rate if layer_type == CSA else rate)
        rules |= {"compressor_kv": tail, "compressor_gate": tail, "compressed": (POOLED, rate)}
        if layer_type == CSA:
            rules |= {"indexer_kv": tail, "indexer_gate": tail, "indexer_compressed": (POOLED, rate)}
    return rules


@dataclass
class Rope:
    """cos and sin [B, 1, S, rope_dim] at the step's positions, and the rotary's inv_freq (for pooled entries)."""

    cos: ir.Value
    sin: ir.Value
    inv_freq: np.ndarray
    scaling: float


@dataclass
class StepInputs:
    """What every layer's attention shares: the step's masks and positions, both rotaries, the graph inputs."""

    rope: dict[str, Rope]  # "main" (sliding layers) and "compress" (CSA / HCA layers and their compressors)
    sliding_mask: ir.Value  # [B, 1, S, T] additive
    position_ids: ir.Value  # [B, S]
    first_slot: ir.Value  # [B, 1] int64: the cache slot of each row's position 0 (after its left padding)
    past: dict[str, ir.Value]  # this layer's cache inputs by name
    rows: RowCounts | None = None  # the compressed layout's; None: per-token state


@dataclass
class RowCounts:
    """The compressed layout's per-row counts ([B, 1] int64) and the step's slot counts ([1] int64): a row's real
    positions before the step and after it (its padding not counted), the step's length S and the mask's T."""

    past: ir.Value
    total: ir.Value
    step: ir.Value
    slots: ir.Value


def channel_order(dim: int, rope_dim: int) -> np.ndarray:
    """Channels of one head [nope | rope] with the interleaved rope pairs de-interleaved (rotate-half form)."""
    return np.concatenate([np.arange(dim - rope_dim), dim - rope_dim + blocks.deinterleave_rows(rope_dim)])


def rope_dim_of(module) -> int:
    """The rope channels of a compressor's or indexer's entries (its rotary's config: qk_rope_head_dim)."""
    return module.rotary_emb.config.qk_rope_head_dim


def per_head(order: np.ndarray, heads: int) -> np.ndarray:
    return np.concatenate([h * len(order) + order for h in range(heads)])


def derived(array, shape: tuple[int, ...], fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` of a weight (numpy, or a LazyArray applied when it is written), of the resulting ``shape``."""
    if isinstance(array, LazyArray):
        read = array.read
        assert read is not None and array.rows is None and not array.transposed
        return replace(array, shape=shape, read=lambda: fn(read()).contiguous())
    return np.ascontiguousarray(fn(torch.from_numpy(np.asarray(array))).numpy())


def columns(g: GraphBuilder, t: torch.Tensor, order: np.ndarray):
    """A small tensor (norm weight [C], position bias [rate, C]) with its last axis reordered."""
    array = g.params.array(t)
    index = torch.from_numpy(order)
    return derived(array, tuple(array.shape), lambda x: x.index_select(-1, index))


def rms_norm(g: GraphBuilder, x: ir.Value, weight, eps: float, name: str) -> ir.Value:
    """transformers' DeepseekV4RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)); weight None: the unweighted one."""
    with g.scope(name):
        var = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1]), keepdims=1)
        normed = g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(eps, np.float32)))))
        return normed if weight is None else g.op("Mul", g.weight("weight", weight), normed)


def rope_at(g: GraphBuilder, positions: ir.Value, rope: Rope) -> tuple[ir.Value, ir.Value]:
    """cos, sin [..., rope_dim] at float positions of any shape."""
    freqs = g.op("Mul", g.op("Unsqueeze", positions, g.const([-1])), g.const(rope.inv_freq, np.float32))
    emb = g.op("Concat", freqs, freqs, axis=-1)
    cos, sin = g.op("Cos", emb), g.op("Sin", emb)
    if rope.scaling != 1.0:
        cos, sin = (g.op("Mul", t, g.const(rope.scaling, np.float32)) for t in (cos, sin))
    return cos, sin


def partial_rope(g: GraphBuilder, x: ir.Value, cos: ir.Value, sin: ir.Value, dim: int, rope_dim: int) -> ir.Value:
    """RoPE (rotate-half form) on the trailing rope_dim channels of x [..., dim]."""
    nope, rot = g.op("Split", x, g.const([dim - rope_dim, rope_dim]), axis=-1, outputs=2)
    return g.op("Concat", nope, blocks.apply_rope(g, rot, cos, sin), axis=-1)


def grow(g: GraphBuilder, past: ir.Value, new: ir.Value) -> ir.Value:
    """The cache tensor with this step's tokens appended: new [B, S, w] -> [B, 1, T, w]."""
    return g.op("Concat", past, g.op("Unsqueeze", new, g.const([1])), axis=2)


def attention(g: GraphBuilder, attn, h: ir.Value, step: StepInputs) -> tuple[ir.Value, dict[str, ir.Value]]:
    """One layer's attention output [B, S, hidden] and its cache outputs by name."""
    config = attn.config
    heads, dim, rope_dim = attn.num_heads, attn.head_dim, config.qk_rope_head_dim
    order = channel_order(dim, rope_dim)
    rope = step.rope[attn.rope_layer_type]

    q_residual = rms_norm(g, blocks.linear(g, h, attn.q_a_proj, "q_a_proj"), g.params.array(attn.q_a_norm.weight),
                          attn.q_a_norm.variance_epsilon, "q_a_norm")
    q = blocks.heads(g, blocks.linear(g, q_residual, attn.q_b_proj, "q_b_proj", rows=per_head(order, heads)),
                     heads, dim)
    q = partial_rope(g, rms_norm(g, q, None, attn.q_b_norm.eps, "q_b_norm"), rope.cos, rope.sin, dim, rope_dim)
    kv = rms_norm(g, blocks.linear(g, h, attn.kv_proj, "kv_proj", rows=order), columns(g, attn.kv_norm.weight, order),
                  attn.kv_norm.variance_epsilon, "kv_norm")
    key = partial_rope(g, g.op("Unsqueeze", kv, g.const([1])), rope.cos, rope.sin, dim, rope_dim)
    key = g.op("Concat", step.past["key"], key, axis=2)  # [B, 1, T, dim]; compressed: the window's slots + S
    # the compressed layout keeps the last sliding_window - 1 slots, what the next step's first query reaches back to
    presents = {"key": key if step.rows is None else
                g.op("Slice", key, g.const([1 - config.sliding_window]), g.const([np.iinfo(np.int64).max]),
                     g.const([2]))}
    keys, mask = key, step.sliding_mask
    if attn.compressor is not None:
        with g.scope("compressor"):
            pool_fn = compressed if step.rows is None else compressed_entries
            pooled, bias, compressor_presents = pool_fn(g, attn.compressor, attn.layer_type, h, q_residual, step)
        presents |= compressor_presents
        keys = g.op("Concat", key, pooled, axis=2)
        mask = g.op("Concat", mask, bias, axis=-1)
    out = sink_attention(g, q, keys, mask, g.params.array(attn.sinks), attn.scaling, heads)
    # K = V carries RoPE on its rope channels: the conjugate rotation at the query's position takes it off
    out = partial_rope(g, out, rope.cos, g.op("Neg", rope.sin), dim, rope_dim)
    out = g.op("Transpose", out, perm=[0, 2, 1, 3])  # [B, S, H, dim]
    return output_projection(g, attn, out, order), presents


def sink_attention(g: GraphBuilder, q, keys, mask, sinks, scale: float, heads: int) -> ir.Value:
    """softmax over [q k^T * scale + mask, sink] without the sink's column, times the keys (K = V): q [B, H, S, d],
    keys [B, 1, T, d], mask [B, 1, S, T] -> [B, H, S, d]."""
    with g.scope("sdpa"):
        scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2])), g.const(scale, np.float32))
        scores = g.op("Add", scores, mask)
        lead = g.op("Slice", g.op("Shape", scores), g.const([0]), g.const([3]))
        sink = g.op("Expand", g.op("Reshape", g.weight("sinks", sinks), g.const([1, heads, 1, 1])),
                    g.op("Concat", lead, g.const([1]), axis=0))
        probs = g.op("Softmax", g.op("Concat", scores, sink, axis=-1), axis=-1)
        probs = g.op("Slice", probs, g.const([0]), g.const([-1]), g.const([-1]))
        return g.op("MatMul", probs, keys)


def output_projection(g: GraphBuilder, attn, out: ir.Value, order: np.ndarray) -> ir.Value:
    """The grouped output projection: each of o_groups groups of heads [heads/groups * dim] through its own block
    of o_a_proj to o_lora_rank, then o_b_proj over the groups' concatenation. out: [B, S, H, dim]."""
    config = attn.config
    groups, rank = config.o_groups, config.o_lora_rank
    per_group = attn.num_heads * attn.head_dim // groups
    index = torch.from_numpy(per_head(order, attn.num_heads // groups))
    # [groups * rank, per_group] -> [groups, per_group, rank] with the input columns in the graph's channel order
    w_a = derived(g.params.array(attn.o_a_proj.weight), (groups, per_group, rank),
                  lambda w: w.index_select(1, index).reshape(groups, rank, per_group).transpose(1, 2))
    grouped = g.op("Reshape", out, g.const([0, 0, groups, 1, per_group]))
    with g.scope("o_a_proj"):
        mixed = g.op("MatMul", grouped, g.weight("weight", w_a))  # [B, S, groups, 1, rank]
    mixed = g.op("Reshape", mixed, g.const([0, 0, groups * rank]))
    return blocks.linear(g, mixed, attn.o_b_proj, "o_b_proj")


def compressed(g: GraphBuilder, compressor, layer_type: str, h, q_residual, step: StepInputs):
    """The pooled entries [B, 1, n, dim] of every complete window in the cache, their additive bias per query
    [B, 1, S, n] (causality, and for CSA the indexer's choice), and the compressor's cache outputs."""
    overlap = layer_type == CSA
    rope = step.rope[compressor.rope_layer_type]
    kv_all, gate_all, presents = projections(g, compressor, h, step, "compressor", overlap)
    count = entries(g, kv_all, compressor.compress_rate)
    pooled = g.op("Unsqueeze", pool(g, compressor, kv_all, gate_all, count, rope, overlap, step), g.const([1]))
    future = after_threshold(g, step.position_ids, count, compressor.compress_rate)
    if overlap:
        with g.scope("indexer"):
            allowed, indexer_presents = indexer(g, compressor.indexer, h, q_residual, step, future, count)
        presents |= indexer_presents
    else:
        allowed = g.op("Not", future)
    bias = g.op("Where", allowed, g.const(0.0, np.float32), g.const(blocks.MASK_MIN, np.float32))
    return pooled, g.op("Unsqueeze", bias, g.const([1])), presents


def projections(g: GraphBuilder, module, h, step: StepInputs, name: str, overlap: bool):
    """A compressor's per-token kv and gate projections appended to its cache: ([B, 1, T, w] twice, presents)."""
    order = channel_order(module.head_dim, rope_dim_of(module))
    rows = np.concatenate([order, module.head_dim + order]) if overlap else order
    kv = grow(g, step.past[f"{name}_kv"], blocks.linear(g, h, module.kv_proj, "kv_proj", rows=rows))
    gate = grow(g, step.past[f"{name}_gate"], blocks.linear(g, h, module.gate_proj, "gate_proj", rows=rows))
    return kv, gate, {f"{name}_kv": kv, f"{name}_gate": gate}


def entries(g: GraphBuilder, cached: ir.Value, rate: int) -> ir.Value:
    """[1] int64: the complete windows of ``rate`` slots in a cache tensor [B, 1, T, w]."""
    return g.op("Div", g.op("Shape", cached, start=2, end=3), g.const([rate]))


def pool(g: GraphBuilder, module, kv_all, gate_all, count, rope: Rope, overlap: bool, step: StepInputs) -> ir.Value:
    """[B, n, dim]: each window's tokens softmax-pooled over the window with the position bias, normalized, with
    RoPE at the window's first slot. With ``overlap`` (CSA) entry w pools window w-1's first series with window
    w's second (2 x rate slots); entry 0 has only the second."""
    rate, dim = module.compress_rate, module.head_dim
    order = channel_order(dim, rope_dim_of(module))
    width = 2 * dim if overlap else dim
    batch = g.op("Shape", kv_all, start=0, end=1)
    windows = g.op("Concat", batch, count, g.const([rate, width]), axis=0)
    # a row's token at position p sits in slot first_slot + p (left padding before it); slots past the row's last
    # token only fill entries its queries cannot see yet (after_threshold)
    positions = g.op("Range", g.const(0), g.op("Squeeze", g.op("Mul", count, g.const([rate])), g.const([0])),
                     g.const(1))
    last = g.op("Sub", g.op("Shape", kv_all, start=2, end=3), g.const([1]))
    slots = g.op("Unsqueeze", g.op("Min", g.op("Add", step.first_slot, positions), last), g.const([-1]))
    # allowzero: no complete window yet is n = 0 windows, not "copy that axis"
    kv, gate = (g.op("Reshape", g.op("GatherND", g.op("Squeeze", t, g.const([1])), slots, batch_dims=1), windows,
                     allowzero=1) for t in (kv_all, gate_all))
    bias_order = np.concatenate([order, dim + order]) if overlap else order
    gate = g.op("Add", gate, g.weight("position_bias", columns(g, module.position_bias, bias_order)))
    if overlap:
        first_kv, second_kv = g.op("Split", kv, g.const([dim, dim]), axis=-1, outputs=2)
        first_gate, second_gate = g.op("Split", gate, g.const([dim, dim]), axis=-1, outputs=2)
        before = g.op("Concat", batch, g.const([1, rate, dim]), axis=0)  # the window before the first

        def shifted(t, fill: float):
            start = g.op("ConstantOfShape", before, value=ir.tensor(np.array([fill], np.float32)))
            return g.op("Slice", g.op("Concat", start, t, axis=1), g.const([0]), count, g.const([1]))

        kv = g.op("Concat", shifted(first_kv, 0.0), second_kv, axis=2)
        gate = g.op("Concat", shifted(first_gate, blocks.MASK_MIN), second_gate, axis=2)
    pooled = g.op("ReduceSum", g.op("Mul", kv, g.op("Softmax", gate, axis=2)), g.const([2]), keepdims=0)
    pooled = rms_norm(g, pooled, columns(g, module.kv_norm.weight, order), module.kv_norm.variance_epsilon, "kv_norm")
    first_slots = g.op("Mul", g.op("Range", g.const(0), g.op("Squeeze", count, g.const([0])), g.const(1)),
                       g.const(rate))
    cos, sin = rope_at(g, g.op("Cast", first_slots, to=FLOAT), rope)
    return partial_rope(g, pooled, cos, sin, dim, rope_dim_of(module))


def after_threshold(g: GraphBuilder, position_ids: ir.Value, count: ir.Value, rate: int) -> ir.Value:
    """[B, S, n] bool: pooled entry w is not yet visible to the query at position p (w >= (p + 1) // rate)."""
    threshold = g.op("Div", g.op("Add", position_ids, g.const(1)), g.const(rate))
    index = g.op("Range", g.const(0), g.op("Squeeze", count, g.const([0])), g.const(1))
    return g.op("GreaterOrEqual", index, g.op("Unsqueeze", threshold, g.const([-1])))


def indexer(g: GraphBuilder, module, h, q_residual, step: StepInputs, future, count):
    """CSA's lightning indexer: [B, S, n] bool, the index_topk pooled entries each query attends to (fewer when
    fewer are visible), and the indexer's cache outputs."""
    rope = step.rope[module.rope_layer_type]
    kv_all, gate_all, presents = projections(g, module, h, step, "indexer", True)
    keys = pool(g, module, kv_all, gate_all, count, rope, True, step)  # [B, n, dim]
    return indexer_choice(g, module, h, q_residual, step, future, count, keys), presents


def indexer_choice(g: GraphBuilder, module, h, q_residual, step: StepInputs, future, count, keys) -> ir.Value:
    """[B, S, n] bool: the index_topk of the indexer's pooled keys [B, n, dim] each query attends to (fewer when
    fewer are visible)."""
    heads, dim, rope_dim = module.num_heads, module.head_dim, rope_dim_of(module)
    rope = step.rope[module.rope_layer_type]
    order = channel_order(dim, rope_dim)
    q = blocks.heads(g, blocks.linear(g, q_residual, module.q_b_proj, "q_b_proj", rows=per_head(order, heads)),
                     heads, dim)
    q = g.op("Transpose", partial_rope(g, q, rope.cos, rope.sin, dim, rope_dim), perm=[0, 2, 1, 3])  # [B, S, H, d]
    scorer = module.scorer
    with g.scope("scorer"):
        scores = g.op("MatMul", q, g.op("Unsqueeze", g.op("Transpose", keys, perm=[0, 2, 1]), g.const([1])))
        scores = g.op("Mul", g.op("Relu", scores), g.const(scorer.softmax_scale, np.float32))  # [B, S, H, n]
        weights = g.op("Mul", blocks.linear(g, h, scorer.weights_proj, "weights_proj"),
                       g.const(scorer.weights_scaling, np.float32))
        scores = g.op("ReduceSum", g.op("Mul", scores, g.op("Unsqueeze", weights, g.const([-1]))), g.const([2]),
                      keepdims=0)  # [B, S, n]
    floor = g.const(blocks.MASK_MIN, np.float32)
    scores = g.op("Where", future, floor, scores)
    # one more entry that no query may see, so that TopK has k >= 1 before the first window completes
    extra = g.op("ConstantOfShape", g.op("Concat", g.op("Shape", scores, start=0, end=2), g.const([1]), axis=0),
                 value=ir.tensor(np.array([blocks.MASK_MIN], np.float32)))
    scores = g.op("Concat", scores, extra, axis=-1)
    k = g.op("Max", g.op("Min", count, g.const([module.index_topk])), g.const([1]))
    _, picked = g.op("TopK", scores, k, axis=-1, outputs=2)
    ones = g.op("ConstantOfShape", g.op("Shape", picked), value=ir.tensor(np.ones(1, np.float32)))
    zeros = g.op("ConstantOfShape", g.op("Shape", scores), value=ir.tensor(np.zeros(1, np.float32)))
    chosen = g.op("Slice", g.op("ScatterElements", zeros, picked, ones, axis=-1), g.const([0]), count, g.const([-1]))
    return g.op("And", g.op("Cast", chosen, to=ir.DataType.BOOL), g.op("Not", future))


def compressed_entries(g: GraphBuilder, compressor, layer_type: str, h, q_residual, step: StepInputs):
    """``compressed``'s results in the compressed layout: every pooled entry [B, 1, n, dim] (n = T // rate), read
    from the cache with the step's completed windows written in, their bias per query, and the cache outputs."""
    overlap = layer_type == CSA
    rope = step.rope[compressor.rope_layer_type]
    rate = compressor.compress_rate
    assert step.rows is not None
    count = g.op("Div", step.rows.slots, g.const([rate]))
    entries, presents = pooled_cache(g, compressor, h, step, "compressor", "compressed", overlap, rope, count)
    future = after_threshold(g, step.position_ids, count, rate)
    if overlap:
        with g.scope("indexer"):
            module = compressor.indexer
            keys, indexer_presents = pooled_cache(g, module, h, step, "indexer", "indexer_compressed", True,
                                                  step.rope[module.rope_layer_type], count)
            allowed = indexer_choice(g, module, h, q_residual, step, future, count,
                                     g.op("Squeeze", keys, g.const([1])))
        presents |= indexer_presents
    else:
        allowed = g.op("Not", future)
    bias = g.op("Where", allowed, g.const(0.0, np.float32), g.const(blocks.MASK_MIN, np.float32))
    return entries, g.op("Unsqueeze", bias, g.const([1])), presents


def pooled_cache(g: GraphBuilder, module, h, step: StepInputs, name: str, pooled_name: str, overlap: bool,
                 rope: Rope, count: ir.Value) -> tuple[ir.Value, dict[str, ir.Value]]:
    """A compressor's (or the indexer's) pooled entries after the step [B, 1, n, dim] and its cache outputs: the
    tail (``{name}_kv`` / ``_gate``) and the entries (``pooled_name``), the windows completed in this step pooled
    and written at their index."""
    rows = step.rows
    assert rows is not None
    rate, dim = module.compress_rate, module.head_dim
    span = 2 * rate if overlap else rate  # the tail's positions
    order = channel_order(dim, rope_dim_of(module))
    channels = np.concatenate([order, dim + order]) if overlap else order
    new = {kind: blocks.linear(g, h, getattr(module, f"{kind}_proj"), f"{kind}_proj", rows=channels)
           for kind in ("kv", "gate")}  # [B, S, w]
    # the row's window index of its tail's first position (-1 before CSA's first window: a window of no tokens)
    first = g.op("Div", rows.past, g.const(rate))
    if overlap:
        first = g.op("Sub", first, g.const(1))
    base = g.op("Mul", first, g.const(rate))
    # run position i (base + i): the tail's entry i before the row's past count, else its new token at that position
    # (a row's S_b new tokens are the step's last S_b: left padding)
    run = g.op("Range", g.const(0), g.op("Squeeze", g.op("Add", rows.step, g.const([span])), g.const([0])),
               g.const(1))
    position = g.op("Add", base, run)  # [B, span + S]
    new_real = g.op("Sub", rows.total, rows.past)
    from_new = g.op("Add", g.op("Sub", g.op("Add", g.op("Sub", rows.step, new_real), g.const([span])), rows.past),
                    position)
    last = g.op("Add", rows.step, g.const([span - 1]))
    index = g.op("Min", g.op("Where", g.op("Less", position, rows.past), run, from_new), last)
    index = g.op("Unsqueeze", index, g.const([-1]))
    runs = {}
    for kind, value in new.items():
        tail = g.op("Squeeze", step.past[f"{name}_{kind}"], g.const([1]))  # [B, 0 or span, w]
        width = 2 * dim if overlap else dim
        missing = g.op("Concat", g.op("Shape", tail, start=0, end=1),
                       g.op("Sub", g.const([span]), g.op("Shape", tail, start=1, end=2)), g.const([width]), axis=0)
        tail = g.op("Concat", tail, g.op("ConstantOfShape", missing, value=ir.tensor(np.zeros(1, np.float32))),
                    axis=1)
        runs[kind] = g.op("GatherND", g.op("Concat", tail, value, axis=1), index, batch_dims=1)  # [B, span + S, w]
    # the next tail: the run from the row's next base on (positions past its last real one are never read)
    shift = g.op("Mul", g.op("Sub", g.op("Div", rows.total, g.const(rate)), g.op("Div", rows.past, g.const(rate))),
                 g.const(rate))
    kept = g.op("Unsqueeze", g.op("Min", g.op("Add", shift, g.const(np.arange(span, dtype=np.int64))), last),
                g.const([-1]))
    presents = {f"{name}_{kind}": g.op("Unsqueeze", g.op("GatherND", run_, kept, batch_dims=1), g.const([1]))
                for kind, run_ in runs.items()}
    # the run's windows [B, K, rate, w], K = (span + S) // rate; candidate j pools the row's window first + j + 1
    # (CSA: with window first + j's first series) or first + j (HCA)
    windows = g.op("Div", g.op("Add", rows.step, g.const([span])), g.const([rate]))
    shape = g.op("Concat", g.const([0]), windows, g.const([rate, -1]), axis=0)
    kv, gate = (g.op("Reshape", g.op("Slice", run_, g.const([0]), g.op("Mul", windows, g.const([rate])),
                                     g.const([1])), shape) for run_ in (runs["kv"], runs["gate"]))
    gate = g.op("Add", gate, g.weight("position_bias", columns(g, module.position_bias, channels)))
    candidates = g.op("Sub", windows, g.const([1 if overlap else 0]))
    window = g.op("Add", g.op("Div", rows.past, g.const(rate)),
                  g.op("Range", g.const(0), g.op("Squeeze", candidates, g.const([0])), g.const(1)))  # [B, J]
    if overlap:
        first_kv, second_kv = g.op("Split", kv, g.const([dim, dim]), axis=-1, outputs=2)
        first_gate, second_gate = g.op("Split", gate, g.const([dim, dim]), axis=-1, outputs=2)
        end = g.const([np.iinfo(np.int64).max])
        # window -1 has no tokens: its first series weighs nothing
        before_start = g.op("Unsqueeze", g.op("Less", window, g.const(1)), g.const([-1, -2]))
        earlier_gate = g.op("Where", before_start, g.const(blocks.MASK_MIN, np.float32),
                            g.op("Slice", first_gate, g.const([0]), g.const([-1]), g.const([1])))
        kv = g.op("Concat", g.op("Slice", first_kv, g.const([0]), g.const([-1]), g.const([1])),
                  g.op("Slice", second_kv, g.const([1]), end, g.const([1])), axis=2)
        gate = g.op("Concat", earlier_gate, g.op("Slice", second_gate, g.const([1]), end, g.const([1])), axis=2)
    pooled = g.op("ReduceSum", g.op("Mul", kv, g.op("Softmax", gate, axis=2)), g.const([2]), keepdims=0)
    pooled = rms_norm(g, pooled, columns(g, module.kv_norm.weight, order), module.kv_norm.variance_epsilon, "kv_norm")
    cos, sin = rope_at(g, g.op("Cast", g.op("Mul", window, g.const(rate)), to=FLOAT), rope)
    pooled = partial_rope(g, pooled, cos, sin, dim, rope_dim_of(module))  # [B, J, dim]
    # written at its window's index where complete, else at a slot of its own past the n entries, cut off after
    done = g.op("Less", window, g.op("Div", rows.total, g.const(rate)))
    aside = g.op("Add", count, g.op("Range", g.const(0), g.op("Squeeze", candidates, g.const([0])), g.const(1)))
    target = g.op("Where", done, window, g.op("Unsqueeze", aside, g.const([0])))
    batch = g.op("Shape", target, start=0, end=1)
    row = g.op("Expand", g.op("Unsqueeze", g.op("Range", g.const(0), g.op("Squeeze", batch, g.const([0])),
                                                  g.const(1)), g.const([1])), g.op("Shape", target))
    past = g.op("Squeeze", step.past[pooled_name], g.const([1]))  # [B, n_past, dim]
    grown = g.op("Concat", batch, g.op("Sub", g.op("Add", count, candidates), g.op("Shape", past, start=1, end=2)),
                 g.const([dim]), axis=0)
    buffer = g.op("Concat", past, g.op("ConstantOfShape", grown, value=ir.tensor(np.zeros(1, np.float32))), axis=1)
    scatter = g.op("Concat", g.op("Unsqueeze", row, g.const([-1])), g.op("Unsqueeze", target, g.const([-1])), axis=-1)
    entries = g.op("Slice", g.op("ScatterND", buffer, scatter, pooled), g.const([0]), count, g.const([1]))
    entries = g.op("Unsqueeze", entries, g.const([1]))
    return entries, presents | {pooled_name: entries}
