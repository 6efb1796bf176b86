"""DeepSeek-V2 / V2-Lite: MLA (q_lora optional, complex-form RoPE), softmax scores, greedy or group-limited top-k."""

from __future__ import annotations

import numpy as np

from toolchain.errors import UnsupportedModelError
from toolchain.export.deepseek import DeepseekArchitecture, grouped, limit_to_top_groups
from toolchain.export.graph import GraphBuilder


class DeepseekV2Architecture(DeepseekArchitecture):
    model_types: tuple[str, ...] = ("deepseek_v2",)

    def check(self, config) -> None:
        super().check(config)
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"deepseek_v2: topk_method {config.topk_method!r} is not supported")

    def fix_reference(self, model) -> None:
        # transformers 5.5's group_limited_greedy routing reads self.num_experts, which DeepseekV2Moe never sets
        # (5.24 routes in a router module that sets it)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "route_tokens_to_experts") and not hasattr(layer.mlp, "num_experts"):
                layer.mlp.num_experts = model.config.n_routed_experts

    def rope_interleaved(self, config) -> bool:
        return True  # transformers' V2 rotates adjacent pairs as complex numbers

    def route(self, g: GraphBuilder, moe, logits):
        config = moe.config
        scores = g.op("Softmax", logits, axis=-1)
        if config.topk_method == "group_limited_greedy":
            group_scores = g.op("ReduceMax", grouped(g, scores, config.n_group), g.const([-1]), keepdims=0)
            scores = limit_to_top_groups(g, scores, group_scores, config.topk_group, config.n_group,
                                         config.n_routed_experts, 0.0)
        topk_w, topk_idx = g.op("TopK", scores, g.const([config.num_experts_per_tok]), axis=-1, outputs=2)
        return topk_idx, g.op("Mul", topk_w, g.const(config.routed_scaling_factor, np.float32))
