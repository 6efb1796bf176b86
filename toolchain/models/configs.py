"""Architectures of the embedded tiny models: small widths, but every feature of the real model they stand for."""

from __future__ import annotations

from typing import Any, TypeVar

from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV4Config,
    DeepseekV32Config,
    LlamaConfig,
    PreTrainedConfig,
    Qwen2Config,
)

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


# V3-tiny's layers and MoE, which V3.2-tiny shares
_V3_BODY = dict(intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3, first_k_dense_replace=1,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, n_shared_experts=1, n_routed_experts=16,
                num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)


def deepseek_v3_tiny() -> DeepseekV3Config:
    return _config(
        DeepseekV3Config, **_COMMON, **_MLA, **_V3_BODY, rope_interleave=True,
        rope_parameters=_yarn(1.0),
    )


def deepseek_v32_tiny() -> DeepseekV32Config:
    """V3-tiny's MLA and MoE plus DeepSeek Sparse Attention, its indexer keeping 16 keys per query: the held-out texts
    (8-62 tokens, median 24) and their greedy continuations cross it in prefill and in decode. An arithmetic problem
    (9 + 5 tokens) stays below it. transformers trains the indexer with nothing (its forward runs without gradients);
    `dstc models make` trains it with DeepSeek's KL loss (toolchain/models/indexer_training.py). 16 indexer heads,
    not 4: a key's score is a weighted sum of ReLUs, exactly 0 when every head's is, and with 4 heads (untrained)
    many keys tied at 0 at the top-k boundary, which torch.topk and ONNX TopK break differently (export parity 0.36
    of the logits' range)."""
    return _config(
        DeepseekV32Config, **_COMMON, **_MLA, **_V3_BODY,
        index_n_heads=16, index_head_dim=32, index_topk=16,
        rope_parameters=_yarn(1.0),
    )


def deepseek_v4_tiny() -> DeepseekV4Config:
    """DeepSeek-V4-Flash's first four layer kinds at small widths: sliding, CSA, HCA, CSA attention; hash-routed MoE in
    the first two layers, sqrt(softplus) top-k in the last two. The held-out texts (8-62 tokens, median 24; training
    rows are 64) cross the sliding window (16), several CSA blocks (4; the indexer keeps 4 of up to 15 entries) and
    up to three HCA blocks (16); an arithmetic problem (9 + 5 tokens) stays within the window. The compressed layers'
    RoPE is YaRN as the hub's (scaled down like the other models'). Two hyper-connection streams and 5 Sinkhorn
    iterations, not the real 4 and 20: those doubled the training time, and the graph is the same for any count.
    swiglu_limit 3 clips 0.5 % of the trained experts' gate and up values on 20 held-out texts. One MTP block
    (toolchain/models/mtp_training.py), which transformers does not build."""
    return _config(
        DeepseekV4Config, **_TOKEN_IDS, hidden_size=128, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25,
        q_lora_rank=64, o_groups=2, o_lora_rank=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
        routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=3.0,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        sliding_window=16, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=4, index_head_dim=32, index_topk=4,
        hc_mult=2, hc_sinkhorn_iters=5,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        num_nextn_predict_layers=1,
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
    "deepseek-v32-tiny": deepseek_v32_tiny,
    "deepseek-v4-tiny": deepseek_v4_tiny,
    "deepseek-v2-lite-tiny": deepseek_v2_lite_tiny,
    "r1-distill-qwen-tiny": r1_distill_qwen_tiny,
    "r1-distill-llama-tiny": r1_distill_llama_tiny,
}


def build_config(name: str) -> PreTrainedConfig:
    return CONFIGS[name]()
