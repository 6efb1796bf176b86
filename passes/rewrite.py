"""Passes made of onnxscript rewrite rules: applied to a fixpoint, counted per rule, near-misses traced.

onnxscript's ``RewritePass`` reports only ``modified``; this wraps each rule's replacement function to count
applications per rule name, and on request replays the rules with onnxscript's ``MatchingTracer`` (a dry run,
on a clone because the tracer still updates opset imports) to report the closest failed match per rule.

:class:`FusionRule` is the base of the LLM fusions (rotary embeddings, attention, rotate_half): rules whose
rewrites share values (one cos/sin cache for all layers), leave nodes outside their match unused (the cos/sin
tables every layer reads), and name their nodes after their place in the graph.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import (
    MatchingTracer,
    MatchResult,
    MatchStatus,
    RewriteRule,
    RewriteRuleClassBase,
    RewriteRuleSet,
)

from passes.base import CountingPass, NearMiss, node_label
from passes.graph import Names, bypass, drop_orphaned_initializers, initializers_in_use, remove_dead


class GraphEdit:
    """What the fusion rules of one pass did to the main graph during one sweep of the rule set.

    ``shared`` holds what all rewrites of the graph share (e.g. the cos/sin caches); ``dead`` the nodes that
    may be unused once the rewrites are done; ``outputs`` the values each rewrite returned, with the name,
    type and shape the rule gave them; ``replaced`` the (old, new) values a rewrite replaces besides its
    pattern's outputs (see :meth:`replace`).
    """

    def __init__(self, model: ir.Model) -> None:
        self.model = model
        self.graph = model.graph
        self.names = Names(self.graph)
        self.used_before = initializers_in_use(self.graph)
        self.consts: dict[tuple, ir.Value] = {}
        self.shared: dict[object, Any] = {}  # each rule knows the type of what it keeps under its keys
        self.dead: list[ir.Node] = []
        self.outputs: list[tuple[ir.Value, str | None, ir.TypeProtocol | None, ir.Shape | None]] = []
        self.replaced: list[tuple[ir.Value, ir.Value]] = []
        self.rules: list[FusionRule] = []  # those that rewrote something, in order

    def replace(self, old: ir.Value, new: ir.Value) -> None:
        """Make ``new`` take the place of ``old`` after the sweep, graph output name included: for a value of the
        match that is no output of its pattern (onnxscript finds a pattern's outputs after the first from the
        whole graph when they are reached only through an ``OrValue``, as the KV cache Concats of an attention
        are, which is slow on large graphs)."""
        self.replaced.append((old, new))

    def finish(self) -> None:
        """After the sweep: the returned values get back what their rule gave them (the rewriter names a value
        that replaces another after it, and copies its type and shape; a graph output keeps its name), the
        :meth:`replace` d values are replaced, the rules' own finishing steps run, the nodes left unused go with
        the initializers only they read, and the graph is sorted."""
        if not self.rules:
            return
        for value, name, type_, shape in self.outputs:
            if not value.is_graph_output():
                value.name = name
            value.type, value.shape, value.const_value = type_, shape, None
        for old, new in self.replaced:
            bypass(self.graph, old, new)
        for rule in self.rules:
            rule.finish(self)
        remove_dead(self.graph, self.dead)
        drop_orphaned_initializers(self.graph, self.used_before)
        self.graph.sort()


class Emitter:
    """Creates the nodes of one replacement through the rewriter's builder ``op``, named
    ``<scope><name or op type>`` (outputs ``<node>/out``, ``<node>/out<i>``) with names the graph does not use,
    and small constants as initializers ``fusion/<name>`` shared by every rewrite of the graph."""

    def __init__(self, op, edit: GraphEdit, scope: str) -> None:
        self._op, self._edit, self._scope = op, edit, scope

    def node(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: Mapping[str, object] | None = None,
        *,
        domain: str = "",
        num_outputs: int = 1,
        name: str | None = None,
    ) -> ir.Node:
        names = self._edit.names
        base = names.fresh(f"{self._scope}{name or op_type}")
        outputs = [names.fresh(f"{base}/out{i}" if num_outputs > 1 else f"{base}/out") for i in range(num_outputs)]
        values = self._op.op(op_type, *inputs, _domain=domain, _outputs=outputs, _name=base, **dict(attributes or {}))
        return (values if num_outputs == 1 else values[0]).producer()

    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "", name: str | None = None,
           **attributes) -> ir.Value:
        """One-output shorthand for :meth:`node`."""
        return self.node(op_type, inputs, attributes, domain=domain, name=name).outputs[0]

    def const(self, value, dtype=np.int64, name: str = "const") -> ir.Value:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._edit.consts:
            tensor = ir.tensor(np.ascontiguousarray(array).reshape(array.shape),
                               name=self._edit.names.fresh(f"fusion/{name}"))
            self._edit.consts[key] = self._op.initializer(tensor)
        return self._edit.consts[key]


def scope_of(node: ir.Node) -> str:
    """The name prefix of ``node`` (its name up to the last '/'), for naming the nodes that replace it."""
    name = node.name or ""
    return name.rsplit("/", 1)[0] + "/" if "/" in name else ""


class _Session:
    """The state the fusion rules of one pass share while a rule set sweeps the model."""

    def __init__(self, *, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.depth = 0  # graph visits in progress (every compiled rule's setup counts one)
        self.edit: GraphEdit | None = None
        self.declined: set[tuple[ir.Node, str]] = set()
        self.anchors: dict[tuple[ir.Node, str], ir.Node] = {}  # the node a failed check's near-miss names

    def open(self) -> None:
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.edit is not None:
            if not self.dry_run:
                self.edit.finish()
            self.edit = None


class FusionRule(RewriteRuleClassBase):
    """An onnxscript rewrite rule for a fusion: ``pattern`` finds the candidates, ``check`` decides (a failed
    check is a near-miss with its reason; :meth:`decline` says a match is no candidate after all), ``rewrite``
    builds the replacement with :meth:`emit`. Around the rewriter, :class:`RewriteRulesPass`:

    * leaves the matched nodes in place (``remove_nodes=False``) and, after the sweep, removes those of them and
      of ``self.edit.dead`` that nothing reads any more, with the initializers only they read: a pattern may
      take in nodes other matches share (its check says which must have no other use), and the cos/sin tables
      every layer reads go with the last layer's rotation;
    * gives every rewrite of the main graph one :class:`GraphEdit` (``self.edit``) for the values they share;
    * names what a rewrite makes after the scope of ``self.anchor`` (by default the match's root), and keeps the
      names it gave the values that replace others (the rewriter would rename them after the replaced ones);
      the new nodes carry no rule-name metadata;
    * counts each rewrite under ``self.counted`` (by default the rule's name; ``rewrite`` sets it when a rule
      makes more than one kind), and sorts the graph after a sweep that rewrote something.

    A near-miss names ``self.where`` (by default the root). Only the main graph is rewritten: the initializers
    replacements add cannot live in functions. A rule with ``variants`` (a sequence of settings) is compiled once
    per setting, ``self.variant`` set to it while its ``pattern`` is built.
    """

    variants: Sequence[object] = (None,)
    variant: object = None

    # RewriteRulesPass binds session before the sweep; enter() binds the others before every check.
    session: _Session
    edit: GraphEdit
    root: ir.Node
    anchor: ir.Node
    where: ir.Node

    def __init__(self, name: str) -> None:
        super().__init__(name, remove_nodes=False)
        self.matched: list[ir.Node] = []
        self.counted: tuple[str, ...] = ()

    def setup(self) -> None:
        self.session.open()

    def cleanup(self) -> None:
        self.session.close()

    def enter(self, context) -> MatchResult:
        """Before ``check``: binds ``self.edit``, ``self.root`` (= ``self.anchor`` = ``self.where``) and
        ``self.matched``."""
        self.root = self.anchor = self.where = context.root
        self.matched, self.counted = list(context.nodes), (self.name,)
        if context.graph_or_function is not context.model.graph:
            return MatchResult().fail("fusions rewrite the main graph only")
        if self.session.edit is None:
            self.session.edit = GraphEdit(context.model)
        self.edit = self.session.edit
        return MatchResult()

    def decline(self, reason: str) -> MatchResult:
        """A failed check that is no near-miss: the match is not a candidate (``reason`` says why)."""
        self.session.declined.add((self.root, reason))
        return MatchResult().fail(reason)

    def emit(self, op) -> Emitter:
        return Emitter(op, self.edit, scope_of(self.anchor))

    def finish(self, edit: GraphEdit) -> None:
        """Once per sweep that rewrote something, before the dead nodes go (e.g. opset changes)."""


def _variant_rules(rule: RewriteRuleClassBase, tally: collections.Counter, commute: bool) -> list[RewriteRule]:
    """``rule.rule()``, commuted when asked, with the replacement counting its successful applications in
    ``tally`` (under ``rule.name``, or ``rule.counted`` for a :class:`FusionRule`)."""
    fusion = rule if isinstance(rule, FusionRule) else None

    def check(context, **bindings):
        if fusion is None:
            return rule.check(context, **bindings)
        result = fusion.enter(context)
        if result:
            result = fusion.check(context, **bindings)
        if not result and fusion.session.dry_run:
            fusion.session.anchors[(context.root, getattr(result, "reason", ""))] = fusion.where
        return result

    def rewrite(op, *args, **kwargs):
        replacement = rule.rewrite(op, *args, **kwargs)
        if replacement is None or replacement is False or isinstance(replacement, MatchResult):
            return replacement
        if fusion is not None:
            edit = fusion.edit
            values = list(replacement) if isinstance(replacement, Sequence) else [replacement]
            edit.outputs += [(v, v.name, v.type, v.shape) for v in values]
            edit.dead += fusion.matched
            if fusion not in edit.rules:
                edit.rules.append(fusion)
            tally.update(fusion.counted)
        else:
            tally[rule.name] += 1
        return replacement

    rewrite_rule = RewriteRule(
        rule.pattern,
        rewrite,
        check,
        name=None if fusion is not None else rule.name,  # a name would be written into every new node's metadata
        remove_nodes=rule.remove_nodes,
        graph_pre_visitor=rule.setup,
        graph_post_visitor=rule.cleanup,
        as_function=rule.as_function,
    )
    return list(rewrite_rule.commute()) if commute else [rewrite_rule]


class RewriteRulesPass(CountingPass):
    """Apply rewrite rules until none fires (at most ``max_rounds`` sweeps); counts are keyed by rule name.

    Initializers that only the rewritten nodes used are dropped, so a fusion leaves no orphaned weights.
    Rules may be :class:`FusionRule` s (see there).
    """

    max_rounds = 8

    def __init__(self, rules: Sequence[RewriteRuleClassBase], *, commute: bool = False) -> None:
        super().__init__()
        if not rules:
            raise ValueError("a rewrite pass needs at least one rule")
        self.rules = list(rules)
        self.commute = commute

    def _rule_set(self, tally: collections.Counter, *, dry_run: bool = False) -> tuple[RewriteRuleSet, dict]:
        session = _Session(dry_run=dry_run)
        compiled: list[RewriteRule] = []
        labels: dict[RewriteRule, str] = {}
        fusion: set[RewriteRule] = set()

        def add(rule: RewriteRuleClassBase) -> None:
            for rewrite_rule in _variant_rules(rule, tally, self.commute):
                compiled.append(rewrite_rule)
                labels[rewrite_rule] = rule.name
                if isinstance(rule, FusionRule):
                    fusion.add(rewrite_rule)

        for rule in self.rules:
            if not isinstance(rule, FusionRule):
                add(rule)
                continue
            rule.session = session
            for variant in rule.variants:
                rule.variant = variant
                add(rule)
        rule_set = RewriteRuleSet(compiled)
        # Fusion rules keep matched nodes (remove_nodes=False) and remove those left unused themselves; the rule
        # set must not sweep unused nodes from the whole model after them.
        rule_set.remove_unused_nodes = False
        return rule_set, {"labels": labels, "fusion": fusion, "session": session}

    def apply(self, model: ir.Model) -> collections.Counter:
        tally: collections.Counter = collections.Counter()
        rule_set, _ = self._rule_set(tally)
        used_before = initializers_in_use(model.graph)
        for _ in range(self.max_rounds):
            if not rule_set.apply_to_model(model):
                break
        drop_orphaned_initializers(model.graph, used_before)
        return tally

    def near_misses(self, model: ir.Model) -> list[NearMiss]:
        """The best-scoring failed match of each rule on ``model`` (left untouched), closest first.

        For fusion rules only matches their check rejected count: their patterns are the candidates."""
        tracer = MatchingTracer()
        rule_set, info = self._rule_set(collections.Counter(), dry_run=True)
        rule_set.apply_to_model(model.clone(), tracer=tracer)
        declined, anchors = info["session"].declined, info["session"].anchors
        found = {(m.rule, m.where, m.reason): m for m in super().near_misses(model)}
        for rule, infos in tracer.best_matches_map.items():
            fusion = rule in info["fusion"]
            for match in infos:  # commuted variants of a rule report the same miss: keep one
                if match.status is MatchStatus.SUCCESS:
                    continue
                if fusion and (match.status is MatchStatus.NO_MATCH
                               or (match.root_node, match.match_result.reason) in declined):
                    continue
                reason = _reason(match.match_result, match.root_node)
                where = anchors.get((match.root_node, match.match_result.reason), match.root_node)
                miss = NearMiss(info["labels"][rule], node_label(where), reason, match.score())
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
