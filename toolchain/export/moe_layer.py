"""The mixture-of-experts layer as a component: router, routed experts in the chosen lowering, optional shared
experts. An architecture whose layers may be MoE derives from ``MoeArchitecture`` and declares ``moe(config)``
(its router and shared experts, ``MoeLayer``) and ``moe_layers(config)`` (which layers); nothing else about MoE is
family-specific.

transformers' MoE modules share one layout, which this reads: the router module ``gate`` with its ``weight``
[experts, hidden], the routed ``experts`` (fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]) and, where the
family has them, a gated MLP of shared experts added to the routed sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from toolchain.export import blocks, moe
from toolchain.export.graph import GraphBuilder
from toolchain.export.routers import Router, RouterInputs
from toolchain.export.weights import HFModule


@dataclass(frozen=True)
class MoeLayer:
    router: Router
    shared_experts: str | None = None  # the MoE module's attribute holding the shared experts' MLP; None: none
    swiglu_limit: float | None = None  # routed and shared experts' clipped SwiGLU (DeepSeek-V4, blocks.gated_mlp)


def block(g: GraphBuilder, layer: MoeLayer, lowering: str, module: HFModule, h: ir.Value,
          input_ids: ir.Value | None = None) -> ir.Value:
    """The MoE layer's output for ``h`` [batch, seq, hidden]. ``input_ids`` [batch, seq] reach routers that choose
    by token id (DeepSeek-V4's hash router; the shared decoder passes none)."""
    x2d = g.op("Reshape", h, g.const([-1, module.gate.weight.shape[1]]))  # [tokens, hidden]
    with g.scope("router"), g.role("router"):
        logits = blocks.matmul_weight(g, x2d, g.params.array(module.gate.weight), "gate")
        topk_idx, topk_w = layer.router.route(g, RouterInputs(logits, module.gate, input_ids))
    with g.role("routed_expert"):
        routed = moe.routed_experts(g, lowering, x2d, topk_idx, topk_w, module.experts, layer.router.top_k,
                                    limit=layer.swiglu_limit)
    routed = g.op("Reshape", routed, g.op("Shape", h))
    if layer.shared_experts is None:
        return routed
    with g.role("shared_expert"):
        shared = blocks.mlp_module(g, h, getattr(module, layer.shared_experts), layer.shared_experts,
                                   limit=layer.swiglu_limit)
    return g.op("Add", routed, shared)


class MoeArchitecture:
    """The MoE half of an architecture (toolchain/export/decoder.py ``Architecture``): its ``mlp`` builds the MoE
    block in the layers ``moe_layers`` names and transformers' dense gated MLP in the others."""

    moe_lowering: str | None = "dispatch"  # moe.with_lowering gives a copy with another (moe.LOWERINGS)
    lowerings: tuple[str, ...] = moe.LOWERINGS  # the lowerings the family's experts are built in

    def moe(self, config, layer: int) -> MoeLayer:
        """The family's MoE layer ``layer`` for ``config``: router kind and parameters, shared experts."""
        raise NotImplementedError

    def moe_layers(self, config) -> list[int]:
        """Indices of the layers whose MLP is a mixture of experts (``config``: a transformers config or the
        config.json of an artifact, ``config_value``)."""
        raise NotImplementedError

    def routed_experts(self, config) -> int:
        """The most routed experts of any MoE layer (0 without MoE layers)."""
        return max((self.moe(config, layer).router.num_experts for layer in self.moe_layers(config)), default=0)

    def mlp(self, g: GraphBuilder, mlp: HFModule, h: ir.Value) -> ir.Value:
        # the family's own rule decides, not the module's attributes: a rule that disagrees with the layers
        # transformers built fails here (the module has no router) instead of exporting a wrong graph
        layer = g.layer
        if layer is None or layer not in self.moe_layers(g.config):
            return blocks.mlp_module(g, h, mlp, blocks.DENSE_MLP)
        return block(g, self.moe(g.config, layer), self.moe_lowering or "dispatch", mlp, h)


def config_value(config, name: str):
    """A config field of a transformers config or of its config.json (a runtime reads the artifact's file)."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)
