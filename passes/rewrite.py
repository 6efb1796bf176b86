"""Passes made of onnxscript rewrite rules: applied to a fixpoint, counted per rule, near-misses traced.

onnxscript's ``RewritePass`` reports only ``modified``; this wraps each rule's replacement function to count
applications per rule name, and on request replays the rules with onnxscript's ``MatchingTracer`` (a dry run,
on a clone because the tracer still updates opset imports) to report the closest failed match per rule.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import onnx_ir as ir
from onnxscript.rewriter import MatchingTracer, MatchResult, MatchStatus, RewriteRule, RewriteRuleSet
from onnxscript.rewriter import RewriteRuleClassBase

from passes.base import CountingPass, NearMiss, node_label
from passes.graph import drop_orphaned_initializers, initializers_in_use


def _counted_rule(rule: RewriteRuleClassBase, tally: collections.Counter) -> RewriteRule:
    """``rule.rule()``, with the replacement counting its successful applications in ``tally[rule.name]``."""

    def rewrite(op, *args, **kwargs):
        replacement = rule.rewrite(op, *args, **kwargs)
        if replacement is not None and replacement is not False and not isinstance(replacement, MatchResult):
            tally[rule.name] += 1
        return replacement

    return RewriteRule(
        rule.pattern,
        rewrite,
        rule.check,
        name=rule.name,
        remove_nodes=rule.remove_nodes,
        graph_pre_visitor=rule.setup,
        graph_post_visitor=rule.cleanup,
        as_function=rule.as_function,
    )


class RewriteRulesPass(CountingPass):
    """Apply rewrite rules until none fires (at most ``max_rounds`` sweeps); counts are keyed by rule name.

    Initializers that only the rewritten nodes used are dropped, so a fusion leaves no orphaned weights.
    """

    max_rounds = 8

    def __init__(self, rules: Sequence[RewriteRuleClassBase], *, commute: bool = False) -> None:
        super().__init__()
        if not rules:
            raise ValueError("a rewrite pass needs at least one rule")
        self.rules = list(rules)
        self.commute = commute

    def _rule_set(self, tally: collections.Counter) -> RewriteRuleSet:
        return RewriteRuleSet([_counted_rule(rule, tally) for rule in self.rules], commute=self.commute)

    def apply(self, model: ir.Model) -> collections.Counter:
        tally: collections.Counter = collections.Counter()
        rule_set = self._rule_set(tally)
        used_before = initializers_in_use(model.graph)
        for _ in range(self.max_rounds):
            if not rule_set.apply_to_model(model):
                break
        drop_orphaned_initializers(model.graph, used_before)
        return tally

    def near_misses(self, model: ir.Model) -> list[NearMiss]:
        """The best-scoring failed match of each rule on ``model`` (left untouched), closest first."""
        tracer = MatchingTracer()
        self._rule_set(collections.Counter()).apply_to_model(model.clone(), tracer=tracer)
        found = {(m.rule, m.where, m.reason): m for m in super().near_misses(model)}
        for rule, infos in tracer.best_matches_map.items():
            for info in infos:  # commuted variants of a rule report the same miss: keep one
                if info.status is not MatchStatus.SUCCESS:
                    reason = _reason(info.match_result, info.root_node)
                    miss = NearMiss(str(rule), node_label(info.root_node), reason, info.score())
                    found.setdefault((miss.rule, miss.where, miss.reason), miss)
        return sorted(found.values(), key=lambda m: -m.score)


def _reason(match: MatchResult, root: ir.Node) -> str:
    """The matcher's reason, naming the escaping value when it only says that matched nodes have other uses."""
    reason = match.reason or "match failed without a reason"
    if reason.startswith("Matched nodes have other uses"):
        matched = set(match.nodes)
        for node in match.nodes:
            if node is root:
                continue  # the root's outputs are what the rewrite replaces
            for value in node.outputs:
                if value.is_graph_output():
                    return f"{reason} ({value.name!r} is a graph output)"
                outside = [user for user in value.consumers() if user not in matched]
                if outside:
                    return f"{reason} ({value.name!r} is also used by {node_label(outside[0])})"
    return reason
