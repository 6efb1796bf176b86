"""The ``shipped`` scheme: each weight the checkpoint stores quantized keeps its stored codes and scales.

DeepSeek-V3/R1/V3.2 ship their projections in FP8 e4m3 with a scale per 128 x 128 block (float32, or powers of two
from V3.1 on), DeepSeek-V4 its attention in the same FP8 and its routed experts in FP4 e2m1 with a power-of-two
scale per 32 values of a row (toolchain/checkpoint/reader.py). The export dequantizes them; this scheme writes
each such MatMul weight back as ``DequantizeLinear(codes, scales)`` read from the checkpoint tensor by tensor
(the export records which tensor each weight is, transposed and with which rows: the initializer's
``dstc.source``), so it computes the checkpoint's own q x s and adds no error of its own. Every other weight (the
embeddings, lm_head, routers, V4's bf16 compressor and indexer projections, MLA's absorbed kv_b_proj, which the
export derives from a quantized weight by reshaping it) stays as the export stored it.

The graph weight is W[rows].T, [K, N] for a checkpoint weight W [out, in] with (bn x bk) blocks: its codes are
the transposed codes, and its scales [ceil(K / bk), N] are each output channel's block scales, so one
``block_size`` (bk) on axis 0 describes both formats (for FP8, a 128 x 128 block's scale repeated on its 128
columns: 1/32 of a byte per weight).

What each runtime makes of it (OpenVINO 2026.4 and ONNX Runtime 1.32 on an AVX-512 CPU, measured):

* OpenVINO: FP4 becomes its compressed-weight pattern, and the CPU plugin runs a FullyConnected on the f4e2m1
  constant with its scales (as it does u4). FP8 stays an f8e4m3 constant (one byte per weight in memory), but the
  CPU plugin has no f8 FullyConnected: Convert and Multiply expand it to float32 at every call.
* ONNX Runtime: DequantizeLinear of float8e4m3fn with block_size runs on the CPU provider (before a float32
  MatMul, unfused); float4e2m1 has no CPU kernel ("Could not find an implementation for DequantizeLinear(23)"),
  so a checkpoint with FP4 weights is refused for it before any stage runs (``ort_problem``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx_ir as ir

from passes.graph import stored_weight, tensor_of
from toolchain.checkpoint.reader import CheckpointReader, Shipped, read_config
from toolchain.compress.engine import Weight
from toolchain.compress.metrics import relative_error
from toolchain.compress.streaming import ComputedOnSave
from toolchain.errors import InputError
from toolchain.interface.graph import SOURCE

# codes -> the ONNX type and the opset whose DequantizeLinear takes it with block_size
ONNX_TYPES = {"f8e4m3": (ir.DataType.FLOAT8E4M3FN, 21), "f4e2m1": (ir.DataType.FLOAT4E2M1, 23)}
PRECISION = "shipped"


@dataclass(frozen=True)
class Source:
    """Where a graph weight's values come from: ``tensor`` [out, in] of the checkpoint, transposed, its rows."""

    tensor: str
    rows: tuple[int, ...] | None
    form: Shipped

    def block_k(self, k: int) -> int:
        """The DequantizeLinear block along the graph weight's K input rows: the stored block, or where K is not
        a whole number of them (OpenVINO's frontend requires that), the largest divisor of both (each stored
        scale repeated on its sub-blocks: the same values)."""
        return math.gcd(k, self.form.block[1])

    @property
    def precision(self) -> str:
        """The weight's precision in compression.json: its codes' format, fp8-e4m3 or fp4-e2m1."""
        return {"f8e4m3": "fp8-e4m3", "f4e2m1": "fp4-e2m1"}[self.form.format]

    @property
    def label(self) -> str:
        """How compression.json counts the weight, e.g. fp8-e4m3-b128x128-f32 (codes, block, scales)."""
        return f"{self.precision}-b{self.form.block[0]}x{self.form.block[1]}-{self.form.scale_format}"


def ort_problem(checkpoint_config: dict) -> str | None:
    """Why ONNX Runtime cannot run a checkpoint's shipped weights, from its config.json alone; None if it can."""
    quant = checkpoint_config.get("quantization_config") or {}
    if quant.get("expert_dtype", checkpoint_config.get("expert_dtype")) == "fp4":
        return ("the shipped scheme keeps FP4 (e2m1) routed experts, and ONNX Runtime's CPU provider has no "
                "DequantizeLinear for float4e2m1; use the openvino target or the int4-grouped scheme")
    return None


def check_source(source, target: str) -> None:
    """An InputError before anything is read: a checkpoint without quantized weights, or one ``target`` cannot
    run in its shipped form."""
    config = read_config(source)
    if not config.get("quantization_config"):
        raise InputError(f"{source}: the shipped scheme keeps a checkpoint's quantized weights, and config.json "
                         f"declares no quantization_config")
    problem = ort_problem(config) if target == "onnxruntime" else None
    if problem:
        raise InputError(problem)


def sources(model: ir.Model, weights: list[Weight], reader: CheckpointReader) -> dict[str, Source]:
    """Graph weight name -> its checkpoint source, for each 2-D MatMul weight that is a stored-quantized
    checkpoint tensor transposed (with a selection of its rows)."""
    out = {}
    for w in weights:
        if w.kind != "matmul" or len(w.shape) != 2:
            continue
        meta = tensor_of(model.graph.initializers[w.name]).metadata_props.get(SOURCE)
        if not meta:
            continue
        info = json.loads(meta)
        if not info["transposed"] or not reader.has(info["tensor"]):
            continue
        form = reader.shipped(info["tensor"])
        if form is None:
            continue
        rows = tuple(info["rows"]) if info["rows"] is not None else None
        if (len(rows) if rows else form.shape[0]) != w.shape[1] or form.shape[1] != w.shape[0]:
            raise InputError(f"{w.name} is {list(w.shape)}, and its checkpoint tensor {info['tensor']} holds "
                             f"{list(form.shape)} values: the export is not of this checkpoint")
        out[w.name] = Source(info["tensor"], rows, form)
    return out


def _codes(reader: CheckpointReader, source: Source) -> np.ndarray:
    """The graph weight's codes [in, out] (the checkpoint tensor's, transposed)."""
    codes = reader.shipped_codes(source.tensor)
    if source.rows is not None:
        codes = codes[list(source.rows)]
    return np.ascontiguousarray(codes.T)


def _scales(reader: CheckpointReader, source: Source) -> np.ndarray:
    """[ceil(in / bk), out]: each output channel's scales along its input (module docstring)."""
    scales = reader.shipped_scales(source.tensor)
    out_rows, k = source.form.shape
    split = source.form.block[1] // source.block_k(k)
    per_row = np.repeat(scales, source.form.block[0], axis=0)[:out_rows]
    per_row = np.repeat(per_row, split, axis=1)[:, :k // source.block_k(k)]
    if source.rows is not None:
        per_row = per_row[list(source.rows)]
    return np.ascontiguousarray(per_row.T, np.float32)


@dataclass
class Job(ComputedOnSave):
    """One weight's codes and scales, read from the checkpoint when the first of them is saved. Given the export's
    weight it replaces (``replaced``), it also measures DequantizeLinear(codes, scales) against it, one weight at
    a time: the streamed path's weight error, where the whole model is never held to compare."""

    reader: CheckpointReader
    source: Source
    replaced: ir.TensorProtocol | None = None
    weight_error: float | None = None

    def _compute(self) -> dict[str, np.ndarray]:
        codes, scales = _codes(self.reader, self.source), _scales(self.reader, self.source)
        if self.replaced is not None:
            block = self.source.block_k(codes.shape[0])
            dequantized = codes.astype(np.float32) * np.repeat(scales, block, axis=0)
            self.weight_error = relative_error(self.replaced.numpy().astype(np.float32), dequantized)
            if isinstance(self.replaced, ir.ExternalTensor):
                self.replaced.release()  # unmaps the export's pages of this weight
        return {"codes": codes, "scales": scales}

    @property
    def precision(self) -> str:
        """As compression.json names the DequantizeLinear's weight on the whole-model path (codes, block)."""
        return f"{self.source.precision}-g{self.source.block_k(self.source.form.shape[1])}"

    def bits_per_weight(self) -> float:
        """Stored bits per weight: the codes' and the float32 scales' (one per block of the input rows)."""
        k = self.source.form.shape[1]
        code_bits = 4 if self.source.form.format == "f4e2m1" else 8
        return code_bits + 32 / self.source.block_k(k)


def rewrite(model: ir.Model, found: dict[str, Source], weights: list[Weight], reader: CheckpointReader,
            log: Callable[[str], None], measure: bool = False) -> tuple[dict, dict[str, Job]]:
    """Each weight in ``found`` replaced, in place, by DequantizeLinear of its checkpoint codes and scales (read
    when the graph is saved, one weight at a time); the opset raised to what the formats need. Returns the
    counts for compression.json and each weight's job (``measure``: the jobs measure the weight error as they
    are saved)."""
    by_name = {w.name: w for w in weights}
    counts: dict[str, int] = {}
    jobs: dict[str, Job] = {}
    opset = model.opset_imports.get("", 1)
    for name, source in found.items():
        w = by_name[name]
        value = model.graph.initializers[name]
        consumer = next((use.node for use in value.uses()), None)
        widened = consumer.outputs[0] if consumer is not None and stored_weight(consumer.outputs[0]) is value \
            else value
        dtype, needed = ONNX_TYPES[source.form.format]
        opset = max(opset, needed)
        k, n = w.shape
        job = jobs[name] = Job(reader=reader, source=source, replaced=value.const_value if measure else None,
                               pending={"codes", "scales"})
        blocks = k // source.block_k(k)
        codes = ir.Value(name=f"{name}/shipped_codes", type=ir.TensorType(dtype), shape=ir.Shape([k, n]),
                         const_value=ir.LazyTensor(partial(_taken, job, "codes", dtype), dtype=dtype,
                                                   shape=ir.Shape([k, n]), name=f"{name}/shipped_codes"))
        scales = ir.Value(name=f"{name}/shipped_scales", type=ir.TensorType(ir.DataType.FLOAT),
                          shape=ir.Shape([blocks, n]),
                          const_value=ir.LazyTensor(partial(_taken, job, "scales", ir.DataType.FLOAT),
                                                    dtype=ir.DataType.FLOAT, shape=ir.Shape([blocks, n]),
                                                    name=f"{name}/shipped_scales"))
        node = ir.node("DequantizeLinear", [codes, scales], {"axis": 0, "block_size": source.block_k(k)},
                       name=f"{name}/DequantizeLinear")
        out = node.outputs[0]
        out.name, out.dtype, out.shape = f"{name}/shipped", ir.DataType.FLOAT, ir.Shape([k, n])
        model.graph.register_initializer(codes)
        model.graph.register_initializer(scales)
        anchor = widened.producer() if widened is not value else None
        if anchor is not None:
            model.graph.insert_before(anchor, node)
            widened.replace_all_uses_with(out)
            model.graph.remove(anchor, safe=True)
        else:
            model.graph.insert_before(next(n for n in model.graph if n.name == w.node), node)
            value.replace_all_uses_with(out)
        model.graph.initializers.pop(name)
        counts[source.label] = counts.get(source.label, 0) + 1
    model.opset_imports[""] = opset
    log(f"shipped: {sum(counts.values())} weights keep their checkpoint codes ({counts})")
    return {"shipped": counts, "opset": opset}, jobs


def _taken(job: Job, key: str, dtype: ir.DataType) -> ir.TensorProtocol:
    return ir.tensor(job.take(key), dtype=dtype)
