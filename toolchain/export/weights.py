"""Where the exporter's weights come from: read from the checkpoint one tensor at a time, when the graph is saved.

The graph builders walk a transformers model for its structure and attributes (head counts, eps, scaling, routing
settings). That model is a skeleton on the meta device: its parameters have shapes and names but no data. Each
weight the builders ask for becomes a :class:`LazyArray`, a recipe to read the tensor from the checkpoint and
transform it (reorder rows, transpose), which the graph keeps as an ``ir.LazyTensor``. onnx-ir's save evaluates
them one at a time and calls ``tofile`` on each, and :class:`ChunkedTensor` writes its float32 bytes a few MB at
a time: a weight is held in memory only in its checkpoint dtype (bf16 for bf16 and FP8 checkpoints), never as a
full float32 copy beside a transposed one, so exporting needs about one weight's bf16 bytes whatever the model.
A model loaded with real weights (the embedded models' reference, tests) works the same way, its tensors taken
as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

CHUNK_BYTES = 16 << 20  # float32 bytes written per step


@dataclass(frozen=True)
class LazyArray:
    """A float32 array that is read only when written: ``read()`` gives the source tensor (torch, any float
    dtype); ``rows`` reorders or selects its first axis; ``transposed`` swaps the two axes of a matrix."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    rows: np.ndarray | None = None
    transposed: bool = False

    @property
    def T(self) -> "LazyArray":  # noqa: N802 - numpy's name
        if len(self.shape) != 2:
            raise ValueError(f"only a matrix is transposed lazily, not shape {self.shape}")
        return LazyArray(self.shape[::-1], self.read, self.rows, not self.transposed)

    def __getitem__(self, index) -> "LazyArray":
        """Rows of the source (an index array or a slice), before any transpose."""
        if self.transposed or self.rows is not None:
            raise ValueError("a lazy weight takes one row selection, before it is transposed")
        rows = np.arange(self.shape[0])[index]
        return LazyArray((len(rows), *self.shape[1:]), self.read, rows)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * 4

    def _source(self) -> torch.Tensor:
        source = self.read()
        if self.rows is not None:
            source = source[torch.from_numpy(self.rows)]
        return source

    def chunks(self) -> Iterator[np.ndarray]:
        """The float32 array in C order, a few MB at a time."""
        source = self._source()
        if not self.transposed:
            flat = source.reshape(-1)
            step = max(1, CHUNK_BYTES // 4)
            for start in range(0, flat.numel(), step):
                yield flat[start:start + step].to(torch.float32).numpy()
            return
        rows, cols = source.shape
        step = max(1, CHUNK_BYTES // (4 * rows))  # output rows are source columns
        for start in range(0, cols, step):
            yield np.ascontiguousarray(source[:, start:start + step].to(torch.float32).numpy().T)

    def materialize(self) -> np.ndarray:
        return np.concatenate([c.reshape(-1) for c in self.chunks()]).reshape(self.shape)


class ChunkedTensor:
    """An ONNX float32 tensor (onnx-ir's TensorProtocol) whose bytes are produced chunk by chunk when it is written
    to a file. What onnx-ir's LazyTensor hands the writer when it is evaluated; nothing else holds one."""

    def __init__(self, array: LazyArray, name: str | None = None) -> None:
        self.name = name
        self.doc_string = None
        self.metadata_props: dict[str, str] = {}
        self._array = array
        self._shape = ir.Shape(array.shape, frozen=True)

    @property
    def size(self) -> int:
        return int(np.prod(self._array.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self._array.nbytes

    @property
    def dtype(self) -> ir.DataType:
        return ir.DataType.FLOAT

    @property
    def shape(self) -> ir.Shape:
        return self._shape

    @property
    def raw(self) -> LazyArray:
        return self._array

    def numpy(self) -> np.ndarray:
        return self._array.materialize()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def tobytes(self) -> bytes:
        return self.numpy().tobytes()

    def tofile(self, file) -> None:
        for chunk in self._array.chunks():
            file.write(chunk.tobytes())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


class Params:
    """The tensors of one transformers model, by identity: real ones as numpy, meta ones read from ``reader``
    (toolchain/checkpoint/reader.py) by their checkpoint name, in the dtype that holds them exactly."""

    def __init__(self, model: torch.nn.Module, reader=None) -> None:
        self.reader = reader
        self._names = {id(t): name for name, t in [*model.named_parameters(remove_duplicate=False),
                                                   *model.named_buffers(remove_duplicate=False)]}

    def name(self, t: torch.Tensor) -> str:
        return self._names[id(t)]

    def _lazy(self, name: str, shape: tuple[int, ...]) -> LazyArray:
        reader = self.reader
        if reader is None:
            raise ValueError("a meta-device model needs a checkpoint reader for its weights")
        return LazyArray(shape, lambda: reader.tensor(name, reader.natural_dtype(name)))

    def array(self, t: torch.Tensor) -> np.ndarray | LazyArray:
        if t.device.type != "meta":
            return to_numpy(t)
        return self._lazy(self.name(t), tuple(t.shape))

    def expert(self, experts: torch.nn.Module, e: int) -> tuple:
        """(gate [I, H], up [I, H], down [H, I]) of routed expert ``e`` of a transformers fused-experts module
        (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]). From a checkpoint they are read by the
        hub's per-expert names, which is how checkpoints store them."""
        inter = experts.gate_up_proj.shape[1] // 2
        if experts.gate_up_proj.device.type != "meta":
            gate_up = to_numpy(experts.gate_up_proj[e])
            return gate_up[:inter], gate_up[inter:], to_numpy(experts.down_proj[e])
        prefix = self.name(experts.gate_up_proj).rsplit(".", 1)[0]
        hidden = experts.gate_up_proj.shape[2]
        return (self._lazy(f"{prefix}.{e}.gate_proj.weight", (inter, hidden)),
                self._lazy(f"{prefix}.{e}.up_proj.weight", (inter, hidden)),
                self._lazy(f"{prefix}.{e}.down_proj.weight", (hidden, inter)))
