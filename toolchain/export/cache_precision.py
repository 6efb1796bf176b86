"""The KV cache's element type (export.cache_dtype): every ``past_key_values.N.*`` input and ``present.N.*`` output
of an exported graph stored in a narrower float type, computed in float32.

The graph reads each cache input through a Cast to float32 and writes each present output through a Cast from it,
so attention computes as before and only the stored entries are rounded (float16: 11 significant bits, a relative
error of at most 2^-11 per entry). Every architecture's graph is rewritten alike after it is built, whatever its
cache kinds hold (keys and values, MLA's latent, DeepSeek-V3.2's indexer keys, DeepSeek-V4's per-token state).
Where the present output is the past concatenated with the new positions (every cache but a bounded window's),
it is written as Concat(past, Cast(new)): the past entries are stored already, so only the new ones are converted,
not the whole cache each step.
"""

from __future__ import annotations

import onnx_ir as ir

from toolchain.interface.graph import CACHE_DTYPE, CACHE_DTYPES, PAST_PREFIX, PRESENT_PREFIX, SEQUENCE_AXIS

FLOAT = ir.DataType.FLOAT
_TYPES = {"float16": ir.DataType.FLOAT16}


def with_cache_dtype(model: ir.Model, dtype: str) -> int:
    """Store ``model``'s cache inputs and outputs as ``dtype`` (one of CACHE_DTYPES; float32 leaves the graph as it
    is), recorded in its metadata (CACHE_DTYPE). Returns the cache tensors changed (inputs and outputs)."""
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype {dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
    model.metadata_props[CACHE_DTYPE] = dtype
    if dtype == "float32":
        return 0
    narrow = _TYPES[dtype]
    graph = model.graph
    widened: dict[str, ir.Value] = {}
    for value in graph.inputs:
        past = value.name or ""
        if not past.startswith(PAST_PREFIX):
            continue
        consumers = list(value.uses())
        cast = ir.node("Cast", [value], {"to": int(FLOAT)}, name=_node_name(past, "widen"))
        cast.outputs[0].name = f"{past}/float32"
        cast.outputs[0].dtype, cast.outputs[0].shape = FLOAT, value.shape
        graph.insert_before(_first_node(graph), cast)
        for user, index in consumers:
            user.replace_input_with(index, cast.outputs[0])
        value.dtype = narrow
        widened[past[len(PAST_PREFIX):]] = cast.outputs[0]
    outputs = list(graph.outputs)
    for position, value in enumerate(outputs):
        name = value.name or ""
        if not name.startswith(PRESENT_PREFIX):
            continue
        inner = f"{name}/float32"
        value.name = inner  # the float32 value keeps its other consumers (attention reads it)
        stored_past = graph.inputs[[v.name for v in graph.inputs].index(PAST_PREFIX + name[len(PRESENT_PREFIX):])]
        stored = _appended(graph, value, widened.get(name[len(PRESENT_PREFIX):]), stored_past, narrow, name)
        stored.name, stored.dtype, stored.shape = name, narrow, value.shape
        graph.outputs[position] = stored
    return 2 * len(widened)


def _appended(graph: ir.Graph, present: ir.Value, widened_past: ir.Value | None, past: ir.Value,
              narrow: ir.DataType, name: str) -> ir.Value:
    """``present`` in ``narrow``: Concat(past, Cast(new positions)) where it is the widened past concatenated with
    them on the sequence axis, else Cast(present)."""
    node = present.producer()
    if node is not None and node.op_type == "Concat" and node.domain == "" and len(node.inputs) == 2 \
            and node.inputs[0] is widened_past and _axis(node) in (SEQUENCE_AXIS, SEQUENCE_AXIS - 4):
        new = ir.node("Cast", [node.inputs[1]], {"to": int(narrow)}, name=_node_name(name, "narrow_new"))
        concat = ir.node("Concat", [past, new.outputs[0]], {"axis": SEQUENCE_AXIS}, name=_node_name(name, "store"))
        graph.insert_after(node, [new, concat])
        return concat.outputs[0]
    cast = ir.node("Cast", [present], {"to": int(narrow)}, name=_node_name(name, "narrow"))
    graph.insert_after(node, cast) if node is not None else graph.append(cast)
    return cast.outputs[0]


def _node_name(cache: str, what: str) -> str:
    """A node in its layer's scope (``layers.N/...``), where a check that cuts the graph by layer looks for it
    (toolchain/verify/layer_parity.py)."""
    layer, kind = cache.split(".", 1)[1].split(".", 1)
    return f"layers.{layer}/{kind}_cache/{what}"


def _axis(node: ir.Node) -> int | None:
    attr = node.attributes.get("axis")
    return attr.as_int() if attr is not None else None


def _first_node(graph: ir.Graph) -> ir.Node:
    return next(iter(graph))
