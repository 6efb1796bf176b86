"""Checkpoint variants the embedded models do not cover (project issue #10): MLA whose key and value head sizes
are equal, and tied embeddings."""

from __future__ import annotations

import pytest
from transformers import DeepseekV2Config, DeepseekV3Config

from toolchain.stages.export import export
from toolchain.stages.optimize import optimize

from conftest import COMMON, MLA, make_checkpoint


@pytest.mark.parametrize("config", [
    # 8 + 8 == 16: a head size ORT's GroupQueryAttention takes, so only its MLA check keeps it away
    DeepseekV2Config(**COMMON, **{**MLA, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16},
                     q_lora_rank=None, n_routed_experts=8, topk_method="greedy", n_group=1, topk_group=1),
    # 4 + 8 == 12: not a GQA head size; fuse-mla-attention took it before, but counted it as "mha"
    DeepseekV3Config(**COMMON, **{**MLA, "qk_nope_head_dim": 4, "qk_rope_head_dim": 8, "v_head_dim": 12},
                     q_lora_rank=24, n_routed_experts=8, n_group=2, topk_group=1, rope_interleave=True),
], ids=["v2-16", "v3-12"])
def test_mla_with_equal_key_and_value_head_sizes_optimizes_for_onnxruntime(tmp_path, config):
    export(str(make_checkpoint(config, tmp_path / "ckpt")), tmp_path / "export", parity=())
    report = optimize(tmp_path / "export", tmp_path / "out", "onnxruntime", new_tokens=8)
    layers = config.num_hidden_layers
    assert report["counts"]["fuse-mla-attention"] == {"mla": layers}
    assert "fuse-group-query-attention" not in report["counts"]
    assert report["output"]["op_types"]["Attention"] == layers
    assert "com.microsoft.GroupQueryAttention" not in report["output"]["op_types"]
    parity = report["parity"]["onnxruntime"]
    assert parity["passed"] and parity["tokens_identical"]
    assert parity["max_relative_diff"] <= 1e-4
