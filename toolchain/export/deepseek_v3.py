"""DeepSeek-V3 / R1: MLA with q_lora, sigmoid scores with a bias-corrected, group-limited top-k choice."""

from __future__ import annotations

import numpy as np

from toolchain.export.deepseek import DeepseekArchitecture, grouped, limit_to_top_groups
from toolchain.export.graph import GraphBuilder


class DeepseekV3Architecture(DeepseekArchitecture):
    model_types: tuple[str, ...] = ("deepseek_v3",)

    def rope_interleaved(self, config) -> bool:
        return bool(config.rope_interleave)

    def route(self, g: GraphBuilder, moe, logits):
        config = moe.config
        scores = g.op("Sigmoid", logits)
        biased = g.op("Add", scores, g.weight("e_score_correction_bias",
                                              g.params.array(moe.gate.e_score_correction_bias)))
        top2, _ = g.op("TopK", grouped(g, biased, config.n_group), g.const([2]), axis=-1, outputs=2)
        group_scores = g.op("ReduceSum", top2, g.const([-1]), keepdims=0)
        # -inf outside the chosen groups, as transformers 5.24 (and DeepSeek's own inference code) masks them: a
        # biased score below zero inside them still wins over any expert outside
        choice = limit_to_top_groups(g, biased, group_scores, config.topk_group, config.n_group,
                                     config.n_routed_experts, float("-inf"))
        _, topk_idx = g.op("TopK", choice, g.const([config.num_experts_per_tok]), axis=-1, outputs=2)
        topk_w = g.op("GatherElements", scores, topk_idx, axis=1)
        if config.norm_topk_prob:
            total = g.op("Add", g.op("ReduceSum", topk_w, g.const([-1]), keepdims=1), g.const(1e-20, np.float32))
            topk_w = g.op("Div", topk_w, total)
        return topk_idx, g.op("Mul", topk_w, g.const(config.routed_scaling_factor, np.float32))
