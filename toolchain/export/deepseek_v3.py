"""DeepSeek-V3 / R1: MLA with q_lora, sigmoid scores with a bias-corrected, group-limited top-k choice."""

from __future__ import annotations

from toolchain.export.deepseek import DeepseekArchitecture
from toolchain.export.moe_layer import MoeLayer
from toolchain.export.routers import BiasedTopK, GroupLimit


class DeepseekV3Architecture(DeepseekArchitecture):
    model_types: tuple[str, ...] = ("deepseek_v3",)
    exports_mtp = True  # one MTP layer after the decoder layers (toolchain/export/mtp_reference.py)
    mtp_wiring: str | None = "layer"
    mtp_layer_classes: tuple[str, str, str] | None = (
        "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3RMSNorm")

    hub_layout = "fp8"

    def rope_interleaved(self, config) -> bool:
        return bool(config.rope_interleave)

    def moe(self, config, layer: int) -> MoeLayer:
        router = BiasedTopK(config.num_experts_per_tok, config.n_routed_experts,
                            groups=GroupLimit(config.n_group, config.topk_group),
                            normalize=bool(config.norm_topk_prob), scaling=config.routed_scaling_factor)
        return MoeLayer(router, shared_experts="shared_experts")
