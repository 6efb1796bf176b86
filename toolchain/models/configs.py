"""Architectures of the embedded tiny models: small widths, but every feature of the real model they stand for."""

from __future__ import annotations

from typing import Any, TypeVar

from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig, PreTrainedConfig, Qwen2Config

from toolchain.models.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, VOCAB_SIZE

MAX_POSITIONS = 1024
_TOKEN_IDS = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": SPECIAL_TOKENS.index(BOS),
    "eos_token_id": SPECIAL_TOKENS.index(EOS),
    "pad_token_id": SPECIAL_TOKENS.index(PAD),
}
_COMMON = {**_TOKEN_IDS, "hidden_size": 128, "max_position_embeddings": MAX_POSITIONS, "tie_word_embeddings": False}
# MLA widths shared by both DeepSeek models; v_head_dim differs from the qk head dim (nope + rope = 48) on purpose.
_MLA = {"kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24}


C = TypeVar("C", bound=PreTrainedConfig)


def _config(cls: type[C], **fields: Any) -> C:
    """``cls(**fields)``. transformers makes each config class a dataclass of its own fields when the class is
    defined (PreTrainedConfig.__init_subclass__), which mypy does not see: it knows PreTrainedConfig's fields only."""
    return cls(**fields)


def _yarn(mscale: float) -> dict:
    # Scaled down from the real checkpoints' YaRN settings (factor 40 over 4096 positions).
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale}


def deepseek_v3_tiny() -> DeepseekV3Config:
    return _config(
        DeepseekV3Config, **_COMMON, **_MLA,
        intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters=_yarn(1.0),
    )


def deepseek_v2_lite_tiny() -> DeepseekV2Config:
    return _config(
        DeepseekV2Config, **_COMMON, **_MLA,
        intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        n_shared_experts=2, n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_parameters=_yarn(0.707),
    )


def r1_distill_qwen_tiny() -> Qwen2Config:
    return _config(
        Qwen2Config, **_COMMON,
        intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def r1_distill_llama_tiny() -> LlamaConfig:
    return _config(
        LlamaConfig, **_COMMON,
        intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    )


CONFIGS = {
    "deepseek-v3-tiny": deepseek_v3_tiny,
    "deepseek-v2-lite-tiny": deepseek_v2_lite_tiny,
    "r1-distill-qwen-tiny": r1_distill_qwen_tiny,
    "r1-distill-llama-tiny": r1_distill_llama_tiny,
}


def build_config(name: str) -> PreTrainedConfig:
    return CONFIGS[name]()
