"""Where the exporter's weights come from: read from the checkpoint one tensor at a time, when the graph is saved.

The graph builders walk a transformers model for its structure and attributes (head counts, eps, scaling, routing
settings). That model is a skeleton on the meta device: its parameters have shapes and names but no data. Each
weight the builders ask for becomes a :class:`LazyArray`, a recipe to read the tensor from the checkpoint and
transform it (reorder rows, transpose), which the graph keeps as an ``ir.LazyTensor``. onnx-ir's save evaluates
them one at a time and calls ``tofile`` on each, and :class:`ChunkedTensor` writes its bytes a few MB at a time:
a weight is held in memory only in its checkpoint dtype (bf16 for bf16 and FP8 checkpoints), never as a full
float32 copy beside a transposed one, so exporting needs about one weight's bf16 bytes whatever the model.
A model loaded with real weights (the embedded models' reference, tests) works the same way, its tensors taken
as they are.

Storage (``dstc export --weights``, recipe ``export.weights``): weights are written as float32, or, where the
checkpoint's values are bf16 (bf16 and FP8 checkpoints), as bf16 initializers that the graph widens with a Cast
to float32 (toolchain/export/graph.py): the same float32 values after the Cast, at half the bytes on disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch

from toolchain.errors import InputError

CHUNK_BYTES = 16 << 20  # float32 bytes written per step
STORAGES = ("auto", "float32", "bfloat16")
# "auto" stores bf16 above this many bytes of float32 weights: where the compress stage streams one weight at a time
# (stages/compress.py STREAMING_BYTES) and parity runs layer by layer (parity.FULL_PARITY_BYTES), which read bf16
# weights as they are; below it an export stays float32, as the embedded models' artifacts were built.
BF16_AUTO_BYTES = 1 << 30

# A transformers model or one of its modules, whose parts the builders reach by attribute (model.model.layers,
# attn.q_proj.weight): torch types every such attribute as Tensor | Module, so this names the role and leaves
# the attributes unchecked.
HFModule = Any


@dataclass(frozen=True)
class LazyArray:
    """An array that is read only when written: ``read()`` gives the source tensor (torch, any float dtype);
    ``rows`` reorders or selects its first axis; ``transposed`` swaps the two axes of a matrix. ``dtype``: the
    dtype that holds the source's values exactly (bfloat16 for bf16 and FP8 checkpoints), which bounds the
    storage that keeps them unchanged."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor] | None  # None: a subclass that makes its own chunks
    rows: np.ndarray | None = None
    transposed: bool = False
    dtype: torch.dtype = torch.float32
    source: str | None = None  # the checkpoint tensor read (the graph's dstc.source: toolchain/compress/shipped.py)

    @property
    def T(self) -> LazyArray:  # noqa: N802 - numpy's name
        if len(self.shape) != 2:
            raise ValueError(f"only a matrix is transposed lazily, not shape {self.shape}")
        return LazyArray(self.shape[::-1], self.read, self.rows, not self.transposed, self.dtype, self.source)

    def __getitem__(self, index) -> LazyArray:
        """Rows of the source (an index array or a slice), before any transpose."""
        if self.transposed or self.rows is not None:
            raise ValueError("a lazy weight takes one row selection, before it is transposed")
        rows = np.arange(self.shape[0])[index]
        return LazyArray((len(rows), *self.shape[1:]), self.read, rows, dtype=self.dtype, source=self.source)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * 4

    @property
    def provenance(self) -> str | None:
        """JSON of where a matrix's values come from: the checkpoint tensor, whether it is transposed and the
        source rows it selects (None: all, in order); None for anything else."""
        if self.source is None or len(self.shape) != 2:
            return None
        rows = None if self.rows is None else self.rows.tolist()
        return json.dumps({"tensor": self.source, "transposed": self.transposed, "rows": rows},
                          separators=(",", ":"))

    def _source(self) -> torch.Tensor:
        if self.read is None:
            raise ValueError(f"{type(self).__name__} has no single source tensor")
        source = self.read()
        if self.rows is not None:
            source = source[torch.from_numpy(self.rows)]
        return source

    def chunks(self, dtype: torch.dtype = torch.float32) -> Iterator[np.ndarray]:
        """The array in C order, a few MB at a time, in ``dtype`` (float32, or bfloat16 as ml_dtypes' bfloat16)."""
        source = self._source()
        if not self.transposed:
            flat = source.reshape(-1)
            step = max(1, CHUNK_BYTES // 4)
            for start in range(0, flat.numel(), step):
                yield _numpy(flat[start:start + step], dtype)
            return
        rows, cols = source.shape
        step = max(1, CHUNK_BYTES // (4 * rows))  # output rows are source columns
        for start in range(0, cols, step):
            # torch's transposing copy (converting in the same pass) is 2x numpy's on the 2-byte bfloat16
            part = source[:, start:start + step].t()
            yield _numpy(torch.empty(part.shape, dtype=dtype).copy_(part), dtype)

    def materialize(self, dtype: torch.dtype = torch.float32) -> np.ndarray:
        """The whole array, each chunk written into it as it comes (a list of chunks and their concatenation
        would hold it twice: a streamed compression reads DeepSeek-V3's 1.9 GB lm_head so)."""
        out, start = None, 0
        for chunk in self.chunks(dtype):
            if out is None:
                out = np.empty(int(np.prod(self.shape, dtype=np.int64)), chunk.dtype)
            out[start:start + chunk.size] = chunk.reshape(-1)
            start += chunk.size
        assert out is not None and start == out.size  # a weight has at least one chunk, and they cover it
        return out.reshape(self.shape)


def _numpy(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """``t`` in ``dtype`` as numpy; numpy has no bfloat16, so its bits are viewed as ml_dtypes' (any strides)."""
    t = t.to(dtype)
    return t.numpy() if dtype == torch.float32 else t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


_IR_DTYPES = {torch.float32: ir.DataType.FLOAT, torch.bfloat16: ir.DataType.BFLOAT16}


class ChunkedTensor:
    """An ONNX float32 or bfloat16 tensor (onnx-ir's TensorProtocol) whose bytes are produced chunk by chunk when
    it is written to a file. What onnx-ir's LazyTensor hands the writer when it is evaluated; nothing else holds
    one."""

    def __init__(self, array: LazyArray, name: str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.name = name
        self.doc_string = None
        self.metadata_props: dict[str, str] = {}
        self._array = array
        self._dtype = dtype
        self._shape = ir.Shape(array.shape, frozen=True)

    @property
    def size(self) -> int:
        return int(np.prod(self._array.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self._dtype.itemsize

    @property
    def dtype(self) -> ir.DataType:
        return _IR_DTYPES[self._dtype]

    @property
    def shape(self) -> ir.Shape:
        return self._shape

    @property
    def raw(self) -> LazyArray:
        return self._array

    def numpy(self) -> np.ndarray:
        return self._array.materialize(self._dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def tobytes(self) -> bytes:
        return self.numpy().tobytes()

    def tofile(self, file) -> None:
        for chunk in self._array.chunks(self._dtype):
            file.write(chunk.view(np.uint8).data)  # the chunk's own bytes (C order), not a copy


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


class Params:
    """The tensors of one transformers model, by identity: real ones as numpy, meta ones read from ``reader``
    (toolchain/checkpoint/reader.py) by their checkpoint name, in the dtype that holds them exactly."""

    def __init__(self, model: torch.nn.Module, reader=None) -> None:
        self.reader = reader
        self._names = {id(t): name for name, t in [*model.named_parameters(remove_duplicate=False),
                                                   *model.named_buffers(remove_duplicate=False)]}

    def add(self, named: dict[str, torch.Tensor]) -> None:
        """More tensors, by their checkpoint names (a module that is not part of ``model``: the MTP layer's)."""
        self._names.update({id(t): name for name, t in named.items()})

    def name(self, t: torch.Tensor) -> str:
        return self._names[id(t)]

    def lazy(self, name: str, shape: tuple[int, ...]) -> LazyArray:
        """The checkpoint's tensor ``name``, read when written."""
        reader = self.reader
        if reader is None:
            raise ValueError("a meta-device model needs a checkpoint reader for its weights")
        dtype = reader.natural_dtype(name)
        # where a quantized weight's stored codes are, for the shipped scheme; nothing for the others, whose graphs
        # stay the bytes they were
        source = name if reader.shipped(name) is not None else None
        return LazyArray(shape, lambda: reader.tensor(name, dtype), dtype=dtype, source=source)

    def array(self, t: torch.Tensor) -> np.ndarray | LazyArray:
        if t.device.type != "meta":
            return to_numpy(t)
        return self.lazy(self.name(t), tuple(t.shape))

    def expert(self, experts: HFModule, e: int) -> tuple:
        """(gate [I, H], up [I, H], down [H, I]) of routed expert ``e`` of a transformers fused-experts module
        (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]). From a checkpoint they are read by the
        hub's per-expert names, which is how checkpoints store them."""
        inter = experts.gate_up_proj.shape[1] // 2
        if experts.gate_up_proj.device.type != "meta":
            gate_up = to_numpy(experts.gate_up_proj[e])
            return gate_up[:inter], gate_up[inter:], to_numpy(experts.down_proj[e])
        prefix = self.name(experts.gate_up_proj).rsplit(".", 1)[0]
        hidden = experts.gate_up_proj.shape[2]
        return (self.lazy(f"{prefix}.{e}.gate_proj.weight", (inter, hidden)),
                self.lazy(f"{prefix}.{e}.up_proj.weight", (inter, hidden)),
                self.lazy(f"{prefix}.{e}.down_proj.weight", (hidden, inter)))


def storage_for(choice: str, reader) -> str:
    """How an export stores its weights for ``choice`` (STORAGES): "float32", or "bfloat16" for every matrix whose
    checkpoint values are bf16 (vectors, and matrices of other dtypes, stay float32). "auto" is "bfloat16" for a
    bf16 or FP8 checkpoint above BF16_AUTO_BYTES of float32 weights; "bfloat16" on a checkpoint without bf16
    values is an InputError (bf16 would round them)."""
    if choice not in STORAGES:
        raise InputError(f"unknown weight storage {choice!r}; storages: {', '.join(STORAGES)}")
    if choice == "float32" or reader is None:
        return "float32"
    exact = any(len(reader.shape(n)) >= 2 and reader.natural_dtype(n) == torch.bfloat16 for n in reader.names())
    if choice == "bfloat16" and not exact:
        dtypes = sorted({str(reader.stored_dtype(n)).removeprefix("torch.") for n in reader.names()})
        raise InputError(f"{reader.path}: bfloat16 weight storage keeps bf16 checkpoint values exactly, and this "
                         f"checkpoint's are {'/'.join(dtypes)}, which bf16 would round; use float32 or auto")
    if choice == "auto" and not (exact and reader.parameters() * 4 > BF16_AUTO_BYTES):
        return "float32"
    return "bfloat16"
