"""DeepSeek-V2 / V2-Lite: MLA (q_lora optional, complex-form RoPE), softmax scores, greedy or group-limited top-k."""

from __future__ import annotations

from toolchain.errors import UnsupportedModelError
from toolchain.export.deepseek import DeepseekArchitecture
from toolchain.export.moe_layer import MoeLayer
from toolchain.export.routers import GroupLimit, SoftmaxTopK


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

    def moe(self, config, layer: int) -> MoeLayer:
        # norm_topk_prob is V3's: transformers' V2 router ignores it
        groups = GroupLimit(config.n_group, config.topk_group) if config.topk_method == "group_limited_greedy" \
            else None
        return MoeLayer(SoftmaxTopK(config.num_experts_per_tok, config.n_routed_experts, groups=groups,
                                    scaling=config.routed_scaling_factor), shared_experts="shared_experts")
