"""Small random checkpoints of every exported architecture, written once per test session."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, LlamaConfig, Qwen2Config

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=256)
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
           n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)


def tiny_configs() -> dict:
    return {
        "llama": LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**COMMON, num_key_value_heads=2),
        "deepseek_v2": DeepseekV2Config(**COMMON, **MLA, q_lora_rank=None, n_routed_experts=8, topk_method="greedy",
                                        n_group=1, topk_group=1, routed_scaling_factor=1.0),
        "deepseek_v2_group_limited": DeepseekV2Config(**COMMON, **MLA, q_lora_rank=16, n_routed_experts=8,
                                                      topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                      routed_scaling_factor=1.5),
        "deepseek_v3": DeepseekV3Config(**COMMON, **MLA, q_lora_rank=24, n_routed_experts=16, n_group=4, topk_group=2,
                                        routed_scaling_factor=2.5, rope_interleave=True),
        "deepseek_v3_plain_rope": DeepseekV3Config(**COMMON, **MLA, q_lora_rank=24, n_routed_experts=8, n_group=2,
                                                   topk_group=1, routed_scaling_factor=1.0, rope_interleave=False,
                                                   norm_topk_prob=False),
    }


def make_checkpoint(config, path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for module in model.modules():  # a bias that decides routing, as a trained V3 has
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_checkpoint(cfg, root / name) for name, cfg in tiny_configs().items()}
