"""ONNX Runtime's offline optimisation of a graph whose input weights are given up as the artifact's are written:
the compile stage of a build that deletes its input's stage cache entry afterwards (`dstc build --no-keep-stages`).

Why: ORT reads each input tensor from the input's weights file as it writes the optimized graph's, so a plain save
holds both files at once (9.0 + 9.2 GB at DeepSeek-V3's widths x 4 layers, INT4).

How. ORT writes its weights file in the order of its initializer table, which is known only from the model.onnx it
writes after them; so ORT is run twice, its weights file a FIFO that a thread reads:

1. layout: the stream is hashed (BLAKE3) and dropped; ORT's model.onnx gives each output tensor's offset and length.
2. write: the stream is written to the artifact's weights file. An output tensor with a same-named input tensor of
   the same type, shape and length is compared with the input's bytes as it streams past, and what is equal (ORT
   has read it: it reads an input tensor before it writes it) is punched out of the input file, block by block
   (fallocate PUNCH_HOLE). Input tensors that are not in the optimized graph (folded by ORT) go when the stream
   ends. What ORT created (constant folding: DeepSeek's dequantized absorbed kv_b_proj) comes from the stream.

The artifact's weights are ORT's own stream, so its bytes are those ORT writes to a file (tests/compile/
test_ort_streamed.py), and the second run must write the first one's model.onnx and weights (same BLAKE3), else
the stage fails: an input tensor ORT read again after it was released would show there. The input is left whole
(a plain save, one run) when its weights are not one file of disjoint tensors, and a tensor from the first byte
where ORT's tensor of its name differs. The input entry is marked incomplete (``release_input``) before its first
byte goes; another build reading the same entry at that moment would read holes (a build that keeps no stages
builds one recipe, alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3

from toolchain.errors import DstcError
from toolchain.interface.files import ONNX_MODEL, ONNX_WEIGHTS
from toolchain.runtime.engines import ort_options, ort_session

CHUNK = 8 << 20  # bytes read from ORT's stream (and from the input, to compare) at a time
PUNCH_BYTES = 64 << 20  # input bytes given up with one fallocate (each costs ~2 ms)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


@dataclass(frozen=True)
class Tensor:
    name: str
    offset: int
    length: int
    dtype: int
    dims: tuple[int, ...]


def external_tensors(model_path: Path) -> tuple[list[Tensor], set[str], set[str]]:
    """The tensors of a graph (subgraphs included) stored in external data: initializers by name, tensors of
    Constant nodes unnamed; the files they are in; and the names of the initializers stored inline."""
    import onnx  # where a graph is read: the CLI imports the compile stage

    model = onnx.load(str(model_path), load_external_data=False)
    tensors, files, inline = [], set(), set()

    def tensor(t, name: str) -> None:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            inline.add(name)
            return
        info = {e.key: e.value for e in t.external_data}
        files.add(info["location"])
        # no length: to the end of the file (ONNX's external data), which _disjoint refuses
        tensors.append(Tensor(name, int(info.get("offset", 0)), int(info.get("length", -1)), t.data_type,
                              tuple(t.dims)))

    def walk(graph) -> None:
        for t in graph.initializer:
            tensor(t, t.name)
        for node in graph.node:
            for attribute in node.attribute:
                for t in [attribute.t, *attribute.tensors]:
                    if t.ByteSize():
                        tensor(t, "")
                for sub in [attribute.g, *attribute.graphs]:
                    walk(sub)

    walk(model.graph)
    return tensors, files, inline - {""}


def _disjoint(tensors: list[Tensor]) -> bool:
    ordered = sorted(tensors, key=lambda t: t.offset)
    return all(t.length >= 0 for t in tensors) and \
        all(a.offset + a.length <= b.offset for a, b in itertools.pairwise(ordered))


class _Holes:
    """Gives up byte ranges of an open file: the file system blocks wholly inside released ranges are punched out
    (a block shared with a tensor not yet released stays until that one goes too), PUNCH_BYTES at a time."""

    def __init__(self, fd: int) -> None:
        self.fd, self.block = fd, os.fstat(fd).st_blksize
        self.starts: dict[int, int] = {}  # released, merged: start -> end
        self.ends: dict[int, int] = {}  # end -> start
        self.pending = (0, 0)  # blocks to punch, contiguous
        self.bytes = 0
        self._libc = ctypes.CDLL(None, use_errno=True)

    def release(self, offset: int, length: int) -> None:
        start, end = offset, offset + length
        if start in self.ends:
            start = self.ends.pop(start)
            del self.starts[start]
        if end in self.starts:
            end = self.starts.pop(end)
            del self.ends[end]
        self.starts[start], self.ends[end] = end, start
        block = self.block
        lo = max(-(-start // block) * block, offset // block * block)
        hi = min(end // block * block, -(-(offset + length) // block) * block)
        if hi <= lo:
            return
        if lo != self.pending[1]:
            self.flush()
            self.pending = (lo, lo)
        self.pending = (self.pending[0], hi)
        if hi - self.pending[0] >= PUNCH_BYTES:
            self.flush()

    def flush(self) -> None:
        lo, hi = self.pending
        self.pending = (hi, hi)
        if hi > lo:
            if self._libc.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, ctypes.c_int64(lo),
                                    ctypes.c_int64(hi - lo)):
                error = ctypes.get_errno()
                raise OSError(error, f"punching a hole in the input weights: {os.strerror(error)}")
            self.bytes += hi - lo


class _Stream(threading.Thread):
    """Reads ORT's weights file from a FIFO to its end, chunk by chunk into ``consume``. The FIFO is opened for
    reading before ORT runs and held open for writing by this process too until ORT has returned, so that neither
    side ever waits for the other to open it; a failing consumer is recorded and the rest of the stream drained, so
    that ORT never blocks on a pipe nobody reads."""

    def __init__(self, fifo: Path, consume: Callable[[int, memoryview], None]) -> None:
        super().__init__(daemon=True)
        self.consume, self.size = consume, 0
        self.error: BaseException | None = None
        self.fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(self.fd, True)
        with contextlib.suppress(OSError):  # a larger pipe: fewer, longer reads (Linux allows up to 1 MiB)
            fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        self._writer = os.open(fifo, os.O_WRONLY)

    def run(self) -> None:
        buffer = bytearray(CHUNK)
        with open(self.fd, "rb", buffering=0) as stream:
            while n := stream.readinto(buffer):
                if self.error is None:
                    try:
                        self.consume(self.size, memoryview(buffer)[:n])
                    except BaseException as error:  # raised by finish(), once ORT has returned
                        self.error = error
                self.size += n

    def finish(self) -> None:
        os.close(self._writer)  # ORT's end is closed: the reader sees the stream's end
        self.join()
        if self.error is not None:
            raise self.error


def _ort_save(src: Path, dst: Path, external_min_bytes: int, consume: Callable[[int, memoryview], None]) -> int:
    """ORT's basic optimisation of ``src`` saved as ``dst``, its weights streamed into ``consume``: their bytes."""
    fifo = dst.parent / ONNX_WEIGHTS
    os.mkfifo(fifo)
    try:
        stream = _Stream(fifo, consume)
        stream.start()
        try:
            session = ort_session(src, ort_options(level="basic", optimized_path=dst, optimized_external=ONNX_WEIGHTS,
                                                   external_min_bytes=external_min_bytes))
            del session  # before the next run: one ORT session's memory at a time
        finally:
            stream.finish()
    finally:
        fifo.unlink(missing_ok=True)  # ORT removes a weights file it finds empty (a FIFO's size is 0) once saved
    return stream.size


def optimize_releasing(src: Path, dst: Path, external_min_bytes: int, release_input: Callable[[], None],
                       log: Callable[[str], None]) -> bool:
    """ORT's basic optimisation of ``src`` saved as ``dst``, its tensors of ``external_min_bytes`` or more in
    ONNX_WEIGHTS beside it, while the input's weights file (beside ``src``) is given up tensor by tensor (module
    docstring); ``release_input`` is called before its first byte goes. False, with nothing written, when the
    input's weights are not one file of disjoint tensors: the caller saves it the plain way."""
    inputs, files, _ = external_tensors(src)
    weights = src.parent / ONNX_WEIGHTS
    if files != {ONNX_WEIGHTS} or not _disjoint(inputs) or not weights.is_file():
        log(f"the input's weights are not one file of disjoint tensors ({', '.join(sorted(files)) or 'none'}): "
            f"kept whole while ONNX Runtime writes the artifact's")
        return False
    scratch = dst.parent / ".layout"
    scratch.mkdir()
    first = blake3.blake3()

    def hash_only(_offset: int, chunk: memoryview) -> None:
        first.update(chunk)

    log("ONNX Runtime's optimised graph, once for the layout of its weights file (not written)")
    _ort_save(src, scratch / ONNX_MODEL, external_min_bytes, hash_only)
    outputs, _, output_inline = external_tensors(scratch / ONNX_MODEL)
    by_name = {t.name: t for t in inputs if t.name}
    # an output tensor that is an input one, unchanged: same name, type, shape and size
    copies = sorted(((t, by_name[t.name]) for t in outputs if t.name in by_name and t.length and
                     (by_name[t.name].dtype, by_name[t.name].dims, by_name[t.name].length) == (t.dtype, t.dims,
                                                                                                t.length)),
                    key=lambda pair: pair[0].offset)
    folded = [t for t in inputs if t.name and t.name not in {o.name for o in outputs} | output_inline]
    release_input()
    part = dst.parent / f".{ONNX_WEIGHTS}.part"
    second = blake3.blake3()
    with open(weights, "r+b", buffering=0) as source, open(part, "wb", buffering=0) as out:
        holes = _Holes(source.fileno())
        writer = _Releasing(copies, source.fileno(), holes)

        def consume(offset: int, chunk: memoryview) -> None:
            out.write(chunk)
            second.update(chunk)
            writer(offset, chunk)

        log("ONNX Runtime's optimised graph again, into the artifact, the input's weights given up as they are "
            "written")
        size = _ort_save(src, dst, external_min_bytes, consume)
        for t in folded:  # read by ORT's constant folding, before it wrote anything
            holes.release(t.offset, t.length)
        holes.flush()
    same_graph = (scratch / ONNX_MODEL).read_bytes() == dst.read_bytes()
    shutil.rmtree(scratch)
    if not same_graph or second.digest() != first.digest():
        part.unlink()
        raise DstcError("ONNX Runtime wrote another graph or other weights on its second run of the same "
                        "optimisation; build again with the stages kept (without --no-keep-stages)")
    if outputs:  # ORT writes a weights file when a tensor goes there
        part.rename(dst.parent / ONNX_WEIGHTS)
    else:
        part.unlink()
    created = sum(t.length for t in outputs) - sum(o.length for o, _ in copies)
    log(f"{holes.bytes / 1e9:.2f} GB of the input's weights given up as the artifact's {size / 1e9:.2f} GB "
        f"were written; {len(copies)} of its {len(outputs)} tensors are the input's, unchanged "
        f"({len(writer.differ)} of the same name, type and shape differ), {created / 1e9:.2f} GB were made by ORT")
    return True


class _Releasing:
    """Compares each output tensor that should be an input one with the input's bytes as ORT's stream passes it,
    and releases what has passed, equal: ORT has read those bytes (the tensor's rest follows in the next chunks)."""

    def __init__(self, copies: list[tuple[Tensor, Tensor]], source_fd: int, holes: _Holes) -> None:
        self.copies, self.fd, self.holes = copies, source_fd, holes
        self.next, self.equal = 0, True
        self.differ: list[str] = []

    def __call__(self, offset: int, chunk: memoryview) -> None:
        end = offset + len(chunk)
        while self.next < len(self.copies):
            out, src = self.copies[self.next]
            lo, hi = max(out.offset, offset), min(out.offset + out.length, end)
            if lo >= end:
                return
            if hi > lo and self.equal:
                start = src.offset + lo - out.offset
                # bytes == bytes is a memcmp; bytes == memoryview compares byte by byte, 30x slower
                self.equal = os.pread(self.fd, hi - lo, start) == bytes(chunk[lo - offset:hi - offset])
                if self.equal:
                    self.holes.release(start, hi - lo)
            if out.offset + out.length > end:
                return  # the rest of this tensor comes in the next chunk
            if not self.equal:
                self.differ.append(out.name)
            self.next, self.equal = self.next + 1, True
