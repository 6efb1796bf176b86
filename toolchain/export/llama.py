"""Llama (DeepSeek-R1-Distill-Llama): GQA attention with RoPE (llama3 scaling comes from the rotary module)."""

from __future__ import annotations

from toolchain.errors import UnsupportedModelError
from toolchain.export import blocks
from toolchain.export.decoder import LayerInputs
from toolchain.export.graph import GraphBuilder


class LlamaArchitecture:
    model_types: tuple[str, ...] = ("llama",)
    attention_kind = "gqa"
    kv_cache = "per-head"
    genai_model_type: str | None = "llama"
    moe_lowering: str | None = None  # no MoE layers
    rotations_per_layer = 2  # q and k
    reference_row_by_row = False
    exports_mtp = False
    mtp_wiring: str | None = None
    mtp_layer_classes: tuple[str, str, str] | None = None
    hub_layout = "bf16"
    bf16_unless_asked = True

    def check(self, config) -> None:
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"{config.model_type}: hidden_act {config.hidden_act!r} is not supported")
        rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3", "linear", "yarn"):
            # dynamic RoPE recomputes inv_freq from the sequence length at run time
            raise UnsupportedModelError(f"{config.model_type}: rope_type {rope_type!r} is not supported")

    def fix_reference(self, model) -> None:
        pass

    def cache_dims(self, config) -> tuple[int, int, int]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return config.num_key_value_heads, head_dim, head_dim

    def extra_caches(self, config) -> dict[str, tuple[int, int]]:
        return {}

    def head_layout(self, config) -> dict[str, tuple[str, int]]:
        head_dim = self.cache_dims(config)[1]
        return dict.fromkeys(("q_proj", "k_proj", "v_proj"), ("out", head_dim)) | {"o_proj": ("in", head_dim)}

    def moe_layers(self, config) -> list[int]:
        return []

    def attention(self, g: GraphBuilder, attn, h, inputs: LayerInputs):
        config = attn.config
        num_heads, num_kv = config.num_attention_heads, config.num_key_value_heads
        q = blocks.heads(g, blocks.linear(g, h, attn.q_proj, "q_proj"), num_heads, attn.head_dim)
        k = blocks.heads(g, blocks.linear(g, h, attn.k_proj, "k_proj"), num_kv, attn.head_dim)
        v = blocks.heads(g, blocks.linear(g, h, attn.v_proj, "v_proj"), num_kv, attn.head_dim)
        q = blocks.apply_rope(g, q, inputs.cos, inputs.sin)
        k = blocks.apply_rope(g, k, inputs.cos, inputs.sin)
        key = g.op("Concat", inputs.past_key, k, axis=2)
        value = g.op("Concat", inputs.past_value, v, axis=2)
        out = blocks.sdpa(g, q, key, value, inputs.mask, attn.scaling, num_heads, num_heads // num_kv,
                          (attn.head_dim, attn.head_dim))
        return blocks.linear(g, out, attn.o_proj, "o_proj"), key, value

    def mlp(self, g: GraphBuilder, mlp, h):
        return blocks.mlp_module(g, h, mlp, blocks.DENSE_MLP)
