"""Which precision each weight gets: the scheme's precision for the body of the model, and a stated policy for
the weights that are more sensitive than their size suggests.

Roles: ``embeddings``, ``lm_head``, ``router``, ``shared_expert``, ``routed_expert``, ``attention`` and ``mlp``
(dense layers), as the exporter wrote them on each initializer (``dstc.role`` / ``dstc.layer``, from
``GraphBuilder.role``): the one source. A weight without one (a graph exported by a dstc older than the roles, or
not by dstc) is refused in one line, not guessed from its name: export the checkpoint again.

Defaults, and why (numbers in benchmarks/compression.py):

* embeddings and lm_head: INT8 per channel (per row for the table). lm_head sets every logit; with INT4 its
  error goes straight into the next-token distribution, and the table's error into every token's input. At
  real vocabularies they are a few percent of the weights, so INT8 costs little size. ``int4`` and ``fp32`` are
  options.
* MoE routers: FP32. A router is hidden x experts (0.1 % of a DeepSeek-V3 layer's weights), and a small change in
  its logits swaps the chosen experts, which changes the token's whole MLP output: compression.json measures
  that as routing agreement. ``int8`` or ``scheme`` (the body's precision) on request.
* shared experts: the scheme's precision by default, like routed experts; ``int8`` keeps them at 8 bits. They
  run on every token (a routed expert on top_k / n_experts of them), so their error reaches every token, but
  they are 0.4 % of a V3 MoE layer's weights and the measured gain from 8 bits is small (see the benchmark).
* named weights (``int8_scope``, a recipe's ``compress.int8``): INT8 per channel, for the few small weights
  upstream of a router whose INT4 error flips its expert choice (docs/compression.md "INT4 fidelity"); ``ignored_scope``
  (fp32) wins over it, and it over the roles.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import get_args

from toolchain.errors import InputError
from toolchain.interface.graph import ROLE
from toolchain.recipe import CompressSection


def _choices(field: str) -> tuple[str, ...]:
    """The values a recipe's compress section allows for ``field`` (its Literal): spelled there only."""
    return get_args(CompressSection.model_fields[field].annotation)


SCHEMES = _choices("scheme")
# Precisions a weight can end up in: "int4" (NNCF, grouped), "int8" (NNCF per channel, or the per-head pass's
# per-channel/per-row form in the int8-per-head scheme), "int8-per-head" (the pass), "fp32" (untouched).
# "shipped": the checkpoint's own FP8/FP4 codes where it stores them, every other weight as exported
# (toolchain/compress/shipped.py plans it from the checkpoint)
SCHEME_PRECISION = {"int4-grouped": "int4", "int8-per-channel": "int8", "int8-per-head": "int8-per-head",
                    "shipped": "shipped"}


@dataclass(frozen=True)
class Policy:
    scheme: str
    embeddings: str = "int8"
    lm_head: str = "int8"
    router: str = "fp32"
    shared_experts: str = "scheme"
    ignored_scope: tuple[str, ...] = ()
    int8_scope: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise InputError(f"unknown scheme {self.scheme!r}; schemes: {', '.join(SCHEMES)}")
        for name in ("embeddings", "lm_head", "router", "shared_experts"):
            value, choices = getattr(self, name), _choices(name)
            if value not in choices:
                raise InputError(f"{name} policy {value!r} is not one of {', '.join(choices)}")
        for what, scope in (("ignored scope", self.ignored_scope), ("int8 scope", self.int8_scope)):
            for pattern in scope:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise InputError(f"{what} pattern {pattern!r} is not a regular expression: {e}") from None

    @classmethod
    def of(cls, section: CompressSection) -> Policy:
        """The policy a recipe's compress section states."""
        return cls(section.scheme, embeddings=section.embeddings, lm_head=section.lm_head, router=section.router,
                   shared_experts=section.shared_experts, ignored_scope=tuple(section.ignore),
                   int8_scope=tuple(section.int8))

    def ignored(self, weight_name: str, node_name: str) -> bool:
        return _matches(self.ignored_scope, weight_name, node_name)

    def precision(self, weight_name: str, node_name: str, role: str | None) -> str:
        """The precision of a weight; ``role``: what the exporter recorded on it (module doc)."""
        if role is None:
            raise InputError(f"weight {weight_name} has no {ROLE} (the role dstc's exporter records on each weight): "
                             f"the graph comes from an older dstc or another exporter; export the checkpoint again")
        body = SCHEME_PRECISION[self.scheme]
        if self.ignored(weight_name, node_name):
            return "fp32"
        if _matches(self.int8_scope, weight_name, node_name):
            choice = "int8"
        else:
            choice = {"embeddings": self.embeddings, "lm_head": self.lm_head, "router": self.router,
                      "shared_expert": self.shared_experts}.get(role, "scheme")
        if choice == "scheme":
            return body
        if choice == "int8" and body == "int8-per-head":
            return "int8-per-head"  # the pass quantizes weights without heads per channel (tables per row)
        return choice

    def plan(self, weights: Iterable) -> dict[str, str]:
        """Weights (``name``, consumer ``node``, ``role``; toolchain/compress/engine.py) -> weight name ->
        precision."""
        return {w.name: self.precision(w.name, w.node, w.role) for w in weights}

    def as_dict(self) -> dict:
        return {"embeddings": self.embeddings, "lm_head": self.lm_head, "router": self.router,
                "shared_experts": self.shared_experts, "ignored_scope": list(self.ignored_scope),
                "int8_scope": list(self.int8_scope)}


def _matches(scope: tuple[str, ...], weight_name: str, node_name: str) -> bool:
    """A pattern matches when it equals, or is a regular expression found in, the weight or node name."""
    return any(p in (weight_name, node_name) or re.search(p, weight_name) or re.search(p, node_name) for p in scope)
