"""Helpers shared by the fusion rules' checks: reading constants, shapes and uses of matched values."""

from __future__ import annotations

from typing import TypeGuard

import numpy as np
import onnx_ir as ir

from passes.base import node_label
from passes.graph import constant_array

MS_DOMAIN = "com.microsoft"


def is_op(node: ir.Node | None, op_type: str, domain: str = "") -> TypeGuard[ir.Node]:
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
    dim = d[axis]
    return dim if isinstance(dim, int) else None


def only_consumer(value: ir.Value) -> ir.Node | None:
    """The single node reading ``value``, when it has exactly one use and is not a graph output."""
    uses = value.uses()
    if len(uses) != 1 or value.is_graph_output():
        return None
    return next(iter(uses)).node


def axis_is_last(axis: int, rank: int | None) -> bool:
    return axis == -1 or (rank is not None and axis == rank - 1)


def uses_outside(nodes, root: ir.Node, what: str) -> str | None:
    """``"<node> of the <what> has uses outside it"`` for the first of ``nodes`` other than ``root`` with an output
    read outside ``nodes`` (or a graph output); None when there is none."""
    inside = set(nodes)
    for node in nodes:
        if node is not root and any(out.is_graph_output() or any(user not in inside for user in out.consumers())
                                    for out in node.outputs):
            return f"{node_label(node)} of the {what} has uses outside it"
    return None
