"""MoE routers: a layer's router logits -> the experts each token goes to and their weights, computed in the graph
at run time exactly as transformers computes them.

An architecture picks a router and its parameters from its config (toolchain/export/moe_layer.py ``MoeLayer``):

* ``SoftmaxTopK``: softmax over the experts, then the top k; optionally limited to the best groups (DeepSeek-V2's
  ``group_limited_greedy``: a group scores its best expert), renormalized over the k (``norm_topk_prob``, Qwen3-MoE)
  and scaled (``routed_scaling_factor``, DeepSeek-V2).
* ``BiasedTopK``: scores by a score function (sigmoid, DeepSeek-V3; sqrt(softplus), DeepSeek-V4), the choice on
  the scores plus a correction bias (``e_score_correction_bias``), optionally within the best groups (a group
  scores the sum of its two best), the weights the unbiased scores of the chosen experts, renormalized and scaled.
* ``HashRouter``: the experts a frozen table gives each token id (DeepSeek-V4's ``tid2eid[input_ids]``, in its
  ``hash_moe`` layers), weighted as BiasedTopK weighs its choice; it needs the token ids (``RouterInputs.input_ids``).

A new kind subclasses ``Router``: ``route`` gets ``RouterInputs``, the logits and transformers' router module (for
its own parameters) and, for routers that read the token ids, ``input_ids``. The chosen indices are int64 values
that the expert lowering consumes directly (a TopK's indices, or the hash table's Gather), which is how the
runtimes find them (toolchain/runtime/routing.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from toolchain.export.graph import GraphBuilder
from toolchain.export.weights import HFModule, LazyArray


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


SCORINGS = ("sigmoid", "sqrtsoftplus")


@dataclass(frozen=True)
class BiasedTopK(Router):
    groups: GroupLimit | None = None  # a group scores the sum of its two best biased scores; None: no group limit
    normalize: bool = True  # the k weights divided by their sum + 1e-20 (DeepSeek-V3's norm_topk_prob)
    scaling: float | None = None
    bias: str = "e_score_correction_bias"  # the router module's buffer added to the scores for the choice only
    scoring: str = "sigmoid"  # SCORINGS

    def route(self, g: GraphBuilder, inputs: RouterInputs) -> tuple[ir.Value, ir.Value]:
        scores = router_scores(g, inputs.logits, self.scoring)
        biased = g.op("Add", scores, g.weight(self.bias, g.params.array(getattr(inputs.gate, self.bias))))
        choice = biased
        if self.groups is not None:
            top2, _ = g.op("TopK", grouped(g, biased, self.groups.groups), g.const([2]), axis=-1, outputs=2)
            group_scores = g.op("ReduceSum", top2, g.const([-1]), keepdims=0)
            # -inf outside the chosen groups, as transformers 5.24 (and DeepSeek's own inference code) masks them: a
            # biased score below zero inside them still wins over any expert outside
            choice = limit_to_top_groups(g, biased, group_scores, self.groups, self.num_experts, float("-inf"))
        _, topk_idx = g.op("TopK", choice, g.const([self.top_k]), axis=-1, outputs=2)
        return topk_idx, _weighed(g, scores, topk_idx, self.normalize, self.scaling)


@dataclass(frozen=True)
class HashRouter(Router):
    normalize: bool = True
    scaling: float | None = None
    table: str = "tid2eid"  # the router module's [vocab, top_k] expert ids per token id
    scoring: str = "sqrtsoftplus"  # SCORINGS

    def route(self, g: GraphBuilder, inputs: RouterInputs) -> tuple[ir.Value, ir.Value]:
        if inputs.input_ids is None:
            raise ValueError("a hash router chooses by token id: the MoE block needs input_ids")
        # int64 as stored: the ids feed the experts' dispatch as a TopK's indices would, and no weight compression
        # touches an integer table
        table = g.weight(self.table, integer_table(g.params.array(getattr(inputs.gate, self.table))))
        topk_idx = g.op("Gather", table, g.op("Reshape", inputs.input_ids, g.const([-1])), axis=0)
        scores = router_scores(g, inputs.logits, self.scoring)
        return topk_idx, _weighed(g, scores, topk_idx, self.normalize, self.scaling)


def integer_table(array) -> np.ndarray:
    """A small integer tensor's values as int64 numpy: read now from a checkpoint (where it is int64), or from a
    loaded model's float32 copy (exact for small integers)."""
    if isinstance(array, LazyArray) and array.read is not None:
        return array.read().to(torch.int64).numpy()
    return np.asarray(array).astype(np.int64)


def _weighed(g: GraphBuilder, scores, topk_idx, normalize: bool, scaling: float | None) -> ir.Value:
    """The unbiased scores of the chosen experts, divided by their sum + 1e-20 (``normalize``) and scaled."""
    topk_w = g.op("GatherElements", scores, topk_idx, axis=1)
    if normalize:
        total = g.op("Add", g.op("ReduceSum", topk_w, g.const([-1]), keepdims=1), g.const(1e-20, np.float32))
        topk_w = g.op("Div", topk_w, total)
    return _scaled(g, topk_w, scaling)


def router_scores(g: GraphBuilder, logits, scoring: str):
    """The router's scores (SCORINGS): sigmoid(logits), or sqrt(softplus(logits)) (DeepSeek-V4's)."""
    if scoring == "sqrtsoftplus":
        return g.op("Sqrt", softplus(g, logits))
    if scoring == "sigmoid":
        return g.op("Sigmoid", logits)
    raise ValueError(f"unknown router scoring {scoring!r} (known: {', '.join(SCORINGS)})")


def softplus(g: GraphBuilder, x):
    """torch's softplus to rounding for every x: x above 20 (its threshold), else max(x, 0) + log1p(exp(-|x|)).
    ONNX's Softplus is not (ONNX Runtime's overflows to inf above ~88, OpenVINO's is 0 below -20 and slightly
    negative at -20, whose sqrt is NaN), nor is OpenVINO's Log near 1; log1p(y), y in (0, 1], is its series
    2 atanh(z) = 2 (z + z^3/3 + ... + z^15/15), z = y / (2 + y) <= 1/3 (truncation below 1e-8 relative)."""
    y = g.op("Exp", g.op("Neg", g.op("Abs", x)))
    z = g.op("Div", y, g.op("Add", y, g.const(2.0, np.float32)))
    z2 = g.op("Mul", z, z)
    series = g.const(1.0 / 15, np.float32)
    for k in range(13, 0, -2):
        series = g.op("Add", g.op("Mul", series, z2), g.const(1.0 / k, np.float32))
    log1p = g.op("Mul", g.op("Mul", z, series), g.const(2.0, np.float32))
    soft = g.op("Add", g.op("Max", x, g.const(0.0, np.float32)), log1p)
    return g.op("Where", g.op("Greater", x, g.const(20.0, np.float32)), x, soft)


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
