"""Helpers shared by the fusion passes: reading constants and shapes, emitting nodes, cleaning up after a rewrite."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from passes.base import CountingPass, NearMiss
from passes.graph import Names, constant_array, drop_orphaned_initializers, initializers_in_use

MS_DOMAIN = "com.microsoft"


def is_op(node: ir.Node | None, op_type: str, domain: str = "") -> bool:
    if node is None or node.op_type != op_type:
        return False
    return node.domain in ("", "ai.onnx") if domain == "" else node.domain == domain


def producer(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    """The node computing ``value`` if it is an ``op_type`` node (of ``domain``), else None."""
    node = value.producer() if value is not None else None
    return node if is_op(node, op_type, domain) else None


def scalar(value: ir.Value | None) -> float | None:
    """The value of a constant with one element, as a Python number."""
    array = constant_array(value)
    return array.reshape(()).item() if array is not None and array.size == 1 else None


def int_list(value: ir.Value | None) -> list[int] | None:
    array = constant_array(value)
    if array is None or array.ndim > 1 or not np.issubdtype(array.dtype, np.integer):
        return None
    return [int(v) for v in array.reshape(-1)]


def dims(value: ir.Value | None) -> list[int | str | None] | None:
    """The value's dims (int, symbol name, or None when unknown), or None when its rank is unknown."""
    if value is None or value.shape is None:
        array = constant_array(value)
        return None if array is None else list(array.shape)
    return [d if isinstance(d, int) else (d.value if isinstance(d, ir.SymbolicDim) else None) for d in value.shape]


def static_dim(value: ir.Value | None, axis: int) -> int | None:
    d = dims(value)
    if d is None or not -len(d) <= axis < len(d):
        return None
    return d[axis] if isinstance(d[axis], int) else None


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """For a binary node with ``value`` as one operand, the other operand."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a if b is value else None


def only_consumer(value: ir.Value) -> ir.Node | None:
    """The single node reading ``value``, when it has exactly one use and is not a graph output."""
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0][0]


def axis_is_last(axis: int, rank: int | None) -> bool:
    return axis == -1 or (rank is not None and axis == rank - 1)


def use_opset(model: ir.Model, domain: str, version: int) -> None:
    """Import ``domain`` at ``version`` at least."""
    if model.opset_imports.get(domain, 0) < version:
        model.opset_imports[domain] = version


def scope_of(node: ir.Node) -> str:
    """The name prefix of ``node`` (its name up to the last '/'), for naming the nodes that replace it."""
    name = node.name or ""
    return name.rsplit("/", 1)[0] + "/" if "/" in name else ""


class Emitter:
    """Creates nodes in front of an anchor node, with fresh names, and de-duplicated small constants."""

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.names = Names(graph)
        self._consts: dict[tuple, ir.Value] = {}

    def node(
        self,
        anchor: ir.Node,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: Mapping[str, object] | None = None,
        *,
        domain: str = "",
        num_outputs: int = 1,
        name: str | None = None,
    ) -> ir.Node:
        base = self.names.fresh(f"{scope_of(anchor)}{name or op_type}")
        node = ir.node(op_type, list(inputs), dict(attributes or {}), domain=domain, num_outputs=num_outputs,
                       name=base)
        for i, out in enumerate(node.outputs):
            out.name = self.names.fresh(f"{base}/out{i}" if num_outputs > 1 else f"{base}/out")
        self.graph.insert_before(anchor, node)
        return node

    def op(self, anchor: ir.Node, op_type: str, *inputs: ir.Value | None, domain: str = "", name: str | None = None,
           **attributes) -> ir.Value:
        """One-output shorthand for :meth:`node`."""
        return self.node(anchor, op_type, inputs, attributes, domain=domain, name=name).outputs[0]

    def const(self, value, dtype=np.int64, name: str = "const") -> ir.Value:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.names.add_initializer(array, f"fusion/{name}")
        return self._consts[key]


def remove_dead(graph: ir.Graph, nodes: Iterable[ir.Node]) -> int:
    """Remove those of ``nodes`` whose outputs nothing reads any more (repeatedly: a removal can free others)."""
    pending = [n for n in dict.fromkeys(nodes) if n.graph is graph]
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if any(out.uses() or out.is_graph_output() for out in node.outputs):
                continue
            graph.remove(node, safe=True)
            pending.remove(node)
            removed += 1
            changed = True
    return removed


class Miss(NamedTuple):
    """Why a candidate was not rewritten; a higher ``score`` is closer to having matched."""

    reason: str
    score: int = 1


class FusionPass(CountingPass):
    """A hand-written fusion: :meth:`match` each node, :meth:`rewrite` each match; then the nodes the rewrites
    left unused are removed, with the initializers only they read, and the graph is re-sorted.

    ``match`` returns None for a node that is not a candidate, a :class:`Miss` for one that nearly matched
    (recorded as a near-miss of ``rule``), or a match that ``rewrite`` turns into new nodes, returning the count
    name to increment and the old nodes that may now be dead. Near-misses can be asked of any model: they come
    from a dry run on a clone (tensors are shared, so it is cheap), as ``RewriteRulesPass`` replays its rules.
    """

    rule = "fusion"
    domain: str | None = None  # imported (version 1) when something was rewritten

    def start(self, model: ir.Model) -> None:
        """Per-run state (e.g. values shared by all rewrites); ``self.emit`` is ready."""

    def match(self, node: ir.Node):
        raise NotImplementedError

    def rewrite(self, match) -> tuple[str, list[ir.Node]]:
        raise NotImplementedError

    def finish(self, model: ir.Model) -> None:
        """After at least one rewrite (e.g. opset changes)."""

    def apply(self, model: ir.Model) -> Counter:
        graph = model.graph
        counts: Counter = Counter()
        self.emit = Emitter(graph)
        used_before = initializers_in_use(graph)
        self.start(model)
        dead: list[ir.Node] = []
        for node in list(graph):
            if node.graph is not graph:
                continue  # removed by an earlier rewrite
            found = self.match(node)
            if found is None:
                continue
            if isinstance(found, Miss):
                self.near_miss(self.rule, node, found.reason, found.score)
                continue
            name, old = self.rewrite(found)
            counts[name] += 1
            dead += old
        if counts:
            if self.domain is not None:
                use_opset(model, self.domain, 1)
            self.finish(model)
            remove_dead(graph, dead)
            drop_orphaned_initializers(graph, used_before)
            graph.sort()
        return counts

    def near_misses(self, model: ir.Model) -> list[NearMiss]:
        replay = type(self)()
        replay(model.clone())
        return CountingPass.near_misses(replay, model)
