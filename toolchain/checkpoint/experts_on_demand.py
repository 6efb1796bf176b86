"""A MoE layer's routed experts read from the checkpoint when the tokens hit them, a few at a time.

One DeepSeek-V3 MoE layer at real width holds 256 experts x 3 x 7168 x 2048 = 11.3 B parameters, 45 GB in fp32:
transformers' fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) cannot be built whole.
``ExpertsOnDemand`` takes its place in the MoE block (whose router, shared experts and forward stay transformers'
own) and computes what transformers' grouped_mm forward computes, bit for bit: the (token, slot) pairs sorted by
expert as it sorts them, each run of experts given to transformers' own experts module holding only those experts
(each expert's rows the same rows in the same order, so each expert's matmul is the same one), and the weighted
rows summed over the top-k slots by the same reduction. Only the experts hit are read, ``at_once`` at a time, and
each run's weights are gone before the next run's are read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


class ExpertsOnDemand(nn.Module):
    template: nn.Module

    def __init__(self, template: nn.Module, load: Callable[[list[int]], dict[str, torch.Tensor]], at_once: int):
        """``template``: transformers' experts module of the layer (on the meta device; its class, config and
        activation are used, never its weights); ``load(experts)``: the fused tensors of those experts, in that
        order, [len(experts), ...]; ``at_once``: experts built at a time."""
        super().__init__()
        implementation = getattr(template.config, "_experts_implementation", None)
        if implementation != "grouped_mm" or getattr(template, "has_bias", False) \
                or getattr(template, "is_transposed", False) or not getattr(template, "has_gate", True):
            raise ValueError(f"experts on demand compute transformers' grouped_mm experts with fused gate_up_proj "
                             f"and down_proj, not {type(template).__name__} with {implementation}")
        self.__dict__["template"] = template  # not a submodule: its meta weights are no part of the state dict
        self.load = load
        self.at_once = max(1, at_once)
        self.experts_read = 0  # experts built so far (what a test or a log can count)

    def _subset(self, experts: list[int]) -> nn.Module:
        """transformers' experts module holding ``experts`` only, as experts 0..n-1."""
        module = copy.copy(self.template)
        module._parameters = {}
        for name, tensor in self.load(experts).items():
            module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        setattr(module, "num_experts", len(experts))  # noqa: B010  (nn.Module's attribute type is Tensor | Module)
        self.experts_read += len(experts)
        return module

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        # transformers' grouped_mm forward sorts the pairs by expert the same way: each expert's rows in this order
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        rows, weights = hidden_states[perm // top_k], top_k_weights.reshape(-1)[perm]
        hit, counts = torch.unique_consecutive(expert_ids, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        weighted = torch.empty(len(expert_ids), hidden_states.shape[-1], dtype=hidden_states.dtype)
        for first in range(0, len(hit), self.at_once):
            run = hit[first:first + self.at_once]
            start, stop = (ends[first - 1] if first else 0), ends[first + len(run) - 1]
            local = torch.searchsorted(run, expert_ids[start:stop])  # the run's experts as 0..n-1, still sorted
            # transformers' module sorts the ids again, and torch.sort is not stable: it would reorder each expert's
            # rows, and a row's matmul result depends on its place among them. Its sort is deterministic, so the
            # rows go in where that sort puts them back in this order.
            inner = torch.sort(local)[1]
            order = torch.empty_like(inner)
            order[inner] = torch.arange(len(inner))
            # one slot per row: transformers' module returns each row's weighted expert output
            out = self._subset(run.tolist())(rows[start:stop][order], local[:, None], weights[start:stop][order, None])
            weighted[start:stop] = out[inner]
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(perm))
        return weighted[inverse].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)
