"""Weight compression one weight at a time, for exports whose float weights do not fit in memory.

``nncf.compress_weights`` takes a whole model: on ONNX a ModelProto that holds every weight (and that NNCF
serializes again), on OpenVINO an ov.Model whose constants, converted from the export, touch every page of it.
At real size (R1-Distill-Qwen-7B: 30 GB of float32) neither fits. This module applies NNCF's own per-weight
quantization (``weight_lowering``'s, what NNCF's ONNX backend calls in ``transform_model``, through
toolchain/compress/lowering.py) and writes its result in the forms that backend writes, with its names:

* grouped INT4 below opset 21 (the onnxruntime target): ``MatMulNBits`` with B packed by NNCF's
  ``pack_int4_to_uint8``, scales [N, blocks], zero points packed two per byte [N, ceil(blocks / 2)] (what
  to-matmul-nbits makes of NNCF's own one-per-byte output), so the pass reads none of the weight's tensors;
* grouped INT4 at opset 21 (the openvino target): ``DequantizeLinear`` with ``block_size`` on axis 0, uint4/int4
  weights and zero points, which OpenVINO's ONNX frontend turns into its compressed-weight pattern (u4 constant,
  Convert, Subtract, Multiply) and its CPU plugin runs as a compressed FullyConnected;
* INT8 per output channel: ``DequantizeLinear`` on axis 1 of a [K, N] MatMul weight, axis 0 (per row) of an
  embedding table.
* the int8-per-head scheme: the same per-axis ``DequantizeLinear``, its values from the int8-per-head pass's own
  quantization (``passes.quantize._weights.quantize_int8``), one scale per head's block of output channels on the
  projections with heads (widths from the graph's ``dstc.head_layout``), per channel or per row elsewhere: the
  tensors the pass writes on the whole model, with its names.
* a 3-D [heads, K, N] MatMul weight (MLA's absorbed kv_b_proj, toolchain/export/deepseek.py), in every scheme:
  NNCF's INT8 per output channel of each head, written as ``(Cast(q) - zero point) * scale`` with [heads, 1, N]
  scales: the form the ORT rewrite gives NNCF's own INT8 of it on the whole-model path (toolchain/compress/
  engine.py), and a compressed-weight pattern to OpenVINO's ONNX frontend.

Each quantized tensor is an ``ir.LazyTensor``: the weight is read from the export's external data (a memory map)
in column (or row) chunks, each chunk quantized independently (a group lies along one column, a table's scale
along one row, so chunking changes nothing), when the first of the weight's tensors is saved, and dropped once
the last one is. So the whole compression holds one weight's quantized form, and onnx-ir's save writes each
tensor as it comes. The relative weight error ||W - Ŵ|| / ||W|| is accumulated chunk by chunk on the way.

Scale estimation: a weight given its input's calibration statistics (``Spec.statistics``, computed layer by layer
by toolchain/compress/layer_statistics.py) is read whole once, NNCF's ``ScaleEstimation`` gives its scales and
zero points, and its chunks are quantized with them. AWQ: ``Spec.row_scale`` / ``column_scale`` (from
toolchain/compress/streamed_awq.py) scale each chunk as it is read. GPTQ (which updates weights in sequence on
the model's activations) and mixed precision with ratio < 1 (which ranks every weight first) stay on the
whole-model path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import cast

import numpy as np
import onnx_ir as ir

from passes.graph import Names, initializer_data, name_of, present, stored_weight
from passes.quantize._weights import MS_DOMAIN, quantize_int8
from passes.quantize.int8_per_head import projection_of
from passes.quantize.matmul_nbits import ToMatMulNBits, nbits_layout, pack_nibbles
from toolchain.compress import lowering
from toolchain.compress.engine import MIN_ADJUSTED_GROUP_SIZE, Options, Weight
from toolchain.errors import InputError

# float32 bytes of a weight read and quantized per step: below glibc's 32 MB ceiling for serving an allocation
# from the heap, so a chunk's buffers are reused rather than mapped fresh (first-touch page faults cost up to
# 1.5 s/GB on a VM): 2.3x faster on a 151936-wide lm_head than 64 MB chunks, the same result.
CHUNK_BYTES = 16 << 20
DQ_OPSET = 21  # DequantizeLinear's block_size and 4-bit types


def adjusted_group(k: int, group: int) -> int | None:
    """NNCF's GroupSizeFallbackMode.ADJUST: the group size, or the largest power of two below it that divides K
    and is at least MIN_ADJUSTED_GROUP_SIZE; None when there is none (the weight goes to the backup precision)."""
    size = group
    while size >= MIN_ADJUSTED_GROUP_SIZE:
        if k % size == 0:
            return size
        size //= 2
    return None


@dataclass
class Spec:
    """How one weight is compressed: bits, group (None: per channel), symmetric, and the form it is written in."""

    weight: Weight
    bits: int
    group: int | None
    sym: bool
    # "nbits" (MatMulNBits) | "dq-blocked" | "dq-channel" (MatMul weight) | "dq-rows" (Gather table) | "stacked"
    # (a 3-D MatMul weight, Cast / Sub / Mul); for ONNX Runtime, the forms its to-matmul-nbits pass makes of an
    # INT8 per-channel MatMul weight and table, written as such (``ORT_FORMS``)
    form: str
    # None: NNCF's quantization; a width: the int8-per-head pass's, one scale per this many output channels
    channels_per_scale: int | None = None
    # the input's calibration statistics (an nncf WCTensorStatistic) for NNCF's scale estimation, INT4 only
    statistics: object | None = None
    # AWQ's per-channel scales of a [K, N] weight, applied as it is read: its rows (input channels: the MatMul
    # AWQ corrects) or its columns (output channels: the MatMul before it, which takes the inverse)
    row_scale: np.ndarray | None = None
    column_scale: np.ndarray | None = None

    def read(self, part: np.ndarray, start: int) -> np.ndarray:
        """A float32 column chunk (columns ``start``...) of the weight as it is to be quantized: AWQ's scales
        applied."""
        if self.row_scale is not None:
            part *= self.row_scale[:, None]
        if self.column_scale is not None:
            part *= self.column_scale[None, start:start + part.shape[1]]
        return part

    @property
    def group_size(self) -> int:
        """The group of a blocked form (nbits, dq-blocked), which always has one."""
        if self.group is None:
            raise ValueError(f"a {self.form} weight without a group size")
        return self.group

    @property
    def precision(self) -> str:
        kind = f"g{self.group}" if self.group else \
            "per-head" if (self.channels_per_scale or 1) > 1 else "per-channel"
        return f"int{self.bits}-{'sym' if self.sym else 'asym'}-{kind}"


@dataclass(kw_only=True)
class ComputedOnSave:
    """Tensors computed together when the first of them is saved (``_compute``) and released after the last of
    the ``pending`` keys is taken; a writer may save them on two threads, so they are computed once."""

    pending: set[str] = field(default_factory=set)
    result: dict[str, np.ndarray] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, key: str) -> np.ndarray:
        with self.lock:
            if self.result is None:
                self.result = self._compute()
            array = self.result[key]
            self.pending.discard(key)
            if not self.pending:
                self.result = None
            return array

    def _compute(self) -> dict[str, np.ndarray]:
        raise NotImplementedError


@dataclass
class Job(ComputedOnSave):
    """One weight's quantization, computed when the first of its tensors is saved and released after the last."""

    spec: Spec
    source: ir.Value
    stats: dict = field(default_factory=dict)

    def _tensor(self) -> ir.TensorProtocol:
        if self.source.const_value is None:
            raise ValueError(f"{self.source.name} is not an initializer with data")
        return self.source.const_value

    def _compute(self) -> dict[str, np.ndarray]:
        if self.spec.channels_per_scale is not None:
            return self._compute_int8_per_head(self.spec.channels_per_scale)
        if self.spec.form == "stacked":
            return self._compute_stacked()
        from nncf.onnx.graph.onnx_helper import pack_int4_to_uint8

        spec, tensor = self.spec, self._tensor()
        mode = f"INT{spec.bits}_{'SYM' if spec.sym else 'ASYM'}"
        weight = tensor.numpy()  # a memory map of the export's external data: nothing is read yet
        rows_axis = spec.form in ("dq-rows", "rows")  # a table's scale is per row: chunks of rows, else of columns
        transposed = spec.form == "nbits8"  # MatMulNBits' [N, K]: a column chunk's values are rows of it
        axis = 1 if rows_axis else 0  # the reduction axis
        length = weight.shape[0] if rows_axis else weight.shape[1]
        step = max(1, CHUNK_BYTES // (4 * weight.shape[1 if rows_axis else 0]))
        chunk_axis = 0 if rows_axis else -1  # of the values, scales and zero points
        # each written into the whole weight's array as it comes: a list of chunks and their concatenation would
        # hold the quantized weight twice (0.9 GB more for DeepSeek-V3's INT8 embedding table)
        estimated = None
        if spec.statistics is not None:  # from the whole weight, which scale estimation reads at once
            estimated = lowering.estimate_scales(spec.read(np.array(weight, np.float32), 0), spec.statistics, mode,
                                                 spec.group)
        q = scale = zp = None  # zero points: in every chunk or (symmetric) in none
        err = norm = 0.0
        for start in range(0, length, step):
            part = weight[start:start + step] if rows_axis else weight[:, start:start + step]
            part = np.array(part, dtype=np.float32, order="C")  # a copy: no view of the map outlives the loop
            if not rows_axis:
                part = spec.read(part, start)
            given = (None, None) if estimated is None else \
                tuple(None if a is None else a[..., start:start + step] for a in estimated)
            quantized = lowering.quantize(part, axis, mode, spec.group, scale=given[0], zero_point=given[1])
            err += quantized.squared_error
            norm += quantized.squared_norm
            values = quantized.q.reshape(part.shape)
            q = _place(q, values.T, 0, start, length) if transposed else _place(q, values, chunk_axis, start, length)
            scale = _place(scale, quantized.scale, chunk_axis, start, length)
            if quantized.zero_point is not None:
                zp = _place(zp, quantized.zero_point, chunk_axis, start, length)
        del weight, part
        if isinstance(tensor, ir.ExternalTensor):
            tensor.release()  # unmaps the export's pages of this weight
        assert q is not None and scale is not None  # a weight has at least one chunk
        scale = scale.astype(np.float32, copy=False)
        self.stats = {"weight_error": float(np.sqrt(err / norm)) if norm else 0.0}
        if spec.group:  # [K/g, 1, N] -> [K/g, N]
            scale = scale.squeeze(1)
            zp = None if zp is None else zp.squeeze(1)
        else:  # per channel: [1, N] (columns) or [V, 1] (rows) -> [N] / [V]
            scale = scale.reshape(-1)
            zp = None if zp is None else zp.reshape(-1)
        out = {"scale": scale}
        if spec.form == "nbits8":
            return _nbits8(q, scale, zp)
        if spec.form == "rows":  # to-matmul-nbits' Gather of rows: [V, 1] float32 scales and zero points
            return {"quantized": q, "scale": scale.reshape(-1, 1)} | \
                ({} if zp is None else {"zero_point": zp.astype(np.float32).reshape(-1, 1)})
        if spec.form == "nbits":
            out["quantized"] = pack_int4_to_uint8(q, spec.group, signed=spec.sym)
            out["scale"] = np.ascontiguousarray(scale.T)
            if zp is not None:  # packed as ORT reads them, so that to-matmul-nbits has nothing to read here
                out["zero_point"] = pack_nibbles(np.ascontiguousarray(zp.T))
        else:
            out["quantized"] = q
            if zp is not None:
                out["zero_point"] = zp.astype(q.dtype)
        return out

    def _compute_stacked(self) -> dict[str, np.ndarray]:
        """NNCF's INT8 per output channel of each head's [K, N] matrix, a head at a time."""
        spec, tensor = self.spec, self._tensor()
        qs, scales = [], []
        zps: list[np.ndarray | None] = []
        heads: list[float] = []
        err = norm = 0.0
        weight = tensor.numpy()  # a memory map of the export's external data
        for h in range(weight.shape[0]):
            part = np.array(weight[h], dtype=np.float32, order="C")  # a copy: no view of the map outlives the loop
            quantized = lowering.quantize(part, 0, f"INT8_{'SYM' if spec.sym else 'ASYM'}", None)
            head_err, head_norm = quantized.squared_error, quantized.squared_norm
            heads.append(float(np.sqrt(head_err / head_norm)) if head_norm else 0.0)
            err += head_err
            norm += head_norm
            qs.append(quantized.q.reshape(part.shape))
            scales.append(quantized.scale.reshape(1, -1))
            zps.append(None if quantized.zero_point is None else quantized.zero_point.reshape(1, -1))
        del weight, part
        if isinstance(tensor, ir.ExternalTensor):
            tensor.release()  # unmaps the export's pages of this weight (a view still held would refuse)
        # a head per index of axis 0, as the whole-model path reports it (toolchain/compress/metrics.py head_errors)
        self.stats = {"weight_error": float(np.sqrt(err / norm)) if norm else 0.0, "head_errors": heads}
        out = {"quantized": np.stack(qs), "scale": np.stack(scales).astype(np.float32)}
        if zps[0] is not None:
            # one config for every head: all have a zero point, or none
            out["zero_point"] = np.stack(cast("list[np.ndarray]", zps)).astype(np.float32)
        return out

    def _compute_int8_per_head(self, width: int) -> dict[str, np.ndarray]:
        spec, tensor = self.spec, self._tensor()
        weight = tensor.numpy()
        rows_axis = spec.form == "dq-rows"  # a table's channels are its rows
        length = weight.shape[0] if rows_axis else weight.shape[1]
        step = max(1, CHUNK_BYTES // (4 * weight.shape[1 if rows_axis else 0]))
        step = max(width, step // width * width)  # a head's channels never split between two chunks
        qs, scales, zps = [], [], []  # zero points: in every chunk or (symmetric) in none
        err = norm = 0.0
        for start in range(0, length, step):
            part = weight[start:start + step] if rows_axis else weight[:, start:start + step]
            part = np.array(part, dtype=np.float32, order="C")
            quantized = quantize_int8(part.T if rows_axis else part, width, sym=spec.sym)
            restored = quantized.dequantize()
            err += float(np.square((part.T if rows_axis else part) - restored, dtype=np.float32).sum(dtype=np.float64))
            norm += float(np.square(part, dtype=np.float32).sum(dtype=np.float64))
            qs.append(quantized.q.T if rows_axis else quantized.q)
            scales.append(quantized.scale)
            if quantized.zero_point is not None:
                zps.append(quantized.zero_point)
        del weight, part, quantized, restored
        if isinstance(tensor, ir.ExternalTensor):
            tensor.release()
        self.stats = {"weight_error": float(np.sqrt(err / norm)) if norm else 0.0}
        out = {"quantized": np.concatenate(qs, axis=0 if rows_axis else 1), "scale": np.concatenate(scales)}
        if zps:
            out["zero_point"] = np.concatenate(zps)
        return out


def _place(whole: np.ndarray | None, chunk: np.ndarray, axis: int, start: int, length: int) -> np.ndarray:
    """``chunk`` written at ``start`` along ``axis`` of ``whole`` (made on the first chunk: the chunk's shape and
    dtype with ``length`` along ``axis``)."""
    if whole is None:
        shape = list(chunk.shape)
        shape[axis] = length
        whole = np.empty(shape, chunk.dtype)
    index = [slice(None)] * chunk.ndim
    index[axis] = slice(start, start + chunk.shape[axis])
    whole[tuple(index)] = chunk
    return whole


def _nbits8(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None) -> dict[str, np.ndarray]:
    """NNCF's INT8 per output channel of a [K, N] weight (``q`` transposed: [N, K]) as to-matmul-nbits writes it:
    MatMulNBits' 8-bit B [N, blocks, block], symmetric values offset to uint8 (its default zero point 128),
    the per-channel scale and zero point repeated per block, padding that dequantizes to exactly 0."""
    n, k = q.shape
    block, blocks = nbits_layout(k, 4 if zp is None else 5)
    u = (q.astype(np.int16) + 128).astype(np.uint8) if zp is None else q.astype(np.uint8, copy=False)
    zp_u8 = None if zp is None else zp.astype(np.uint8).reshape(n)
    if block * blocks > k:
        u = np.concatenate([u, np.full((n, block - k), 128, np.uint8) if zp_u8 is None else
                            np.repeat(zp_u8[:, None], block - k, 1)], axis=1)
    out = {"quantized": u.reshape(n, blocks, block), "scale": np.repeat(scale.reshape(n, 1), blocks, 1)}
    if zp_u8 is not None:
        out["zero_point"] = np.repeat(zp_u8.reshape(n, 1), blocks, 1)
    return out


def _computed(job: Job, key: str, dtype: ir.DataType) -> ir.TensorProtocol:
    return ir.tensor(job.take(key), dtype=dtype)


def stored_bits(spec: Spec) -> int:
    """Bits the compressed weight takes in the artifact: values, float32 scales and packed zero points."""
    if spec.form == "stacked":  # float32 scales and zero points per head and output channel
        heads, k, n = spec.weight.shape
        return heads * n * (k * spec.bits + 32 * (1 if spec.sym else 2))
    k, n = spec.weight.shape
    if spec.group:
        blocks = -(-k // spec.group) * n
        values = blocks * spec.group * spec.bits
    else:
        blocks, values = (k if spec.form in ("dq-rows", "rows") else n), k * n * spec.bits
    return values + 32 * blocks + (0 if spec.sym else spec.bits * blocks)


def _dtype(spec: Spec, key: str) -> ir.DataType:
    if key == "scale" or (spec.form in ("stacked", "rows") and key == "zero_point"):
        return ir.DataType.FLOAT
    if spec.form in ("nbits", "nbits8"):
        return ir.DataType.UINT8
    if spec.bits == 4:
        return ir.DataType.INT4 if spec.sym else ir.DataType.UINT4
    return ir.DataType.INT8 if spec.sym else ir.DataType.UINT8


def _shapes(spec: Spec, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    side: tuple[int, ...]
    if spec.form == "stacked":  # [heads, K, N]: a scale (and zero point) per head and output channel
        side = (shape[0], 1, shape[2])
        return {"quantized": shape, "scale": side} | ({} if spec.sym else {"zero_point": side})
    first, second = shape
    if spec.form == "nbits8":  # [K, N] -> [N, blocks, block]; scales (and zero points) [N, blocks]
        block, blocks = nbits_layout(first, 4 if spec.sym else 5)
        side = (second, blocks)
        return {"quantized": (second, blocks, block), "scale": side} | ({} if spec.sym else {"zero_point": side})
    if spec.form == "rows":
        side = (first, 1)
        return {"quantized": shape, "scale": side} | ({} if spec.sym else {"zero_point": side})
    if spec.form == "nbits":  # [K, N] -> B [N, blocks, group / 2], scales and zero points [N, blocks]
        blocks = -(-first // spec.group_size)
        shapes = {"quantized": (second, blocks, spec.group_size // 2), "scale": (second, blocks)}
        return shapes | ({} if spec.sym else {"zero_point": (second, -(-blocks // 2))})  # two per byte
    if spec.form == "dq-blocked":
        side = (first // spec.group_size, second)
    else:
        side = (first,) if spec.form == "dq-rows" else (second,)
    return {"quantized": shape, "scale": side, **({} if spec.sym else {"zero_point": side})}


def plan_specs(weights: list[Weight], plan: dict[str, str], options: Options, target: str) -> list[Spec]:
    """What to do with each weight the plan compresses (fp32 ones are left out); raises InputError for what the
    streaming form does not do."""
    specs = []
    for w in weights:
        precision = plan[w.name]
        if precision == "fp32":
            continue
        if len(w.shape) == 3 and w.kind == "matmul":  # INT8 in every scheme, as on the whole-model path
            specs.append(Spec(w, 8, None, options.sym, "stacked"))
            continue
        if precision == "int8-per-head" and len(w.shape) == 2:
            # heads where the exporter recorded them (the graph's dstc.head_layout, as the whole-model path)
            width = options.head_blocks.get(projection_of(w.name)) if w.kind == "matmul" else None
            width = width if width and w.shape[1] % width == 0 else 1
            specs.append(Spec(w, 8, None, options.sym, "dq-rows" if w.kind == "gather" else "dq-channel", width))
            continue
        if precision not in ("int4", "int8") or len(w.shape) != 2:
            raise InputError(f"{w.name}: {precision} of a {len(w.shape)}-D weight is not available in bounded "
                             f"memory; use int4-grouped, int8-per-channel or int8-per-head")
        ort = target == "onnxruntime"
        if w.kind == "gather":
            if precision == "int4":
                raise InputError(f"{w.name}: INT4 embeddings are not available in bounded memory; use int8")
            specs.append(Spec(w, 8, None, options.sym, "rows" if ort else "dq-rows"))
            continue
        group = adjusted_group(w.shape[0], options.group_size) if precision == "int4" else None
        if precision == "int4" and group is not None:
            specs.append(Spec(w, 4, group, options.sym, "nbits" if ort else "dq-blocked"))
        elif precision == "int8" or options.backup == "int8":
            specs.append(Spec(w, 8, None, options.sym, "nbits8" if ort else "dq-channel"))
    return specs


# ONNX Runtime's forms of an INT8 per-channel table and MatMul weight (what to-matmul-nbits makes of their
# DequantizeLinear), written directly: the pass would compute them before the save, one at a time and each held
# until written (a 151936-row table and lm_head: 3.4 s of the 1.5B's compression, serial), where the save computes
# them beside the other weights. Their names are the pass's. A weight read otherwise (a tied table) keeps the
# DequantizeLinear form the pass rewrites.
ORT_FORMS = {"rows": ("dq-rows", {"quantized": "quantized", "scale": "quantized_row_scale",
                                  "zero_point": "quantized_row_zero_point"}),
             "nbits8": ("dq-channel", {"quantized": "quantized_nbits", "scale": "quantized_nbits_scale",
                                       "zero_point": "quantized_nbits_zero_point"})}


def _ort_form_fits(spec: Spec, read: ir.Value) -> bool:
    uses = list(read.uses())
    if spec.form == "rows":  # every reader a Gather of rows
        return bool(uses) and all(node.op_type == "Gather" and index == 0 and node.attributes.get_int("axis", 0) == 0
                                  for node, index in uses)
    return len(uses) == 1 and uses[0][0].op_type == "MatMul" and uses[0][1] == 1


def compress_streaming(model: ir.Model, specs: list[Spec], log: Callable[[str], None],
                       keep: bool = False) -> dict[str, Job]:
    """Rewrite ``model`` in place with each spec's compressed form (lazy tensors); returns the jobs by weight
    name, whose ``stats`` are filled as the tensors are evaluated. ``keep``: each quantized tensor stays in
    memory once evaluated (for a pass that reads them more than once, as to-matmul-nbits does); else it is
    computed when saved and dropped."""
    producers = {v.name: node for node in model.graph for v in node.outputs}
    values = model.graph.initializers
    jobs: dict[str, Job] = {}
    for spec in specs:
        w = spec.weight
        source = values[w.name]
        # a bf16-stored weight is read through its Cast, which goes with it; the job reads the bf16 values
        cast = next((node for node, _ in source.uses() if stored_weight(node.outputs[0]) is source), None)
        read = source if cast is None else cast.outputs[0]
        names: dict[str, str] = {}
        if spec.form in ORT_FORMS:
            fallback, names = ORT_FORMS[spec.form]
            if not _ort_form_fits(spec, read):
                spec, names = replace(spec, form=fallback), {}
        job = Job(spec, source)
        shapes = _shapes(spec, w.shape)
        job.pending = set(shapes)
        tensors = {}
        for key, shape in shapes.items():
            name = f"{w.name}_{names.get(key, key)}"
            dtype = _dtype(spec, key)
            # MatMulNBits tensors and ORT's forms are final (to-matmul-nbits reads their shapes only): computed
            # when saved
            lazy = ir.LazyTensor(partial(_computed, job, key, dtype), dtype=dtype, shape=ir.Shape(shape), name=name,
                                 cache=keep and spec.form not in ("nbits", *ORT_FORMS))
            tensors[key] = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=lazy)
            model.graph.register_initializer(tensors[key])
        consumer = producers[w.output]
        if spec.form in ("nbits", "nbits8"):
            _to_matmul_nbits(model, consumer, read, tensors, spec)
        elif spec.form == "rows":
            _to_gathered_rows(model, read, tensors)
        elif spec.form == "stacked":
            _to_cast_mul(model, read, tensors, spec.weight.name)
        else:
            _to_dequantize(model, consumer, read, tensors, spec)
        if cast is not None:
            model.graph.remove(cast, safe=True)
        del values[w.name]
        jobs[w.name] = job
    if any(job.spec.form in ("nbits", "nbits8") for job in jobs.values()):
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    if any(s.form == "dq-blocked" for s in specs):
        raise_opset(model)
    log(f"streaming compression of {len(specs)} weights, one at a time as they are written")
    return jobs


def _to_matmul_nbits(model: ir.Model, matmul: ir.Node, source: ir.Value, tensors: dict, spec: Spec) -> None:
    """NNCF's MatMulNBits (accuracy_level 0) with its zero points packed two per byte as ORT reads them (NNCF
    writes one per byte, which to-matmul-nbits packs); to-matmul-nbits sets the level."""
    k, n = spec.weight.shape
    x = next(v for v in matmul.inputs if v is not source)
    inputs = [x, tensors["quantized"], tensors["scale"]] + ([tensors["zero_point"]] if "zero_point" in tensors else [])
    block = spec.group if spec.form == "nbits" else tensors["quantized"].shape[2]  # nbits8: [N, blocks, block]
    node = ir.node("MatMulNBits", inputs, attributes={"K": k, "N": n, "bits": spec.bits, "block_size": block,
                                                    "accuracy_level": 0},
                   domain=MS_DOMAIN, name=f"{matmul.name}_compressed_matmul", num_outputs=1)
    output = matmul.outputs[0]
    model.graph.insert_before(matmul, node)
    output.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
    node.outputs[0].name = output.name
    if output.dtype is not None:  # exported intermediate values carry no type until shapes are inferred
        node.outputs[0].dtype, node.outputs[0].shape = output.dtype, output.shape
    model.graph.remove(matmul, safe=True)


def _to_gathered_rows(model: ir.Model, source: ir.Value, tensors: dict) -> None:
    """Each Gather of the table as to-matmul-nbits rewrites it: the quantized rows, Cast, minus their zero points,
    times their scales."""
    names = Names(model.graph)
    for gather, _ in list(source.uses()):
        ToMatMulNBits._dequantized_rows(model.graph, names, gather, tensors["quantized"], tensors["scale"],
                                        tensors.get("zero_point"))


def _to_cast_mul(model: ir.Model, source: ir.Value, tensors: dict, name: str) -> None:
    """(Cast(q) - zero point) * scale in place of a 3-D weight (``name``: the initializer's)."""
    nodes = [ir.node("Cast", [tensors["quantized"]], attributes={"to": ir.DataType.FLOAT},
                     name=f"{name}_Cast", num_outputs=1)]
    if "zero_point" in tensors:
        nodes.append(ir.node("Sub", [nodes[-1].outputs[0], tensors["zero_point"]], name=f"{name}_Sub",
                             num_outputs=1))
    nodes.append(ir.node("Mul", [nodes[-1].outputs[0], tensors["scale"]], name=f"{name}_Mul", num_outputs=1))
    for node in nodes:
        node.outputs[0].name = f"{node.name}/out"
        node.outputs[0].dtype = ir.DataType.FLOAT
    nodes[-1].outputs[0].name, nodes[-1].outputs[0].shape = f"{name}_dequantized", \
        ir.Shape(source.shape)  # type: ignore[arg-type]  # a weight's initializer has its shape
    users = [node for node, _ in source.uses()]
    model.graph.insert_before(next(node for node in model.graph if node in users), nodes)
    source.replace_all_uses_with(nodes[-1].outputs[0])


def _to_dequantize(model: ir.Model, consumer: ir.Node, source: ir.Value, tensors: dict, spec: Spec) -> None:
    axis = 0 if spec.form in ("dq-blocked", "dq-rows") else 1
    attributes = {"axis": axis} | ({"block_size": spec.group} if spec.form == "dq-blocked" else {})
    inputs = [tensors["quantized"], tensors["scale"]] + ([tensors["zero_point"]] if "zero_point" in tensors else [])
    name = spec.weight.name  # the initializer's, also when ``source`` is the Cast of a bf16-stored one
    dq = ir.node("DequantizeLinear", inputs, attributes=attributes, name=f"{name}_DequantizeLinear", num_outputs=1)
    dq.outputs[0].name = f"{name}_dequantized"
    dq.outputs[0].dtype, dq.outputs[0].shape = ir.DataType.FLOAT, ir.Shape(spec.weight.shape)
    users = [node for node, _ in source.uses()]
    first = next(node for node in model.graph if node in users)
    model.graph.insert_before(first, dq)
    source.replace_all_uses_with(dq.outputs[0])


def raise_opset(model: ir.Model) -> None:
    # onnxscript, which the MLA fusion imports, loads only where an opset is raised
    from passes.fusions.mla_attention import opset_blocker

    blocker = opset_blocker(model, DQ_OPSET)
    if blocker:
        raise InputError(f"grouped INT4 for OpenVINO needs DequantizeLinear at opset {DQ_OPSET}: {blocker}")
    model.opset_imports[""] = max(model.opset_imports.get("", DQ_OPSET), DQ_OPSET)


def blocked_dq_to_nbits(model: ir.Model) -> int:
    """NNCF's grouped INT4 written as ``DequantizeLinear(block_size) -> MatMul`` -> MatMulNBits, the form this
    module writes for the onnxruntime target (same values, repacked); returns how many weights were rewritten.

    NNCF 3.4's ONNX backend writes MatMulNBits only when the model's *first* opset import is below 21
    (``opset_version = model.opset_import[0].version`` in weight_compression/onnx_backend.py) and the blocked
    DequantizeLinear otherwise. The onnxruntime passes stage raises the opset to 23 (fuse-mla-attention's
    Attention), so an INT4 build with passes got DequantizeLinear -> MatMul, which to-matmul-nbits (8-bit only) and
    the compile stage's basic-level optimisation keep. ORT 1.32 fuses it into MatMulNBits only in a session at its
    extended level or above, with the accuracy level of its own session option, and runs it as a whole-weight
    dequantization and an fp32 MatMul at every call otherwise (measured on deepseek-v3-tiny: 120 DequantizeLinear
    kernels at basic, 0 at extended); here the artifact states the kernel and its accuracy level itself.
    """
    from nncf.onnx.graph.onnx_helper import pack_int4_to_uint8

    count = 0
    for dq in list(model.graph):
        block = dq.attributes.get("block_size")
        if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or block is None or not block.as_int():
            continue
        q = present(dq.inputs[0])
        zp = dq.inputs[2] if len(dq.inputs) > 2 else None
        users = list(dq.outputs[0].uses())
        if q.const_value is None or q.const_value.dtype not in (ir.DataType.INT4, ir.DataType.UINT4) \
                or q.shape is None or len(q.shape) != 2 or dq.attributes.get_int("axis", 1) != 0 or not users \
                or any(node.op_type != "MatMul" or index != 1 for node, index in users):
            continue
        k, n = q.shape.numpy()
        name = name_of(q)
        sym = zp is None
        spec = Spec(Weight(name, "", "", "matmul", (k, n)), 4, block.as_int(), sym, "nbits")
        arrays = {"quantized": pack_int4_to_uint8(q.const_value.numpy().astype(np.int8 if sym else np.uint8),
                                                  spec.group, signed=sym),
                  "scale": np.ascontiguousarray(initializer_data(dq.inputs[1]).T)}
        if not sym:
            arrays["zero_point"] = np.ascontiguousarray(initializer_data(zp).astype(np.uint8).T)
        tensors = {}
        for key, array in arrays.items():
            tensors[key] = ir.Value(name=f"{name}_nbits_{key}", shape=ir.Shape(array.shape),
                                    type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                                    const_value=ir.tensor(array, name=f"{name}_nbits_{key}"))
            model.graph.register_initializer(tensors[key])
        for matmul, _ in users:
            _to_matmul_nbits(model, matmul, dq.outputs[0], tensors, spec)
        inputs = [v for v in dq.inputs if v is not None]
        model.graph.remove(dq, safe=True)
        for value in inputs:
            if not value.uses():
                del model.graph.initializers[name_of(value)]
        count += 1
    if count:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return count
