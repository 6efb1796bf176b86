"""What DeepSeek-V2 and V3 share: MLA attention with its KV cache in one of two layouts, and MoE layers with shared
experts (toolchain/export/moe_layer.py) from first_k_dense_replace on.

The subclasses in deepseek_v2.py / deepseek_v3.py declare their router (``moe``); ``moe_lowering`` chooses how the
routed experts run (toolchain/export/moe.py), ``kv_cache`` what the cache holds (``dstc export --mla-cache``, recipe
``export.mla_cache``; ``with_mla_cache``):

* ``latent`` (the default): per token and layer, the normalized latent (kv_lora_rank values, after
  kv_a_layernorm) as ``past_key_values.N.value`` [B, 1, T, kv_lora_rank] and the rotary key (qk_rope_head_dim
  values, after RoPE) as ``past_key_values.N.key`` [B, 1, T, qk_rope_head_dim]: one "head" each, so every consumer
  of the graph interface sees an ordinary cache. kv_b_proj is absorbed: its key rows W_uk [H, nope, rank] turn
  the query's nope part into the latent space (q_lat = q_nope @ W_uk), scores = q_lat latent^T + q_rot k_rot^T
  with the key and the latent shared by every head, and its value rows W_uv [H, rank, v] take the attended latent
  back to each head's values before o_proj. Both are 3-D per-head constants read by a batched MatMul (the
  compress stage's rules for them are in toolchain/compress/engine.py). DeepSeek-V3 widths cache 512 + 64 values
  per token and layer instead of 128 x (192 + 128). The default because benchmarks/mla_cache.py (V2-Lite widths,
  2 layers) measured it at least as fast at decode at every context, and faster from 1k on, on both backends:
  1.3x (ONNX Runtime fp32) to 5.5x (OpenVINO INT4) for the whole step at 4k (docs/deepseek-generations.md, "MLA KV
  cache").
* ``per-head``: transformers 5.5's form (5.24 caches the latent), per-head keys [H, nope + rope] and values
  [H, v], kv_b_proj applied to the latent of every new token. Chosen for what only it has: ``fuse-mla-attention``
  fuses it into ONNX Attention for ONNX Runtime, and openvino_genai's continuous batching (``dstc serve`` on
  OpenVINO) pages only ScaledDotProductAttention, so it refuses a latent artifact.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from toolchain.errors import InputError, UnsupportedModelError
from toolchain.export import blocks
from toolchain.export.decoder import LayerInputs, with_kv_cache
from toolchain.export.graph import GraphBuilder
from toolchain.export.moe_layer import MoeArchitecture, config_value
from toolchain.export.weights import LazyArray

MLA_CACHES = ("latent", "per-head")


def with_mla_cache(arch, layout: str | None):
    """The architecture with its MLA KV cache in ``layout`` (MLA_CACHES); None keeps the architecture's default
    (latent). Asking for a layout of an architecture without MLA attention is an InputError."""
    if layout is None:
        return arch
    if layout not in MLA_CACHES:
        raise InputError(f"unknown MLA cache layout {layout!r}; layouts: {', '.join(MLA_CACHES)}")
    if arch.attention_kind != "mla":
        raise InputError(f"the MLA cache layout applies to MLA attention (deepseek_v2, deepseek_v3); "
                         f"{arch.model_types[0]} has {arch.attention_kind} attention, whose cache is per head: "
                         f"drop mla_cache / --mla-cache")
    return with_kv_cache(arch, layout)


def absorbed_weights(kv_b, heads: int, nope: int, v_dim: int):
    """kv_b_proj's [H * (nope + v), rank] weight (numpy, or a LazyArray read when written) as W_uk [H, nope, rank]
    (q_lat = q_nope @ W_uk) and W_uv [H, rank, v] (a head's values = ctx @ W_uv)."""
    rank = kv_b.shape[1]
    if isinstance(kv_b, LazyArray):
        if kv_b.rows is not None or kv_b.transposed:
            raise ValueError("kv_b_proj's weight is read as the checkpoint stores it")
        # a checkpoint weight's LazyArray has its read (only StackedExperts has none)
        per_head = lambda: kv_b.read().reshape(heads, nope + v_dim, rank)  # type: ignore[misc]  # noqa: E731
        return (replace(kv_b, shape=(heads, nope, rank), read=lambda: per_head()[:, :nope]),
                replace(kv_b, shape=(heads, rank, v_dim), read=lambda: per_head()[:, nope:].transpose(1, 2)))
    per_head = kv_b.reshape(heads, nope + v_dim, rank)
    return np.ascontiguousarray(per_head[:, :nope]), np.ascontiguousarray(per_head[:, nope:].transpose(0, 2, 1))


class DeepseekArchitecture(MoeArchitecture):
    model_types: tuple[str, ...] = ()
    attention_kind = "mla"
    # onnxruntime-genai's config has one head_size for keys and values; MLA's differ (toolchain/compile/
    # onnxruntime_artifact.py writes no genai_config.json, and says why)
    genai_model_type: str | None = None
    rotations_per_layer = 2  # q and k
    reference_row_by_row = False
    exports_mtp = False
    mtp_wiring: str | None = None
    mtp_layer_classes: tuple[str, str, str] | None = None
    hub_layout = "bf16"  # DeepSeek-V2's; V3 and V3.2 ship FP8
    bf16_unless_asked = True
    kv_cache = "latent"  # with_mla_cache gives a copy with another (MLA_CACHES)

    def check(self, config) -> None:
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"{config.model_type}: hidden_act {config.hidden_act!r} is not supported")
        if config.num_key_value_heads != config.num_attention_heads:
            # transformers' MLA repeats the per-head K/V again by heads/kv_heads; no checkpoint does this
            raise UnsupportedModelError(f"{config.model_type}: num_key_value_heads must equal num_attention_heads")
        if config.n_shared_experts is None:
            raise UnsupportedModelError(f"{config.model_type}: MoE layers without shared experts are not supported")
        rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        if rope_type not in ("default", "yarn", "linear"):
            raise UnsupportedModelError(f"{config.model_type}: rope_type {rope_type!r} is not supported")

    def fix_reference(self, model) -> None:
        pass

    def cache_dims(self, config) -> tuple[int, int, int]:
        if self.kv_cache == "latent":  # key: the rotary key, value: the latent, both shared by every head
            return 1, config.qk_rope_head_dim, config.kv_lora_rank
        return config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim

    def extra_caches(self, config) -> dict[str, tuple[int, int]]:
        return {}

    def head_layout(self, config) -> dict[str, tuple[str, int]]:
        """With the latent cache kv_b_proj's weights are W_uk / W_uv, [heads, K, N]: "stacked", a head per index
        of axis 0."""
        nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        kv_b = ("stacked", config.num_attention_heads) if self.kv_cache == "latent" else ("out", nope + v)
        return {"q_proj": ("out", nope + rope), "q_b_proj": ("out", nope + rope), "kv_b_proj": kv_b,
                "o_proj": ("in", v)}

    def moe_layers(self, config) -> list[int]:
        """transformers' rule for DeepSeek-V2/V3: every layer from first_k_dense_replace on."""
        if not config_value(config, "n_routed_experts"):
            return []
        first = config_value(config, "first_k_dense_replace") or 0
        return list(range(first, config_value(config, "num_hidden_layers")))

    def rope_interleaved(self, config) -> bool:
        raise NotImplementedError

    def attention(self, g: GraphBuilder, attn, h, inputs: LayerInputs):
        num_heads, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
        v_dim, kv_rank = attn.v_head_dim, attn.kv_lora_rank
        q_rows = kv_rows = None
        if self.rope_interleaved(attn.config):
            per_head = np.concatenate([np.arange(nope), nope + blocks.deinterleave_rows(rope)])
            q_rows = np.concatenate([hd * (nope + rope) + per_head for hd in range(num_heads)])
            kv_rows = np.concatenate([np.arange(kv_rank), kv_rank + blocks.deinterleave_rows(rope)])
        q_a = None
        if attn.q_lora_rank is None:
            q = blocks.linear(g, h, attn.q_proj, "q_proj", rows=q_rows)
        else:
            q_a = blocks.rms_norm(g, blocks.linear(g, h, attn.q_a_proj, "q_a_proj"), attn.q_a_layernorm,
                                  "q_a_layernorm")
            q = blocks.linear(g, q_a, attn.q_b_proj, "q_b_proj", rows=q_rows)
        inputs = self.attention_inputs(g, attn, h, q_a, inputs)
        q_nope, q_rot = g.op("Split", blocks.heads(g, q, num_heads, nope + rope), g.const([nope, rope]), axis=-1,
                             outputs=2)
        latent, k_rot = g.op("Split", blocks.linear(g, h, attn.kv_a_proj_with_mqa, "kv_a_proj_with_mqa", rows=kv_rows),
                             g.const([kv_rank, rope]), axis=-1, outputs=2)
        latent = blocks.rms_norm(g, latent, attn.kv_a_layernorm, "kv_a_layernorm")
        if self.kv_cache == "latent":
            return self._latent_attention(g, attn, q_nope, q_rot, latent, k_rot, inputs)
        kv = blocks.linear(g, latent, attn.kv_b_proj, "kv_b_proj")
        k_nope, v = g.op("Split", blocks.heads(g, kv, num_heads, nope + v_dim), g.const([nope, v_dim]), axis=-1,
                         outputs=2)
        q_rot = blocks.apply_rope(g, q_rot, inputs.cos, inputs.sin)
        k_rot = blocks.apply_rope(g, g.op("Unsqueeze", k_rot, g.const([1])), inputs.cos, inputs.sin)
        k_rot = g.op("Expand", k_rot, g.const([1, num_heads, 1, 1]))
        q = g.op("Concat", q_nope, q_rot, axis=-1)
        key = g.op("Concat", inputs.past_key, g.op("Concat", k_nope, k_rot, axis=-1), axis=2)
        value = g.op("Concat", inputs.past_value, v, axis=2)
        out = self.per_head_context(g, attn, q, key, value, inputs)
        return blocks.linear(g, out, attn.o_proj, "o_proj"), key, value

    def attention_inputs(self, g: GraphBuilder, attn, h, q_a, inputs: LayerInputs) -> LayerInputs:
        """What the layer's attention reads (its mask, caches): ``inputs`` as they are; DeepSeek-V3.2's adds the
        tokens its indexer picks (deepseek_v32.py). h: the normed hidden state, q_a: the query's
        normed latent (None without q_lora)."""
        return inputs

    def per_head_context(self, g: GraphBuilder, attn, q, key, value, inputs: LayerInputs):
        """The per-head layout's attention, [B, S, H * v]: q [B, H, S, nope + rope], key and value the grown
        caches [B, H, T, *]. DeepSeek-V3.2 attends to its indexer's chosen tokens only (deepseek_v32.py)."""
        return blocks.sdpa(g, q, key, value, inputs.mask, attn.scaling, attn.num_heads)

    def latent_context(self, g: GraphBuilder, attn, q_lat, q_rot, key, value, inputs: LayerInputs, new):
        """The latent layout's attention, the attended latent [B, H, S, rank]: q_lat [B, H, S, rank], q_rot
        [B, H, S, rope] (rotated), key [B, 1, T, rope] and value [B, 1, T, rank] the grown caches, ``new`` this
        step's (key, value) entries [B, 1, S, *]. DeepSeek-V3.2 attends to its indexer's chosen tokens only, read
        from the past and the new entries apart (deepseek_v32.py)."""
        del new  # dense attention reads the grown caches
        # The heads go into the rows of one product per cached tensor ([B, H, S, d] -> [B, 1, H*S, d]), so each
        # cached position is read once for all heads rather than once per head.
        fold, unfold = g.const([0, 1, -1, 0]), g.const([0, attn.num_heads, -1, 0])
        nope_scores = g.op("MatMul", g.op("Reshape", q_lat, fold), g.op("Transpose", value, perm=[0, 1, 3, 2]))
        rope_scores = g.op("MatMul", g.op("Reshape", q_rot, fold), g.op("Transpose", key, perm=[0, 1, 3, 2]))
        scores = g.op("Reshape", g.op("Add", nope_scores, rope_scores), unfold)  # [B, H, S, T]
        scores = g.op("Mul", scores, g.const(attn.scaling, np.float32))
        probs = g.op("Softmax", g.op("Add", scores, inputs.mask), axis=-1)
        return g.op("Reshape", g.op("MatMul", g.op("Reshape", probs, fold), value), unfold)

    def _latent_attention(self, g: GraphBuilder, attn, q_nope, q_rot, latent, k_rot, inputs: LayerInputs):
        """Attention over the latent cache with kv_b_proj absorbed (module doc). q_nope, q_rot: [B, H, S, *];
        latent [B, S, rank] (normalized), k_rot [B, S, rope] (before RoPE)."""
        num_heads = attn.num_heads
        w_uk, w_uv = absorbed_weights(g.params.array(attn.kv_b_proj.weight), num_heads, attn.qk_nope_head_dim,
                                      attn.v_head_dim)
        q_rot = blocks.apply_rope(g, q_rot, inputs.cos, inputs.sin)
        k_rot = blocks.apply_rope(g, g.op("Unsqueeze", k_rot, g.const([1])), inputs.cos, inputs.sin)
        with g.scope("kv_b_proj"):
            q_lat = g.op("MatMul", q_nope, g.weight("k_absorbed", w_uk))  # [B, H, S, rank]
        latent = g.op("Unsqueeze", latent, g.const([1]))  # [B, 1, S, rank]
        key = g.op("Concat", inputs.past_key, k_rot, axis=2)  # [B, 1, T, rope]
        value = g.op("Concat", inputs.past_value, latent, axis=2)  # [B, 1, T, rank]
        with g.scope("mla"):
            ctx = self.latent_context(g, attn, q_lat, q_rot, key, value, inputs, (k_rot, latent))  # [B, H, S, rank]
        with g.scope("kv_b_proj"):
            out = g.op("MatMul", ctx, g.weight("v_absorbed", w_uv))  # [B, H, S, v]
        out = g.op("Reshape", g.op("Transpose", out, perm=[0, 2, 1, 3]), g.const([0, 0, -1]))
        return blocks.linear(g, out, attn.o_proj, "o_proj"), key, value
