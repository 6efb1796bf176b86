"""The error of a compressed model, measured where it happens.

* per weight: relative weight error ||W - Ŵ|| / ||W||, and output error ||X W - X Ŵ|| / ||X W|| on the activations
  X that reach that weight when the fp32 graph runs the calibration text (a routed expert sees only the tokens
  routed to it; a table, the calibration tokens' rows);
* per attention head: the same on the head's block of output channels (q/k/v, MLA q_b/kv_b) or, for o_proj, its
  block of input rows and that head's contribution X_h W_h to the output; for the 3-D per-head weights of MLA's
  latent cache (W_uk, W_uv: [heads, K, N]), each head's matrix on that head's activations;
* per MoE layer: routing agreement, the share of tokens whose set of selected experts is unchanged (the TopK
  indices of each router, exposed as extra outputs of a copy of each graph);
* for the model: top-1 agreement and mean KL(fp32 || compressed) of the next-token distributions;
* storage: bits per weight of each weight (quantized values, scales and zero points).

Ŵ is read back from the compressed graph itself: dequantized from MatMulNBits / DequantizeLinear initializers on
ONNX, and for OpenVINO by compiling each weight's constant subgraph (its decompression ops) and running it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from passes.graph import constant, name_of, present
from passes.quantize._weights import dequantize_linear, matmul_nbits_weight
from toolchain.compress.engine import Weight
from toolchain.progress import due
from toolchain.runtime.engines import GraphRunner, openvino_compile

MAX_ROWS = 2048  # activation rows kept per weight


@dataclass
class Restored:
    """A weight as the compressed graph computes it: dequantized value, storage bytes and a precision label."""

    array: np.ndarray
    nbytes: int
    precision: str


# -- running graphs ---------------------------------------------------------------------------------------------


def router_indices(model: ir.Model) -> dict[int, str]:
    """MoE layer -> name of its TopK indices value: what the layer's expert 0 compares with (Equal)."""
    out = {}
    for node in model.graph:
        parts = (node.name or "").split("/")
        if node.op_type == "Equal" and "experts" in parts and parts[parts.index("experts") + 1] == "0" \
                and parts[0].startswith("layers."):
            out[int(parts[0].split(".")[1])] = name_of(node.inputs[0])
    return out


def capture(model: ir.Model, weights: list[Weight], feed_list: list[dict], routers: dict[int, str],
            log: Callable[[str], None] = lambda _: None):
    """fp32 run: activations reaching each MatMul weight, logits and router indices per sequence."""
    producers = {v.name: node for node in model.graph for v in node.outputs}
    activation_of = {w.name: name_of(producers[w.output].inputs[0]) for w in weights if w.kind == "matmul"}
    # a 3-D [heads, K, N] weight (MLA's absorbed kv_b_proj) reads [..., heads, S, K]: its rows are kept per head,
    # [heads, rows, K], so that each head's rows meet that head's matrix
    stacked = {activation_of[w.name] for w in weights if w.kind == "matmul" and len(w.shape) == 3}
    extra = sorted(set(activation_of.values())) + list(routers.values())
    run = GraphRunner(model, "onnxruntime", extra_outputs=extra)
    acts: dict[str, list[np.ndarray]] = {name: [] for name in extra}
    logits: list[np.ndarray] = []
    routing: dict[int, list[np.ndarray]] = {layer: [] for layer in routers}
    for feeds in feed_list:
        out = run(feeds)
        for name in acts:
            if name in out and len(acts[name]) < MAX_ROWS:
                value = out[name]
                if name in stacked:
                    heads, width = value.shape[-3], value.shape[-1]
                    value = np.moveaxis(value.reshape(-1, *value.shape[-3:]), 1, 0).reshape(heads, -1, width)
                    acts[name].append(value)
                else:
                    acts[name].append(value.reshape(-1, value.shape[-1]))
        logits.append(out["logits"][0])
        for layer, name in routers.items():
            routing[layer].append(out[name])
        if due(len(logits), len(feed_list)):
            log(f"  {len(logits)}/{len(feed_list)} calibration sequences")
    rows = {w: None if not acts[a] else np.concatenate(acts[a], axis=1)[:, :MAX_ROWS] if a in stacked
            else np.concatenate(acts[a])[:MAX_ROWS] for w, a in activation_of.items()}
    return rows, logits, routing


# -- reading weights back ---------------------------------------------------------------------------------------


def _bytes(values: Iterable[ir.Value | None]) -> int:
    return sum(v.const_value.nbytes for v in values if v is not None and v.const_value is not None)


# DequantizeLinear's float codes (the shipped scheme's: toolchain/compress/shipped.py) -> their label
_FLOAT_CODES = {np.dtype(ml_dtypes.float8_e4m3fn): "fp8-e4m3", np.dtype(ml_dtypes.float4_e2m1fn): "fp4-e2m1"}


def restored_onnx(model: ir.Model, weights: list[Weight]) -> dict[str, Restored]:
    producers = {v.name: node for node in model.graph for v in node.outputs}
    out = {}
    for w in weights:
        node = producers[w.output]
        if node.op_type == "MatMulNBits":
            bits, block = node.attributes["bits"].as_int(), node.attributes["block_size"].as_int()
            sym = len(node.inputs) < 4 or node.inputs[3] is None
            out[w.name] = Restored(matmul_nbits_weight(node), _bytes(node.inputs[1:4]),
                                   f"int{bits}-{'sym' if sym else 'asym'}-g{block}")
            continue
        source = present(node.inputs[1] if node.op_type == "MatMul" else node.inputs[0])
        dq = source.producer()
        if dq is not None and dq.op_type == "DequantizeLinear":
            q = constant(dq.inputs[0])
            sym = len(dq.inputs) < 3 or dq.inputs[2] is None
            block_size = dq.attributes.get("block_size")
            blocks = f"g{block_size.as_int()}" if block_size is not None and block_size.as_int() else "per-axis"
            label = f"{_FLOAT_CODES[q.dtype]}-{blocks}" if q.dtype in _FLOAT_CODES else \
                f"int{8 if q.dtype in (np.int8, np.uint8) else 4}-{'sym' if sym else 'asym'}-{blocks}"
            out[w.name] = Restored(dequantize_linear(dq), _bytes(dq.inputs), label)
        else:
            array = constant(source)
            out[w.name] = Restored(array, array.nbytes, "fp32")
    return out


def restored_openvino(model, weights: list[Weight]) -> dict[str, Restored]:
    """Each weight of an ov.Model: its constant subgraph (all of them as the outputs of one parameterless model,
    compiled once) run on CPU, its Constants' bytes (shape constants excluded), its precision from the smallest
    element type."""
    import openvino as ov

    by_output = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() in ("MatMul", "Gather"):
            for name in op.output(0).get_names():
                by_output[name] = op
    found = [(w, by_output[w.output]) for w in weights if w.output in by_output]
    ports = [op.input_value(1 if op.get_type_name() == "MatMul" else 0) for _, op in found]
    if not ports:
        return {}
    compiled = openvino_compile(ov.Model(ports, [], "weights"), "exact")
    values = list(compiled.create_infer_request().infer({}).values())
    out = {}
    for (w, op), port, value in zip(found, ports, values):
        consts = [c for c in ov.Model([port], [], "weight").get_ops() if c.get_type_name() == "Constant"
                  and c.get_element_type().get_type_name() not in ("i64", "i32")]
        array = np.array(value)
        if op.get_type_name() == "MatMul" and op.get_attributes().get("transpose_b"):
            array = array.T
        types = {c.get_element_type().get_type_name() for c in consts}
        low = next((t for t in ("f4e2m1", "u4", "i4", "f8e4m3", "u8", "i8", "f16") if t in types), "f32")
        label = {"u4": "int4-asym", "i4": "int4-sym", "u8": "int8-asym", "i8": "int8-sym", "f8e4m3": "fp8-e4m3",
                 "f4e2m1": "fp4-e2m1"}.get(low, "fp32")
        big = max(consts, key=lambda c: c.get_byte_size())
        if label.startswith("int4") and len(big.get_output_shape(0)) == 3:
            label += f"-g{big.get_output_shape(0)[2]}"
        out[w.name] = Restored(array.reshape(w.shape), sum(c.get_byte_size() for c in consts), label)
    return out


# -- errors -----------------------------------------------------------------------------------------------------


# No numpy BLAS here: numpy's bundled OpenBLAS has hung a test run for 50 minutes in its thread dispatch
# (exec_blas) under a float64 ``x @ W``, and it also threads large dot products (norms). Products run in float32 on
# torch (MKL on its own threads); sums of squares are numpy element-wise reductions in float64.


def relative_error(reference: np.ndarray, approx: np.ndarray) -> float:
    """||reference - approx|| / ||reference|| (Frobenius); 0 for an all-zero reference matched exactly."""
    reference = np.asarray(reference, np.float64)
    return _ratio(_norm(reference - np.asarray(approx, np.float64)), _norm(reference))


def rescaled_error(reference: np.ndarray, approx: np.ndarray) -> float | None:
    """relative_error after the best rescale of each row, or of each column (the smaller): what is left of the
    error when a per-channel factor is not counted. AWQ folds such factors into pairs of weights (an up projection's
    columns divided by what the down projection's rows are multiplied by), an equivalent transform whose plain
    relative error says nothing of what was lost; a weight of zeros still measures 1.0. None for a 3-D weight."""
    if np.ndim(reference) != 2:
        return None
    w, q = np.asarray(reference, np.float64), np.asarray(approx, np.float64)
    errors = []
    for axis in (0, 1):
        energy = np.square(q).sum(axis, keepdims=True)
        scale = np.divide((w * q).sum(axis, keepdims=True), energy, out=np.zeros_like(energy), where=energy > 0)
        errors.append(_ratio(_norm(w - scale * q), _norm(w)))
    return min(errors)


def output_error(x: np.ndarray | None, w: np.ndarray, w_hat: np.ndarray) -> float | None:
    """||X W - X Ŵ|| / ||X W||, with the numerator computed as ||X (W - Ŵ)||: the difference of two float32 products
    would cancel to the products' rounding, while W - Ŵ is exact or nearly so in float32."""
    if x is None or not len(x):
        return None
    import torch

    x32 = torch.from_numpy(np.array(x, np.float32))  # copies: torch takes no read-only arrays (a graph's weights)
    w32 = np.array(w, np.float32)
    reference = (x32 @ torch.from_numpy(w32)).numpy()
    error = (x32 @ torch.from_numpy(w32 - np.asarray(w_hat, np.float32))).numpy()
    return _ratio(_norm(error), _norm(reference))


def _norm(a: np.ndarray) -> float:
    return float(np.sqrt(np.square(a, dtype=np.float64).sum()))


def _ratio(diff: float, norm: float) -> float:
    return diff / norm if norm else (0.0 if diff == 0 else float("inf"))


def head_errors(x: np.ndarray | None, w: np.ndarray, w_hat: np.ndarray, side: str, width: int) -> list[dict]:
    """Per head: blocks of ``width`` output columns (side "out") or input rows (side "in", o_proj), or the index of
    axis 0 of a [heads, K, N] weight (side "stacked", x [heads, rows, K])."""
    if side == "stacked":
        return [{"head": h, "weight_error": relative_error(w[h], w_hat[h]),
                 "output_error": output_error(None if x is None else x[h], w[h], w_hat[h])} for h in range(len(w))]
    heads = []
    axis_len = w.shape[1] if side == "out" else w.shape[0]
    for h, start in enumerate(range(0, axis_len, width)):
        sl = slice(start, start + width)
        if side == "out":
            row = {"head": h, "weight_error": relative_error(w[:, sl], w_hat[:, sl]),
                   "output_error": output_error(x, w[:, sl], w_hat[:, sl])}
        else:
            row = {"head": h, "weight_error": relative_error(w[sl], w_hat[sl]),
                   "output_error": output_error(None if x is None else x[:, sl], w[sl], w_hat[sl])}
        heads.append(row)
    return heads


def routing_agreement(reference: list[np.ndarray], compressed: list[np.ndarray]) -> tuple[float, int]:
    """Share of tokens whose selected expert set is the same, and the number of tokens."""
    same = total = 0
    for a, b in zip(reference, compressed):
        a, b = np.sort(a.reshape(-1, a.shape[-1]), -1), np.sort(b.reshape(-1, b.shape[-1]), -1)
        same += int((a == b).all(-1).sum())
        total += len(a)
    return (same / total if total else 1.0), total


def distribution_agreement(reference: list[np.ndarray], compressed: list[np.ndarray]) -> dict:
    """Top-1 agreement and mean KL(reference || compressed) of next-token distributions, over all positions."""
    p_logits = np.concatenate(reference).astype(np.float64)
    q_logits = np.concatenate(compressed).astype(np.float64)
    log_p = p_logits - np.logaddexp.reduce(p_logits, -1, keepdims=True)
    log_q = q_logits - np.logaddexp.reduce(q_logits, -1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    return {"tokens": len(p_logits), "top1_agreement": float((p_logits.argmax(-1) == q_logits.argmax(-1)).mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}
