"""Small graph helpers shared by the passes (queries and edits on onnx_ir graphs, nothing more)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir


def count_nodes(model: ir.Model) -> int:
    """Nodes in the main graph, its subgraphs and the model's functions."""
    total = sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))
    for function in model.functions.values():
        total += sum(1 for _ in ir.traversal.RecursiveGraphIterator(function))
    return total


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's data if it is a true constant (an initializer that is not a graph input, or a Constant node)."""
    if value is None or value.is_graph_input():
        return None
    try:
        tensor = ir.convenience.get_const_tensor(value)
        return None if tensor is None else tensor.numpy()
    except (FileNotFoundError, ValueError):  # external data not available, malformed Constant node
        return None


def stored_weight(value: ir.Value | None) -> ir.Value | None:
    """The bf16 initializer that ``value`` widens, when ``value`` is the output of a Cast to float32 of one: how
    large bf16 weights are stored in an export (the same float32 values, half the bytes); else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx") \
            or node.attributes.get_int("to") != ir.DataType.FLOAT:
        return None
    source = node.inputs[0]
    if source is None or not source.is_initializer() or source.is_graph_input() or source.const_value is None:
        return None
    return source if source.const_value.dtype == ir.DataType.BFLOAT16 else None


def constant_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of a constant, or of the bf16-stored weight that ``value`` widens (:func:`stored_weight`)."""
    stored = stored_weight(value)
    if stored is not None:
        return tuple(tensor_of(stored).shape.numpy())
    array = constant_array(value)
    return None if array is None else array.shape


def constant(value: ir.Value | None) -> np.ndarray:
    """:func:`constant_array` of a value the caller requires to be constant."""
    array = constant_array(value)
    if array is None:
        raise ValueError(f"{value.name if value is not None else 'an omitted input'} is not a constant")
    return array


def tensor_of(value: ir.Value | None) -> ir.TensorProtocol:
    """The ``const_value`` of a value the caller knows has one (an initializer with data)."""
    tensor = present(value).const_value
    if tensor is None:
        raise ValueError(f"{present(value).name} has no data")
    return tensor


def initializer_data(value: ir.Value | None) -> np.ndarray:
    """The data of a value the caller knows has a ``const_value`` (an initializer)."""
    tensor = present(value).const_value
    if tensor is None:
        raise ValueError(f"{present(value).name} has no data")
    return tensor.numpy()


class HeldInitializer:
    """For a record of one initializer held as ``value`` (a weight found in a graph): its name and data, which an
    initializer with data always has."""

    value: ir.Value

    @property
    def name(self) -> str:
        return name_of(self.value)

    @property
    def tensor(self) -> ir.TensorProtocol:
        return tensor_of(self.value)


def name_of(item: ir.Node | ir.Value | None) -> str:
    """The name of a node or value, where the caller knows it has one (an export names every one)."""
    if item is None or item.name is None:
        raise ValueError("an unnamed node or value, or an omitted input, where a named one was expected")
    return item.name


def produced(value: ir.Value | None) -> ir.Node:
    """The node computing ``value``, where a matched pattern guarantees there is one."""
    node = value.producer() if value is not None else None
    if node is None:
        raise ValueError(f"{value.name if value is not None else 'an omitted input'} is computed by no node")
    return node


def present(value: ir.Value | None) -> ir.Value:
    """``value``, where a matched pattern guarantees the input is not omitted."""
    if value is None:
        raise ValueError("an input the pattern matched is omitted")
    return value


def set_dtype(value: ir.Value, dtype: ir.DataType | None) -> None:
    """``value.dtype = dtype``, an unknown (None) dtype too: onnx_ir's setter stores it, its annotation says
    DataType only."""
    value.dtype = dtype  # type: ignore[assignment]


def known_rank(value: ir.Value | None) -> int | None:
    if value is None:
        return None
    if value.shape is not None:
        return value.shape.rank()
    array = constant_array(value)
    return None if array is None else array.ndim


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


def initializers_in_use(graph: ir.Graph) -> set[str]:
    return {name for name, value in graph.initializers.items() if value.uses()}


def drop_orphaned_initializers(graph: ir.Graph, used_before: set[str]) -> int:
    """Remove initializers that were in use before a rewrite and are not any more; return how many."""
    dropped = 0
    for name in used_before:
        value = graph.initializers.get(name)
        if value is None or value.uses() or value.is_graph_output() or value.is_graph_input():
            continue
        del graph.initializers[name]
        dropped += 1
    return dropped


class Names:
    """Hands out names no initializer, graph input or node output of ``graph`` uses (snapshot at creation)."""

    def __init__(self, graph: ir.Graph) -> None:
        self._graph = graph
        self._taken: set[str | None] = set(graph.initializers)
        self._taken.update(v.name for v in graph.inputs)
        self._taken.update(out.name for node in graph for out in node.outputs)

    def fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self._taken:
            n += 1
            name = f"{base}_{n}"
        self._taken.add(name)
        return name

    def add_initializer(self, array: np.ndarray, base_name: str) -> ir.Value:
        # reshape: a 0-d array stays 0-d
        tensor = ir.tensor(np.ascontiguousarray(array).reshape(np.shape(array)), name=self.fresh(base_name))
        value = ir.Value(
            name=tensor.name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(array.shape), const_value=tensor
        )
        self._graph.register_initializer(value)
        return value


def bypass(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Make every user of ``old`` (a node output about to be removed) read ``new`` instead.

    A graph output keeps its name: ``new`` takes it over when it is a plain node output, otherwise an
    Identity node carries ``new`` to the output.
    """
    if not old.is_graph_output():
        old.replace_all_uses_with(new)
        return
    name = old.name
    renamable = new.producer() is not None and not (new.is_graph_output() or new.is_graph_input())
    if not renamable:
        identity = ir.node("Identity", [new])
        graph.insert_before(produced(old), identity)
        new = identity.outputs[0]
        new.type, new.shape = old.type, old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = None
    new.name = name
