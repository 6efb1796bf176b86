"""eliminate-transposes: remove, merge and absorb Transpose nodes (main graph).

For each Transpose, the first rule that applies (repeated until nothing changes):

* ``identity_removed``: the permutation is the identity.
* ``pairs_cancelled`` / ``pairs_merged``: Transpose of a Transpose; inverse permutations cancel, others become
  one Transpose (merged only when the inner one has no other consumer, else nothing is saved).
* ``constants_folded``: Transpose of a constant (e.g. a 2-D MatMul weight) becomes a transposed constant,
  unless the constant is large and shared, where a copy would duplicate it.
* ``gemm_folded``: a [1, 0] Transpose feeding Gemm's A or B toggles transA / transB instead.
* ``pushed_through``: Transpose(p) -> elementwise ops -> Transpose(q) with q undoing p: both go, and the ops
  run in the original layout. Exact because broadcasting is per axis: every other operand must be a constant
  (padded to the rank, then given the inverse permutation), all-ones-shaped, or Transpose(_, p) itself.

Written by hand rather than as onnxscript rules: the push-through rule walks chains of any length and the
constant and Gemm rules act per use, which fixed-size patterns do not express; onnxscript's Transpose rules
(TransposeTranspose, TransposeIdentity) only cover the first two bullets and leave Identity nodes behind.
"""

from __future__ import annotations

from collections import Counter
from typing import TypeGuard

import numpy as np
import onnx_ir as ir

from passes.base import CountingPass, node_label
from passes.graph import (
    Names,
    bypass,
    constant_array,
    drop_orphaned_initializers,
    initializers_in_use,
    known_rank,
    present,
)
from passes.registry import register

# ONNX ops that compute each output element from the same-index (broadcast) elements of their inputs and have
# no axis-dependent attribute.
ELEMENTWISE = frozenset(
    "Abs Acos Acosh Add And Asin Asinh Atan Atanh BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Cast "
    "Ceil Celu Clip Cos Cosh Div Elu Equal Erf Exp Floor Gelu Greater GreaterOrEqual HardSigmoid HardSwish "
    "Identity IsInf IsNaN LeakyRelu Less LessOrEqual Log Max Mean Min Mish Mod Mul Neg Not Or Pow PRelu "
    "Reciprocal Relu Round Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Sub Sum Tan Tanh ThresholdedRelu "
    "Where Xor".split()
)


def _is_op(node: ir.Node | None, op_type: str) -> TypeGuard[ir.Node]:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    if attr is None:
        rank = known_rank(node.inputs[0])
        return None if rank is None else list(reversed(range(rank)))
    return None if attr.is_ref() else list(attr.as_ints())


def _compose(first: list[int], second: list[int]) -> list[int]:
    """The perm of Transpose(Transpose(x, first), second)."""
    return [first[i] for i in second]


def _is_identity(perm: list[int]) -> bool:
    return perm == list(range(len(perm)))


def _undoing_consumer(node: ir.Node, perm: list[int]) -> ir.Node | None:
    """The Transpose right after ``node`` if it undoes ``perm`` (so a blocked push-through nearly worked)."""
    consumers = node.outputs[0].consumers() if len(node.outputs) == 1 else ()
    if len(consumers) == 1 and _is_op(consumers[0], "Transpose"):
        last = _perm(consumers[0])
        if last is not None and len(last) == len(perm) and _is_identity(_compose(perm, last)):
            return consumers[0]
    return None


def _remove_if_dead(graph: ir.Graph, value: ir.Value) -> None:
    producer = value.producer()
    if producer is not None and producer.graph is graph and not value.uses() and not value.is_graph_output():
        graph.remove(producer, safe=True)


@register("eliminate-transposes", description="Cancel, merge, fold and push Transposes (constants, Gemm flags).")
class EliminateTransposes(CountingPass):
    small_constant = 4096  # constants up to this many elements are transposed even when shared
    max_rounds = 8

    def apply(self, model: ir.Model) -> Counter:
        graph = model.graph
        counts: Counter = Counter()
        used_before = initializers_in_use(graph)
        self._names = Names(graph)
        for _ in range(self.max_rounds):
            self._near_misses = []  # the last (unchanged) round's near-misses are the ones that stand
            changed = False
            for node in [n for n in graph if _is_op(n, "Transpose")]:
                if node.graph is graph and (rule := self._simplify(graph, node)):
                    counts[rule] += 1
                    changed = True
            if not changed:
                break
        drop_orphaned_initializers(graph, used_before)
        return counts

    def _replace(self, graph: ir.Graph, transpose: ir.Node, value: ir.Value) -> None:
        bypass(graph, transpose.outputs[0], value)
        graph.remove(transpose, safe=True)

    def _simplify(self, graph: ir.Graph, t: ir.Node) -> str | None:
        perm = _perm(t)
        if perm is None:
            self.near_miss("transpose", t, "permutation unknown (no perm attribute and unknown rank)")
            return None
        x, y = present(t.inputs[0]), t.outputs[0]
        if _is_identity(perm):
            self._replace(graph, t, x)
            return "identity_removed"

        inner = x.producer()
        inner_perm = _perm(inner) if _is_op(inner, "Transpose") and inner.graph is graph else None
        if inner is not None and inner_perm is not None and len(inner_perm) == len(perm):
            composed = _compose(inner_perm, perm)
            if _is_identity(composed):
                self._replace(graph, t, present(inner.inputs[0]))
                _remove_if_dead(graph, x)
                return "pairs_cancelled"
            if len(x.uses()) == 1 and not x.is_graph_output():
                t.replace_input_with(0, inner.inputs[0])
                t.attributes["perm"] = ir.AttrInt64s("perm", composed)
                graph.remove(inner, safe=True)
                return "pairs_merged"
            self.near_miss("merge", t, f"{node_label(inner)} has other consumers and perms do not cancel")

        array = constant_array(x)
        if array is not None:
            if len(x.uses()) == 1 or array.size <= self.small_constant:
                folded = self._names.add_initializer(np.transpose(array, perm), f"{x.name}_transposed")
                self._replace(graph, t, folded)
                _remove_if_dead(graph, x)
                return "constants_folded"
            self.near_miss("constant", t, f"constant {x.name!r} ({array.size} elements) is shared; not duplicated")

        if perm == [1, 0]:
            gemm_uses = [(node, i) for node, i in y.uses() if _is_op(node, "Gemm") and i in (0, 1)]
            for node, i in gemm_uses:
                flag = "transA" if i == 0 else "transB"
                node.attributes[flag] = ir.AttrInt64(flag, 1 - node.attributes.get_int(flag, 0))
                node.replace_input_with(i, x)
            if gemm_uses:
                _remove_if_dead(graph, y)
                return "gemm_folded"

        return "pushed_through" if self._push_through(graph, t, perm) else None

    def _push_through(self, graph: ir.Graph, t: ir.Node, perm: list[int]) -> bool:
        """Transpose(p) -> elementwise chain -> Transpose(q), q undoing p: run the chain untransposed."""
        value = t.outputs[0]
        chain: list[tuple[ir.Node, int]] = []
        edits: list[tuple[ir.Node, int, tuple]] = []
        while True:
            if value.is_graph_output() or len(value.uses()) != 1:
                if chain:
                    self.near_miss("push-through", t, f"{node_label(chain[-1][0])} has other consumers", len(chain))
                return False
            ((node, index),) = value.uses()
            if _is_op(node, "Transpose"):
                if not chain:
                    return False  # a direct pair: the second Transpose cancels or merges it
                last = _perm(node)
                if last is not None and _is_identity(_compose(perm, last)):
                    break
                self.near_miss(
                    "push-through", t,
                    f"reaches {node_label(node)} (perm {last}) through {len(chain)} elementwise op(s) "
                    f"but it does not undo perm {perm}", len(chain),
                )
                return False
            if node.domain not in ("", "ai.onnx") or node.op_type not in ELEMENTWISE or len(node.outputs) != 1:
                undo = _undoing_consumer(node, perm)
                if chain or undo:
                    before = f" (before {node_label(undo)}, which undoes it)" if undo else ""
                    reason = f"stops at {node_label(node)}, not elementwise{before}"
                    self.near_miss("push-through", t, reason, len(chain))
                return False
            for j, operand in enumerate(node.inputs):
                if j != index and operand is not None:
                    edit = self._operand_edit(node, operand, perm)
                    if isinstance(edit, str):
                        self.near_miss("push-through", t, edit, len(chain) + 1)
                        return False
                    edits.append((node, j, edit))
            chain.append((node, index))
            value = node.outputs[0]

        first, index = chain[0]
        first.replace_input_with(index, t.inputs[0])
        for op_node, j, edit in edits:
            if edit[0] == "constant":
                op_node.replace_input_with(j, self._names.add_initializer(edit[1], f"{edit[2].name}_untransposed"))
                _remove_if_dead(graph, edit[2])
            elif edit[0] == "untranspose":
                op_node.replace_input_with(j, edit[1].inputs[0])
                _remove_if_dead(graph, edit[1].outputs[0])
        inverse = np.argsort(perm).tolist()
        for op_node, _ in chain:
            shape = op_node.outputs[0].shape
            if shape is not None:
                op_node.outputs[0].shape = ir.Shape([shape[i] for i in inverse])
        self._replace(graph, node, chain[-1][0].outputs[0])
        graph.remove(t, safe=True)
        return True

    def _operand_edit(self, node: ir.Node, operand: ir.Value, perm: list[int]) -> tuple | str:
        """How another operand of a chain op must change for the op to run untransposed, or why it cannot."""
        rank = len(perm)
        array = constant_array(operand)
        if array is not None:
            if array.ndim > rank:
                return f"operand {operand.name!r} of {node_label(node)} has rank {array.ndim} > {rank}"
            if array.size == 1:
                return ("keep",)
            padded = array.reshape((1,) * (rank - array.ndim) + array.shape)
            return ("constant", np.transpose(padded, np.argsort(perm)), operand)
        producer = operand.producer()
        if (
            _is_op(producer, "Transpose")
            and _perm(producer) == perm
            and len(operand.uses()) == 1
            and not operand.is_graph_output()
        ):
            return ("untranspose", producer)
        shape = operand.shape
        if shape is not None and shape.rank() <= rank and all(d == 1 for d in shape):
            return ("keep",)
        return (
            f"operand {operand.name!r} of {node_label(node)} is neither constant, all-ones-shaped, "
            f"nor Transpose(perm={perm})"
        )
