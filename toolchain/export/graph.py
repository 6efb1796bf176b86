"""A thin naming layer over onnx_ir's Tape for building decoder graphs from weights.

It only adds what the Tape lacks for a graph of this size: scoped, deterministic node/value/initializer names
(so two exports of one checkpoint are byte-identical and a pass or a profile can say "layers.3.attn"), and
de-duplicated small constants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import numpy as np
import onnx
import onnx_ir as ir
import torch

from toolchain.errors import DstcError
from toolchain.export.weights import ChunkedTensor, LazyArray, Params
from toolchain.interface.graph import LAYER, ROLE, SOURCE

OPSET = 18


class GraphBuilder:
    def __init__(self, params: Params, weights: str = "float32", config=None) -> None:
        self.params = params  # the model's tensors: g.params.array(module.weight) for a weight's values
        self.config = config  # the model's transformers config, for modules that hold none (transformers' MoE blocks)
        self.bf16 = weights == "bfloat16"  # matrices with bf16 values stored as bf16 and widened by a Cast
        self.tape = ir.tape.Tape()
        self._outer = self.tape  # the main graph's, which holds every initializer (subgraph: another tape's nodes)
        self._scope: list[str] = []
        self._roles: list[str] = []
        self._consts: dict[tuple, ir.Value] = {}
        self._count = 0

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    @contextmanager
    def role(self, name: str) -> Iterator[None]:
        """What the weights made inside are to the model ("embeddings", "lm_head", "attention", "mlp", "router",
        "shared_expert", "routed_expert", "hyper_connection"): written on each initializer (``dstc.role``, with
        ``dstc.layer``), where compression's policy reads it instead of parsing names."""
        self._roles.append(name)
        try:
            yield
        finally:
            self._roles.pop()

    @property
    def layer(self) -> int | None:
        """The decoder layer being built (the index of its ``layers.N`` scope); None outside the layers."""
        return next((int(part[len("layers."):]) for part in self._scope if part.startswith("layers.")), None)

    def _annotate(self, tensor, array=None) -> None:
        provenance = array.provenance if isinstance(array, LazyArray) else None
        if provenance:
            tensor.metadata_props[SOURCE] = provenance
        if self._roles:
            tensor.metadata_props[ROLE] = self._roles[-1]
        if self.layer is not None:
            tensor.metadata_props[LAYER] = str(self.layer)

    def _path(self, name: str) -> str:
        return "/".join([*self._scope, name])

    def op(self, op_type: str, *inputs: ir.Value | None, outputs: int = 1, domain: str = "", **attrs):
        """Add a node; returns its output value, or a tuple of them when ``outputs`` > 1."""
        self._count += 1
        name = self._path(f"{op_type}_{self._count}")
        attributes = {k: v for k, v in attrs.items() if v is not None}
        values = self.tape.op_multi_out(
            op_type, list(inputs), attributes or None, num_outputs=outputs, domain=domain, name=name
        )
        for i, value in enumerate(values):
            value.name = f"{name}/out{i}" if outputs > 1 else f"{name}/out"
        return values[0] if outputs == 1 else tuple(values)

    def weight(self, name: str, array: np.ndarray | LazyArray) -> ir.Value:
        """An initializer. A weight still in the checkpoint (LazyArray) or a non-contiguous view (a transposed
        torch weight) is read or copied only when saved, one tensor at a time, so a large model never holds its
        weights in memory.

        With bf16 storage, a matrix whose checkpoint values are bf16 is a bf16 initializer under the weight's name,
        and what is returned is its Cast to float32 (node ``<name>/Cast``, which takes no node number, so the
        other nodes are named as in a float32 export): the float32 values are the same bit for bit."""
        full = self._path(name)
        tensor: ir.TensorProtocol
        if self.bf16 and isinstance(array, LazyArray) and array.dtype == torch.bfloat16 and len(array.shape) >= 2:
            tensor = ir.LazyTensor(lambda: cast(ir.TensorProtocol, ChunkedTensor(array, full, torch.bfloat16)),
                                   dtype=ir.DataType.BFLOAT16, shape=ir.Shape(array.shape), name=full)
            self._annotate(tensor, array)
            stored = self._outer.initializer(tensor, name=full)
            widened = self.tape.op("Cast", [stored], {"to": ir.DataType.FLOAT}, name=f"{full}/Cast")
            widened.name, widened.dtype, widened.shape = f"{full}/Cast/out", ir.DataType.FLOAT, ir.Shape(array.shape)
            return widened
        if isinstance(array, LazyArray):
            # ChunkedTensor has the part of TensorProtocol that LazyTensor and onnx-ir's writer use
            tensor = ir.LazyTensor(lambda: cast(ir.TensorProtocol, ChunkedTensor(array, full)),
                                   dtype=ir.DataType.FLOAT, shape=ir.Shape(array.shape), name=full)
        elif array.flags.c_contiguous:
            tensor = ir.tensor(array, name=full)
        else:
            tensor = ir.LazyTensor(lambda: ir.tensor(np.ascontiguousarray(array)),
                                   dtype=ir.DataType.from_numpy(array.dtype), shape=ir.Shape(array.shape), name=full)
        self._annotate(tensor, array)
        return self._outer.initializer(tensor, name=full)

    def const(self, value, dtype=np.int64) -> ir.Value:
        """A small constant, shared by every node that asks for the same value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = f"const/{array.dtype.name}_{len(self._consts)}"
            self._consts[key] = self._outer.initializer(ir.tensor(array, name=name), name=name)
        return self._consts[key]

    def subgraph(self, name: str, build: Callable[[], ir.Value]) -> ir.Graph:
        """A graph (an If's branch) of the nodes ``build`` adds, its output float32 ``build``'s result; the nodes
        read the main graph's values from the outer scope, and its constants and weights stay the main graph's."""
        outer, self.tape = self.tape, ir.tape.Tape()
        try:
            with self.scope(name):
                output = build()
        finally:
            branch, self.tape = self.tape, outer
        output.dtype = ir.DataType.FLOAT
        return ir.Graph([], [output], nodes=branch.nodes, name=self._path(name))

    def model(self, inputs: Sequence[ir.Value], outputs: Sequence[ir.Value], doc: str) -> ir.Model:
        # contrib domains (com.microsoft's MoE, version 1) are imported only by graphs that use them
        contrib = sorted({n.domain for n in self.tape.nodes} - {"", "ai.onnx"})
        graph = ir.Graph(
            inputs=inputs,
            outputs=outputs,
            nodes=self.tape.nodes,
            initializers=self.tape.initializers,
            opset_imports={"": OPSET, **dict.fromkeys(contrib, 1)},
            name="main_graph",
        )
        return ir.Model(graph, ir_version=9, producer_name="dstc", doc_string=doc)


def tensor_input(name: str, dtype: ir.DataType, dims: Sequence[int | str]) -> ir.Value:
    return ir.val(name, dtype=dtype, shape=ir.Shape(list(dims)))


def rename_output(value: ir.Value, name: str, dtype: ir.DataType, dims: Sequence[int | str]) -> ir.Value:
    """Give a node's output the public name, type and symbolic shape of a graph output."""
    value.name = name
    value.dtype = dtype
    value.shape = ir.Shape(list(dims))
    return value


# Above this many bytes of weights the graph keeps them in model.onnx.data (protobuf's 2 GB limit, and a
# graph file that tools can open quickly).
EXTERNAL_DATA_BYTES = 1 << 30
# ... and an initializer above this many bytes goes there (norms' scales, shape constants stay in the graph file)
EXTERNAL_THRESHOLD_BYTES = 1024


def float32_bytes(model: ir.Model) -> int:
    """Bytes of the model's initializers with bf16 ones counted as float32: a model's size whichever storage its
    export chose (toolchain/export/weights.py), for the size thresholds that should not depend on it."""
    return sum(v.const_value.size * 4 if v.const_value.dtype == ir.DataType.BFLOAT16 else v.const_value.nbytes
               for v in model.graph.initializers.values() if v.const_value is not None)


def load_graph(path: Path) -> ir.Model:
    """ir.load, without onnx-ir 1.1's doubling of initializer metadata: it keeps a loaded initializer's TensorProto
    and on save copies it, metadata_props included, then appends the tensor's metadata_props again, so every stage
    that loads and saves a graph doubled each weight's dstc.role / dstc.layer entries. The proto's copy is cleared;
    the tensor keeps them, and they are written once."""
    model = ir.load(path)
    for value in model.graph.initializers.values():
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, onnx.TensorProto) and len(raw.metadata_props):
            raw.ClearField("metadata_props")
    return model


def save_graph(model: ir.Model, path: Path, external: bool | None = None, workers: int | None = None) -> list[str]:
    """Write the model; returns the files written (model.onnx, and model.onnx.data for large weights, or when
    ``external``: a graph of lazy tensors is then written a tensor at a time, where one file is serialized whole
    in memory, twice: the ModelProto's copy of every tensor and its byte string). ``workers``: threads that
    compute and write external tensors at once (onnx-ir's writer: the same bytes, and at most 1 GB of tensors
    in flight), for lazy tensors whose computation releases the GIL."""
    if external or (external is None and float32_bytes(model) > EXTERNAL_DATA_BYTES):
        # small tensors (norms' scales, shape constants) stay in the graph file, as ORT's optimizer writes them
        _save(model, path, external_data=path.name + ".data", size_threshold_bytes=EXTERNAL_THRESHOLD_BYTES,
              max_workers=workers)
        return [path.name, path.name + ".data"]
    # Weights still in the input's external data file (a stage that read a large graph and made it small, e.g.
    # by compressing it) would be written as references to that file: they are read in, to be inlined.
    ir.external_data.load_to_model(model)
    _save(model, path)
    return [path.name]


def save_graph_deferred(model: ir.Model, path: Path) -> int | None:
    """The graph file save_graph writes for a model whose weights go to external data, byte for byte, without the
    weights file it references (its tensors are recomputed by whoever reads them: toolchain/stages/export.py
    recomputed_weights); the bytes that file would hold, or None (nothing written) for a model save_graph keeps
    in one file."""
    if float32_bytes(model) <= EXTERNAL_DATA_BYTES:
        return None
    return sum(length for _, _, length in save_graph_references(model, path))


def save_graph_references(model: ir.Model, path: Path) -> list[tuple[str, int, int]]:
    """The graph file ``save_graph(model, path, external=True)`` writes, byte for byte, without writing its weights
    file: (name, offset, length) of each tensor that file holds, in its order. The offsets are onnx-ir's
    (``unload_from_model``): the tensors above save_graph's threshold, in every graph, packed densely in initializer
    order; smaller ones already in external data are read in, to be inlined. The model keeps its own tensors."""
    location, kept, placed, offset = path.name + ".data", {}, [], 0
    for graph in model.graphs():
        for name, value in graph.initializers.items():
            tensor = value.const_value
            if tensor is None:
                continue
            if tensor.nbytes > EXTERNAL_THRESHOLD_BYTES:
                # the serializer names each initializer's tensor after its value
                value.const_value = ir.ExternalTensor(location, offset, tensor.nbytes, tensor.dtype,
                                                      shape=ir.Shape(tensor.shape.numpy()), name=name,
                                                      base_dir=str(path.parent))
                placed.append((name, offset, tensor.nbytes))
                offset += tensor.nbytes
            elif isinstance(tensor, ir.ExternalTensor):
                value.const_value = ir.external_data.convert_tensors_from_external([tensor])[0]
            else:
                continue
            kept[value] = tensor
    try:
        ir.save(model, path)
    finally:  # the model keeps its own tensors
        for value, tensor in kept.items():
            value.const_value = tensor
    _restore_tensor_metadata(model, path)  # as save_graph writes them
    return placed


def _save(model: ir.Model, path: Path, **options) -> None:
    """ir.save; a lazy weight's read that finds bad input (a checkpoint's NaN scale) raises its own error, not
    onnx-ir's wrappers of it."""
    try:
        ir.save(model, path, **options)
        if options.get("external_data"):
            _restore_tensor_metadata(model, path)
    except ir.serde.SerdeError as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, DstcError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def _restore_tensor_metadata(model: ir.Model, path: Path) -> None:
    """onnx-ir 1.1 writes a tensor it moves to external data without its metadata_props (its ExternalTensor is
    made from the location alone), and the exporter's dstc.role / dstc.layer are what compression reads: they are
    written into the saved graph file (the weights' file is untouched)."""
    proto = onnx.load(str(path), load_external_data=False)
    changed = False
    for tensor in proto.graph.initializer:
        value = model.graph.initializers.get(tensor.name)
        props = value.const_value.metadata_props if value is not None and value.const_value is not None else {}
        if props and not len(tensor.metadata_props):
            for key, text in props.items():
                tensor.metadata_props.add(key=key, value=text)
            changed = True
    if changed:
        onnx.save(proto, str(path))
