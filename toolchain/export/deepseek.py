"""What DeepSeek-V2 and V3 share: MLA attention (per-head KV cache) and the MoE layer around the router.

The subclasses in deepseek_v2.py / deepseek_v3.py supply their routing; ``moe_lowering`` chooses how the routed
experts run (toolchain/export/moe.py). Later work replaces `attention` here with a latent-cache form without
touching the rest.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from toolchain.errors import UnsupportedModelError
from toolchain.export import blocks, moe
from toolchain.export.decoder import LayerInputs
from toolchain.export.graph import GraphBuilder


class DeepseekArchitecture:
    model_types: tuple[str, ...] = ()
    attention_kind = "mla"
    # onnxruntime-genai's config has one head_size for keys and values; MLA's differ (toolchain/compile/
    # onnxruntime_artifact.py writes no genai_config.json, and says why)
    genai_model_type: str | None = None
    moe_lowering = "dispatch"  # moe.with_lowering gives a copy with another

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
        return config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim

    def head_layout(self, config) -> dict[str, tuple[str, int]]:
        nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        return {"q_proj": ("out", nope + rope), "q_b_proj": ("out", nope + rope), "kv_b_proj": ("out", nope + v),
                "o_proj": ("in", v)}

    def moe_layers(self, config) -> list[int]:
        """transformers' rule for DeepSeek-V2/V3: every layer from first_k_dense_replace on."""
        if not _get(config, "n_routed_experts"):
            return []
        return list(range(_get(config, "first_k_dense_replace") or 0, _get(config, "num_hidden_layers")))

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
        if attn.q_lora_rank is None:
            q = blocks.linear(g, h, attn.q_proj, "q_proj", rows=q_rows)
        else:
            q_a = blocks.rms_norm(g, blocks.linear(g, h, attn.q_a_proj, "q_a_proj"), attn.q_a_layernorm, "q_a_layernorm")
            q = blocks.linear(g, q_a, attn.q_b_proj, "q_b_proj", rows=q_rows)
        q_nope, q_rot = g.op("Split", blocks.heads(g, q, num_heads, nope + rope), g.const([nope, rope]), axis=-1,
                             outputs=2)
        latent, k_rot = g.op("Split", blocks.linear(g, h, attn.kv_a_proj_with_mqa, "kv_a_proj_with_mqa", rows=kv_rows),
                             g.const([kv_rank, rope]), axis=-1, outputs=2)
        kv = blocks.linear(g, blocks.rms_norm(g, latent, attn.kv_a_layernorm, "kv_a_layernorm"), attn.kv_b_proj,
                           "kv_b_proj")
        k_nope, v = g.op("Split", blocks.heads(g, kv, num_heads, nope + v_dim), g.const([nope, v_dim]), axis=-1,
                         outputs=2)
        q_rot = blocks.apply_rope(g, q_rot, inputs.cos, inputs.sin)
        k_rot = blocks.apply_rope(g, g.op("Unsqueeze", k_rot, g.const([1])), inputs.cos, inputs.sin)
        k_rot = g.op("Expand", k_rot, g.const([1, num_heads, 1, 1]))
        q = g.op("Concat", q_nope, q_rot, axis=-1)
        key = g.op("Concat", inputs.past_key, g.op("Concat", k_nope, k_rot, axis=-1), axis=2)
        value = g.op("Concat", inputs.past_value, v, axis=2)
        out = blocks.sdpa(g, q, key, value, inputs.mask, attn.scaling, num_heads)
        return blocks.linear(g, out, attn.o_proj, "o_proj"), key, value

    def route(self, g: GraphBuilder, moe, logits):
        """Return (top-k expert indices [tokens, k] int64, their weights [tokens, k])."""
        raise NotImplementedError

    def router_weight(self, g: GraphBuilder, moe):
        return g.params.array(moe.gate.weight)

    def mlp(self, g: GraphBuilder, mlp, h):
        if not hasattr(mlp, "experts"):
            return blocks.mlp_module(g, h, mlp, "dense")
        x2d = g.op("Reshape", h, g.const([-1, mlp.config.hidden_size]))
        with g.scope("router"), g.role("router"):
            logits = blocks.matmul_weight(g, x2d, self.router_weight(g, mlp), "gate")
            topk_idx, topk_w = self.route(g, mlp, logits)
        with g.role("routed_expert"):
            routed = moe.routed_experts(g, self.moe_lowering, x2d, topk_idx, topk_w, mlp.experts, mlp.top_k)
        routed = g.op("Reshape", routed, g.op("Shape", h))
        with g.role("shared_expert"):
            shared = blocks.mlp_module(g, h, mlp.shared_experts, "shared_experts")
        return g.op("Add", routed, shared)


def _get(config, name: str):
    """A config field of a transformers config or of its config.json (a runtime reads the artifact's file)."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def limit_to_top_groups(g: GraphBuilder, scores, group_scores, topk_group: int, num_groups: int, num_experts: int):
    """Zero the scores of experts outside the topk_group best groups, as transformers' masked_fill(..., 0.0) does.

    scores: [tokens, experts]; group_scores: [tokens, groups] with experts split evenly and in order over groups.
    """
    _, group_idx = g.op("TopK", group_scores, g.const([topk_group]), axis=-1, outputs=2)
    zeros = g.op("ConstantOfShape", g.op("Shape", group_scores), value=ir.tensor(np.zeros(1, np.float32)))
    ones = g.op("ConstantOfShape", g.op("Shape", group_idx), value=ir.tensor(np.ones(1, np.float32)))
    group_mask = g.op("ScatterElements", zeros, group_idx, ones, axis=1)
    per_group = g.op("Expand", g.op("Unsqueeze", group_mask, g.const([-1])), g.const([1, 1, num_experts // num_groups]))
    expert_mask = g.op("Reshape", per_group, g.const([-1, num_experts]))
    return g.op("Where", g.op("Cast", expert_mask, to=ir.DataType.BOOL), scores, g.const(0.0, np.float32))


def grouped(g: GraphBuilder, scores, num_groups: int):
    """[tokens, experts] -> [tokens, groups, experts/groups]."""
    return g.op("Reshape", scores, g.const([0, num_groups, -1]))
