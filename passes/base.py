"""What every dstc pass reports: onnx_ir's PassResult plus counts, and the near-misses behind a count of zero.

A dstc pass is an ``onnx_ir.passes.InPlacePass`` whose ``call`` returns a :class:`CountedResult`. Passes that
skip candidates for a reason (a shared weight, a non-inverse permutation) expose those reasons through
``near_misses(model)`` so that a failed expectation can say *why* a rewrite did not happen.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping

import onnx_ir as ir


@dataclasses.dataclass
class CountedResult(ir.passes.PassResult):
    """``PassResult`` with named counts (e.g. ``{"conv": 2}`` fusions made); zero counts are dropped."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = {key: int(n) for key, n in self.counts.items() if n}


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A candidate a pass looked at and rejected: which rule, where, and why.

    ``score`` orders near-misses: higher is closer to having fired.
    """

    rule: str
    where: str
    reason: str
    score: int = 0

    def __str__(self) -> str:
        return f"{self.rule} at {self.where}: {self.reason}"


def node_label(node: ir.Node) -> str:
    """``Op 'name'`` for messages; unnamed nodes are named after their first output."""
    name = node.name or (node.outputs[0].name if node.outputs else "") or "?"
    return f"{node.op_type} '{name}'"


class CountingPass(ir.passes.InPlacePass):
    """An in-place pass whose subclasses implement :meth:`apply` and return their counts.

    ``modified`` is true exactly when some count is non-zero, so a pass that changes something must count it.
    Subclasses report skipped candidates with :meth:`near_miss` while they run.
    """

    def __init__(self) -> None:
        super().__init__()
        self._near_misses: list[NearMiss] = []

    @abc.abstractmethod
    def apply(self, model: ir.Model) -> Mapping[str, int]:
        """Rewrite ``model`` in place and return what was done, by name."""

    def call(self, model: ir.Model) -> CountedResult:
        self._near_misses = []
        result = CountedResult(model, False, dict(self.apply(model)))
        result.modified = bool(result.counts)
        return result

    def near_miss(self, rule: str, node: ir.Node, reason: str, score: int = 0) -> None:
        self._near_misses.append(NearMiss(rule, node_label(node), reason, score))

    def near_misses(self, model: ir.Model) -> list[NearMiss]:
        """Candidates rejected during the last run, closest first."""
        del model  # recorded while running
        return sorted(self._near_misses, key=lambda m: -m.score)
