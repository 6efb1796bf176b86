"""Qwen3-MoE: GQA attention with an RMSNorm on each query and key head before RoPE, and MoE layers without shared
experts (softmax top-k, ``norm_topk_prob``) where ``decoder_sparse_step`` falls, except ``mlp_only_layers``."""

from __future__ import annotations

from toolchain.errors import UnsupportedModelError
from toolchain.export import blocks
from toolchain.export.decoder import LayerInputs
from toolchain.export.graph import GraphBuilder
from toolchain.export.llama import LlamaArchitecture
from toolchain.export.moe_layer import MoeArchitecture, MoeLayer, config_value
from toolchain.export.routers import SoftmaxTopK


class Qwen3MoeArchitecture(MoeArchitecture, LlamaArchitecture):
    model_types = ("qwen3_moe",)
    # onnxruntime-genai's qwen3 type is the dense model's; whether its runtime takes an MoE graph as a black box
    # is unchecked, so no genai_config.json is written
    genai_model_type = None

    def check(self, config) -> None:
        super().check(config)
        if config.sliding_window is not None:
            raise UnsupportedModelError("qwen3_moe: sliding-window attention (use_sliding_window) is not supported")

    def moe_layers(self, config) -> list[int]:
        """transformers' rule: every decoder_sparse_step-th layer (counting from 1), except mlp_only_layers."""
        if not config_value(config, "num_experts"):
            return []
        step = config_value(config, "decoder_sparse_step") or 1
        dense = config_value(config, "mlp_only_layers") or []
        return [i for i in range(config_value(config, "num_hidden_layers")) if (i + 1) % step == 0 and i not in dense]

    def moe(self, config, layer: int) -> MoeLayer:
        return MoeLayer(SoftmaxTopK(config.num_experts_per_tok, config.num_experts,
                                    normalize=bool(config.norm_topk_prob)))

    def attention(self, g: GraphBuilder, attn, h, inputs: LayerInputs):
        config = attn.config
        num_heads, num_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        # the norms run over each head's head_dim values: the same per head before or after the transpose
        q = blocks.rms_norm(g, blocks.heads(g, blocks.linear(g, h, attn.q_proj, "q_proj"), num_heads, head_dim),
                            attn.q_norm, "q_norm")
        k = blocks.rms_norm(g, blocks.heads(g, blocks.linear(g, h, attn.k_proj, "k_proj"), num_kv, head_dim),
                            attn.k_norm, "k_norm")
        v = blocks.heads(g, blocks.linear(g, h, attn.v_proj, "v_proj"), num_kv, head_dim)
        q = blocks.apply_rope(g, q, inputs.cos, inputs.sin)
        k = blocks.apply_rope(g, k, inputs.cos, inputs.sin)
        key = g.op("Concat", inputs.past_key, k, axis=2)
        value = g.op("Concat", inputs.past_value, v, axis=2)
        out = blocks.sdpa(g, q, key, value, inputs.mask, attn.scaling, num_heads, num_heads // num_kv,
                          (head_dim, head_dim))
        return blocks.linear(g, out, attn.o_proj, "o_proj"), key, value
