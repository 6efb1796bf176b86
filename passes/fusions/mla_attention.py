"""fuse-mla-attention: DeepSeek-V2/V3 MLA attention (K head size qk_nope + qk_rope, V head size v_head_dim, a
per-head KV cache) -> the ONNX ``Attention`` op (opset 23), which ONNX Runtime 1.32 runs with a fused CPU kernel.

Which ONNX Runtime op fits, as found on ORT 1.32 (CPU, fp32; the tests pin each finding):

* ``com.microsoft.GroupQueryAttention`` rejects a value whose hidden size differs from key's ("Input 'value'
  is expected to have same hidden size as key"), and head sizes that are not multiples of 8: no.
* ``com.microsoft.MultiHeadAttention`` with past_key/past_value rejects a past_value whose head size differs
  from K's ("Input 'past_value' dimension 3 should be same as head_size"); with 4-D [B, N, T, D] key/value
  (the whole cache, no past inputs) key and value must have the same shape. It accepts different K/V hidden
  sizes only for 3-D [B, T, N*D] key/value, which means transposing the whole cache at every step: measured
  slower than the unfused graph at decode (V2-Lite widths, past 512: 16 ms vs 11 ms; ORT's Attention: 1.6 ms).
* ONNX ``Attention`` (opset 23) takes 4-D q/k/v with different K and V head sizes, past_key/past_value with
  present_key/present_value outputs [B, N, past + S, D] (the full cache, so ``present.N.*`` keep their
  meaning), an additive attn_mask broadcast from [B, 1, S, T], and a scale: exactly this graph's attention.
  It is a standard op, not a contrib op; the price is raising the model's default-domain opset to 23, which is
  safe when no op the graph uses changed meaning between its opset and 23 (GroupNormalization, GridSample and
  DFT did; the others only gained types or attributes with compatible defaults). That is checked, and the pass
  refuses otherwise.

Matched (``passes.fusions._attention``'s patterns): q [B, H, S, Dk], present_k = Concat(past_k, k, axis=2)
[B, kvH, T, Dk], present_v likewise with Dv, optional repeat_kv (ONNX Attention takes kv heads < H in 4-D
natively), softmax(q K^T * scale + mask) V. Replaced by ``Y, present_k, present_v = Attention(q, k, v, mask,
past_k, past_v, scale=...)``; Y [B, H, S, Dv] takes the place of the MatMul's output; present_* take over the
Concat outputs (graph output names included). The mask keeps left padding exact; only padding query rows (every
key masked) can come out differently, and nothing reads them. Runs after ``fuse-group-query-attention``, so it
only sees the attention GQA cannot take or declines (MLA: K/V head sizes differ, or a K part shared by every
head) or that GQA was not run on.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx import defs
from onnxscript.rewriter import MatchResult

from passes.fusions._attention import attention, sdpa, shared_key_part, take_over_caches
from passes.fusions._common import dims, static_dim
from passes.graph import set_dtype
from passes.registry import register
from passes.rewrite import FusionRule, RewriteRulesPass

ATTENTION_OPSET = 23
# Default-domain ops whose definition changed in meaning (not only in types) between opsets 18 and 23.
CHANGED_MEANING = {"GroupNormalization": 21, "GridSample": 20, "DFT": 20}


def opset_blocker(model: ir.Model, target: int = ATTENTION_OPSET) -> str | None:
    """Why the model's default-domain opset cannot be raised to ``target``, or None if it can."""
    current = model.opset_imports.get("", 1)
    if current >= target:
        return None
    if current < 18:
        return f"the model's opset {current} is below 18; raising it to {target} is only checked from 18"
    graphs = [model.graph, *model.graph.subgraphs(), *model.functions.values()]
    used = {n.op_type for g in graphs for n in g if n.domain in ("", "ai.onnx")}
    for op_type in sorted(used & set(CHANGED_MEANING)):
        if CHANGED_MEANING[op_type] > current:
            return f"raising the opset to {target} would change the meaning of {op_type}"
    for op_type in sorted(used):
        try:
            defs.get_schema(op_type, target, "")
        except defs.SchemaError:
            return f"{op_type} has no definition at opset {target}"
    return None


class _Attention(FusionRule):
    def pattern(self, op, q, past_k, new_k, past_v, new_v, mask, scale, k_axes, k_reps, k_shape, v_axes, v_reps,
                v_shape):
        return attention(op, q, past_k, new_k, past_v, new_v, mask, scale, k_axes, k_reps, k_shape, v_axes, v_reps,
                         v_shape)

    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, **b) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        match = sdpa(b)
        if isinstance(match, str):
            return result.fail(match)
        shape = _check(match)
        if isinstance(shape, str):
            return result.fail(shape)
        if "opset_blocker" not in self.edit.shared:
            self.edit.shared["opset_blocker"] = opset_blocker(context.model)
        blocker = self.edit.shared["opset_blocker"]
        if blocker:
            return result.fail(blocker)
        self.found = match, shape
        return result

    def rewrite(self, op, **_):
        match, (heads, kv_heads, k_dim, v_dim) = self.found
        inputs = [match.q, match.key.new, match.value.new, match.mask, match.key.past, match.value.past]
        y, present_k, present_v = self.emit(op).node("Attention", inputs, {"scale": match.scale}, num_outputs=3).outputs
        out = match.root.outputs[0]
        set_dtype(y, out.dtype)
        y.shape = out.shape
        take_over_caches(self.edit, match, present_k, present_v)
        mla = k_dim != v_dim or shared_key_part(match.key)
        self.counted = ("mla" if mla else ("gqa" if kv_heads < heads else "mha"),)
        return y

    def finish(self, edit) -> None:
        model = edit.model
        model.opset_imports[""] = max(model.opset_imports.get("", 1), ATTENTION_OPSET)
        model.ir_version = max(model.ir_version or 0, 11)  # opset 23 came with IR version 11


def _check(match) -> tuple[int, int, int, int] | str:
    q, k, v = dims(match.q), dims(match.key.new), dims(match.value.new)
    if any(d is None or len(d) != 4 for d in (q, k, v)):
        return f"q/k/v are not 4-D [B, heads, S, D] (shapes {q}, {k}, {v}; run infer-shapes first)"
    heads, kv_heads = static_dim(match.q, 1), static_dim(match.key.new, 1) or static_dim(match.key.past, 1)
    k_dim, v_dim = static_dim(match.q, 3), static_dim(match.value.new, 3) or static_dim(match.value.past, 3)
    if heads is None or kv_heads is None or k_dim is None or v_dim is None:
        return "head counts or head sizes unknown (run infer-shapes first)"
    if heads % kv_heads or heads // kv_heads != match.key.n_rep:
        return f"{heads} query heads over {kv_heads} kv heads, but K/V are repeated {match.key.n_rep} times"
    mask = dims(match.mask)
    if mask is not None and (len(mask) > 4 or (len(mask) == 4 and mask[1] not in (1, heads, None))):
        return f"mask of shape {mask} does not broadcast to [B, heads, S, T]"
    return heads, kv_heads, k_dim, v_dim


@register("fuse-mla-attention", targets=("onnxruntime",),
          description="MLA attention (K/V head sizes differ) over a Concat KV cache -> ONNX Attention (opset 23).")
class FuseMlaAttention(RewriteRulesPass):
    """Counts: ``mla`` (K and V head sizes differ, or K has MLA's RoPE part shared by every head), else ``mha`` /
    ``gqa`` (kv heads == / < heads)."""

    def __init__(self) -> None:
        super().__init__([_Attention("attention")])
