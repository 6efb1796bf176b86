"""MoE routers: a layer's router logits -> the experts each token goes to and their weights, computed in the graph
at run time exactly as transformers computes them.

An architecture picks a router and its parameters from its config (toolchain/export/moe_layer.py ``MoeLayer``):

* ``SoftmaxTopK``: softmax over the experts, then the top k; optionally limited to the best groups (DeepSeek-V2's
  ``group_limited_greedy``: a group scores its best expert), renormalized over the k (``norm_topk_prob``, Qwen3-MoE)
  and scaled (``routed_scaling_factor``, DeepSeek-V2).
* ``SigmoidTopK``: sigmoid scores; the choice on the scores plus a correction bias (``e_score_correction_bias``)
  within the best groups (a group scores the sum of its two best), the weights the unbiased scores of the chosen
  experts, renormalized and scaled (DeepSeek-V3).

A new kind subclasses ``Router``: ``route`` gets ``RouterInputs``, the logits and transformers' router module (for
its own parameters) and, for routers that read the token ids, ``input_ids``. DeepSeek-V4's routers fit it so:
``sqrtsoftplus`` top-k is SigmoidTopK's arithmetic with sqrt(softplus(logits)) as the scores; ``hash`` routing
takes its experts from the gate's tid2eid table at ``input_ids`` (a Gather) and its weights from the scores there
(GatherElements), which needs the caller to pass input_ids through ``moe_layer.block``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from toolchain.export.graph import GraphBuilder
from toolchain.export.weights import HFModule


@dataclass(frozen=True)
class RouterInputs:
    logits: ir.Value  # [tokens, experts]: the layer input times the router's weight
    gate: HFModule  # transformers' router module, for a router's own parameters (a correction bias, a table)
    input_ids: ir.Value | None = None  # [batch, seq] int64, for routers that choose by token id; None: not given


@dataclass(frozen=True)
class GroupLimit:
    """Experts split evenly and in order into ``groups``; each token chooses among the experts of its ``chosen``
    best groups only (DeepSeek's n_group / topk_group)."""

    groups: int
    chosen: int


@dataclass(frozen=True)
class Router(ABC):
    top_k: int
    num_experts: int

    @abstractmethod
    def route(self, g: GraphBuilder, inputs: RouterInputs) -> tuple[ir.Value, ir.Value]:
        """(the chosen experts' indices [tokens, k] int64, their weights [tokens, k] float32)."""


@dataclass(frozen=True)
class SoftmaxTopK(Router):
    groups: GroupLimit | None = None  # a group scores its best expert; the others score 0 (DeepSeek-V2)
    normalize: bool = False  # the k weights divided by their sum (Qwen3-MoE's norm_topk_prob)
    scaling: float | None = None  # the weights times this (DeepSeek-V2's routed_scaling_factor, even at 1.0)

    def route(self, g: GraphBuilder, inputs: RouterInputs) -> tuple[ir.Value, ir.Value]:
        scores = g.op("Softmax", inputs.logits, axis=-1)
        if self.groups is not None:
            group_scores = g.op("ReduceMax", grouped(g, scores, self.groups.groups), g.const([-1]), keepdims=0)
            scores = limit_to_top_groups(g, scores, group_scores, self.groups, self.num_experts, 0.0)
        topk_w, topk_idx = g.op("TopK", scores, g.const([self.top_k]), axis=-1, outputs=2)
        if self.normalize:
            topk_w = g.op("Div", topk_w, g.op("ReduceSum", topk_w, g.const([-1]), keepdims=1))
        return topk_idx, _scaled(g, topk_w, self.scaling)


@dataclass(frozen=True)
class SigmoidTopK(Router):
    groups: GroupLimit  # a group scores the sum of its two best biased scores
    normalize: bool = True  # the k weights divided by their sum + 1e-20 (DeepSeek-V3's norm_topk_prob)
    scaling: float | None = None
    bias: str = "e_score_correction_bias"  # the router module's buffer added to the scores for the choice only

    def route(self, g: GraphBuilder, inputs: RouterInputs) -> tuple[ir.Value, ir.Value]:
        scores = g.op("Sigmoid", inputs.logits)
        biased = g.op("Add", scores, g.weight(self.bias, g.params.array(getattr(inputs.gate, self.bias))))
        top2, _ = g.op("TopK", grouped(g, biased, self.groups.groups), g.const([2]), axis=-1, outputs=2)
        group_scores = g.op("ReduceSum", top2, g.const([-1]), keepdims=0)
        # -inf outside the chosen groups, as transformers 5.24 (and DeepSeek's own inference code) masks them: a
        # biased score below zero inside them still wins over any expert outside
        choice = limit_to_top_groups(g, biased, group_scores, self.groups, self.num_experts, float("-inf"))
        _, topk_idx = g.op("TopK", choice, g.const([self.top_k]), axis=-1, outputs=2)
        topk_w = g.op("GatherElements", scores, topk_idx, axis=1)
        if self.normalize:
            total = g.op("Add", g.op("ReduceSum", topk_w, g.const([-1]), keepdims=1), g.const(1e-20, np.float32))
            topk_w = g.op("Div", topk_w, total)
        return topk_idx, _scaled(g, topk_w, self.scaling)


def _scaled(g: GraphBuilder, weights: ir.Value, scaling: float | None) -> ir.Value:
    return weights if scaling is None else g.op("Mul", weights, g.const(scaling, np.float32))


def limit_to_top_groups(g: GraphBuilder, scores, group_scores, limit: GroupLimit, num_experts: int, fill: float):
    """Set the scores of experts outside the ``limit.chosen`` best groups to ``fill``, as transformers' masked_fill
    does (0.0 for V2's softmax scores, -inf for V3's biased ones).

    scores: [tokens, experts]; group_scores: [tokens, groups] with experts split evenly and in order over groups.
    """
    _, group_idx = g.op("TopK", group_scores, g.const([limit.chosen]), axis=-1, outputs=2)
    zeros = g.op("ConstantOfShape", g.op("Shape", group_scores), value=ir.tensor(np.zeros(1, np.float32)))
    ones = g.op("ConstantOfShape", g.op("Shape", group_idx), value=ir.tensor(np.ones(1, np.float32)))
    group_mask = g.op("ScatterElements", zeros, group_idx, ones, axis=1)
    per_group = g.op("Expand", g.op("Unsqueeze", group_mask, g.const([-1])),
                     g.const([1, 1, num_experts // limit.groups]))
    expert_mask = g.op("Reshape", per_group, g.const([-1, num_experts]))
    return g.op("Where", g.op("Cast", expert_mask, to=ir.DataType.BOOL), scores, g.const(fill, np.float32))


def grouped(g: GraphBuilder, scores, num_groups: int):
    """[tokens, experts] -> [tokens, groups, experts/groups]."""
    return g.op("Reshape", scores, g.const([0, num_groups, -1]))
