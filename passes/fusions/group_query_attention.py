"""fuse-group-query-attention: attention over a concatenated KV cache (Llama/Qwen2 GQA, repeat_kv included, or
plain multi-head) -> com.microsoft GroupQueryAttention, which owns the KV cache.

Matched (``passes.fusions._attention``): q [B, H, S, D]; present_k = Concat(past_k, k, axis=2) and present_v
likewise, [B, kvH, T, D]; K/V repeated H/kvH times by repeat_kv; softmax(q K^T * scale + mask) V with the
additive mask [B, 1, S, T]. K and V must share the head size D, a multiple of 8 (ORT 1.32's GQA rejects
others; ``fuse-mla-attention`` takes what is left, MLA in particular). MLA is declined even where its K and V
head sizes are equal (qk_nope + qk_rope == v_head_dim; recognised by its decoupled RoPE key, a K part shared by
every head): its cache has a K/V per head, and with kv heads == heads ORT 1.32's CPU GroupQueryAttention took
twice the time of ONNX Attention (16 heads of 128, decode at past 512 / 2048 and batch 4: 0.94 / 3.3 / 3.4 ms
vs 0.44 / 1.8 / 1.7 ms; a 4-layer MLA model's decode step at past 2048: 31 ms vs 18 ms), with the same
results (logits within 5e-6). With kv heads < heads (Llama/Qwen2) the two measured on par. Replaced by::

    out, present_k, present_v = GroupQueryAttention(q3, k3, v3, past_k, past_v, seqlens_k, total_length,
        attention_bias=mask, query_seqlens=S_per_row, num_heads=H, kv_num_heads=kvH, scale=scale)

* q3, k3, v3 are the [B, S, heads * D] tensors before the head split (a 4-D RotaryEmbedding on the way becomes
  a 3-D one; a q/k/v not made by a head split is merged back with Transpose + Reshape).
* present_k/present_v take over the Concat outputs, graph outputs included, so ``present.N.*`` keep their
  names and stay the whole cache: ORT 1.32 returns [B, kvH, past + S, D] when past_key holds exactly the past
  (no shared buffer), checked by the tests.
* Left padding stays exact by keeping the graph's own mask: every row is treated as having the full length T
  (``seqlens_k`` = T - 1, ``total_sequence_length`` = T, both from the mask's shape, int32), so GQA places the
  new tokens at T - S .. T - 1 as the Concat did, and the mask goes in as ``attention_bias``, which adds the
  padding (and causal) terms to the scores as the Add did; GQA's own causal mask only removes what the mask
  already removes. ``query_seqlens`` = S for every row lifts GQA's rule that a multi-token step with past
  context needs batch 1 (chunked prefill of a batch). Only padding query rows, whose every key is masked, can
  come out differently (the unfused graph averages all keys there, GQA only the causal ones); nothing reads
  them: they are masked as keys for every real token, and excluded from parity.

One rule in two variants: its pattern ends at the merge Reshape (the fused op's 3-D output replaces it) or at
the attention MatMul, which declines when the merged variant applies. The sequence lengths are built once per
mask, by the first rewrite, and shared through the pass's ``GraphEdit``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from passes.fusions._attention import (
    attention,
    merged,
    merged_pattern,
    plan_3d,
    sdpa,
    shared_key_part,
    take_over_caches,
    to_3d,
)
from passes.fusions._common import MS_DOMAIN, dims, static_dim
from passes.graph import set_dtype
from passes.registry import register
from passes.rewrite import FusionRule, RewriteRulesPass


class _GroupQueryAttention(FusionRule):
    """Variants: the pattern ends at the merge to [B, S, hidden] (True) or at the attention (False)."""

    variants = (True, False)

    def pattern(self, op, q, past_k, new_k, past_v, new_v, mask, scale, k_axes, k_reps, k_shape, v_axes, v_reps,
                v_shape, merge_shape):
        out = attention(op, q, past_k, new_k, past_v, new_v, mask, scale, k_axes, k_reps, k_shape, v_axes, v_reps,
                        v_shape)
        return merged_pattern(op, out, merge_shape) if self.variant else out

    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, **b) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        out = b["attention"]
        if context.root is not (merged(out) or out.producer()):  # the other variant fuses it
            return self.decline("the merge to [B, S, hidden] decides the variant")
        is_merged = context.root is not out.producer()
        self.anchor = self.where = out.producer()
        match = sdpa(b)
        if isinstance(match, str):
            return result.fail(match)
        shape = _heads(match)
        if isinstance(shape, str):
            return result.fail(shape)
        heads, kv_heads, head_dim = shape
        plans = [plan_3d(context, x4, n, head_dim)
                 for x4, n in ((match.q, heads), (match.key.new, kv_heads), (match.value.new, kv_heads))]
        self.found = match, shape, plans, is_merged
        return result

    def rewrite(self, op, **_):
        (match, (heads, kv_heads, head_dim), plans, is_merged), emit = self.found, self.emit(op)
        q3, k3, v3 = (to_3d(emit, plan) for plan in plans)
        for plan in plans:
            self.edit.dead += plan.nodes
        key = ("gqa_lengths", match.mask)
        if key not in self.edit.shared:
            self.edit.shared[key] = _lengths(emit, match.mask, q3)
        seqlens_k, total, query_seqlens = self.edit.shared[key]
        inputs = [q3, k3, v3, match.key.past, match.value.past, seqlens_k, total, None, None, None, match.mask,
                  None, None, None, None, None, query_seqlens]
        gqa = emit.node("GroupQueryAttention", inputs,
                        {"num_heads": heads, "kv_num_heads": kv_heads, "scale": match.scale},
                        domain=MS_DOMAIN, num_outputs=3)
        out, present_k, present_v = gqa.outputs
        q_dims = dims(q3)
        set_dtype(out, q3.dtype)
        out.shape = ir.Shape([q_dims[0], q_dims[1], heads * head_dim]) if q_dims else None
        take_over_caches(self.edit, match, present_k, present_v)
        self.counted = ("gqa" if kv_heads < heads else "mha",)
        if not is_merged:  # keep the [B, H, S, D] result the rest of the graph reads
            split = emit.op("Reshape", out, emit.const([0, 0, heads, head_dim]))
            out = emit.op("Transpose", split, perm=[0, 2, 1, 3])
        return out


def _heads(match) -> tuple[int, int, int] | str:
    """(heads, kv_heads, head_dim), checked against what GroupQueryAttention supports."""
    heads, head_dim = static_dim(match.q, 1), static_dim(match.q, 3)
    kv_heads = static_dim(match.key.past, 1) or static_dim(match.key.new, 1)
    dims_kv = {static_dim(v, 3) for v in (match.key.past, match.key.new, match.value.past, match.value.new)}
    if heads is None or head_dim is None or kv_heads is None:
        return "head counts or head size unknown (run infer-shapes first)"
    if dims_kv - {None} != {head_dim}:
        sizes = sorted(d for d in dims_kv if d)
        return f"K/V head sizes {sizes} differ from q's {head_dim} (MLA: fuse-mla-attention)"
    if shared_key_part(match.key):
        return "K has a part shared by every head, MLA's RoPE key (MLA: fuse-mla-attention, faster on ORT)"
    if head_dim % 8:
        return f"head size {head_dim} is not a multiple of 8, which ORT's GroupQueryAttention requires"
    if heads % kv_heads or heads // kv_heads != match.key.n_rep:
        return f"{heads} query heads over {kv_heads} kv heads, but K/V are repeated {match.key.n_rep} times"
    mask = dims(match.mask)
    if mask is not None and (len(mask) != 4 or mask[1] not in (1, heads, None)):
        return f"mask of shape {mask} is not [B, 1 or heads, S, T]"
    return heads, kv_heads, head_dim


def _lengths(emit, mask: ir.Value, q3: ir.Value):
    """seqlens_k = T - 1 and query_seqlens = S for every row, total_sequence_length = T (int32, T from the
    mask's last axis, B and S from q)."""
    int32 = ir.DataType.INT32
    total = emit.op("Gather", emit.op("Shape", mask), emit.const(3), axis=0, name="gqa_lengths/Gather")
    q_shape = emit.op("Shape", q3)
    batch = emit.op("Gather", q_shape, emit.const([0]), axis=0)
    seq = emit.op("Gather", q_shape, emit.const(1), axis=0)
    seqlens_k = emit.op("Cast", emit.op("Expand", emit.op("Sub", total, emit.const(1)), batch), to=int32)
    query_seqlens = emit.op("Cast", emit.op("Expand", seq, batch), to=int32)
    total = emit.op("Cast", total, to=int32)
    return seqlens_k, total, query_seqlens


@register("fuse-group-query-attention", targets=("onnxruntime",),
          description="Attention over a Concat KV cache (GQA repeat_kv or MHA) -> ORT GroupQueryAttention.")
class FuseGroupQueryAttention(RewriteRulesPass):
    """Counts: ``gqa`` (GroupQueryAttention nodes with kv heads < heads), ``mha`` (kv heads == heads)."""

    def __init__(self) -> None:
        super().__init__([_GroupQueryAttention("gqa")])
