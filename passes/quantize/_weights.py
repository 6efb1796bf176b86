"""Weight quantization helpers shared by the quantize passes and by whoever measures their error.

Conventions. A MatMul weight is the constant right operand ``W`` of shape [K, N] (in, out): output channel n is
column ``W[:, n]``. An embedding is the constant data of a ``Gather`` on axis 0, [vocab, hidden]: its "channels"
are rows. Quantization here is always 8-bit, with one scale (and zero point when asymmetric) per group of output
channels: groups of 1 are per-channel, groups of a head's width are per-head, one group of all is per-tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from passes.graph import HeldInitializer, constant, constant_array

MS_DOMAIN = "com.microsoft"


@dataclass
class Quantized:
    """``q`` [K, N] (uint8 when asymmetric, int8 when symmetric), per-channel ``scale`` [N] and ``zero_point``
    [N] (uint8, None when symmetric). Channels of one group share identical scale and zero point values."""

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        zp = 0 if self.zero_point is None else self.zero_point.astype(np.float32)
        return ((self.q.astype(np.float32) - zp) * self.scale).astype(np.float32)


def group_bounds(n: int, group: int | Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each group of channels: ``group`` is a width dividing ``n``, or explicit widths."""
    widths = [group] * (n // group) if isinstance(group, (int, np.integer)) else list(group)
    if sum(widths) != n or any(w <= 0 for w in widths):
        raise ValueError(f"groups {group} do not tile {n} channels")
    starts = np.cumsum([0, *widths])
    return [(int(a), int(b)) for a, b in itertools.pairwise(starts)]


def quantize_int8(w: np.ndarray, group: int | Sequence[int] = 1, *, sym: bool = False) -> Quantized:
    """8-bit quantization of the columns of ``w`` [K, N], one scale per group of columns (see group_bounds).

    Asymmetric: uint8 with the range [min, max] widened to include 0 (so zero stays exact), scale = range / 255.
    Symmetric: int8 in [-127, 127], scale = max|w| / 127, no zero point.
    """
    w = np.asarray(w, dtype=np.float32)
    n = w.shape[1]
    scale = np.empty(n, np.float32)
    zero_point = None if sym else np.empty(n, np.uint8)
    for a, b in group_bounds(n, group):
        block = w[:, a:b]
        if zero_point is None:  # symmetric
            s = float(np.abs(block).max()) / 127.0
            scale[a:b] = s if s > 0 else 1.0
        else:
            lo, hi = min(float(block.min()), 0.0), max(float(block.max()), 0.0)
            s = (hi - lo) / 255.0 if hi > lo else 1.0
            scale[a:b] = s
            zero_point[a:b] = np.clip(np.round(-lo / s), 0, 255)
    if zero_point is None:
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    else:
        q = np.clip(np.round(w / scale) + zero_point.astype(np.float32), 0, 255).astype(np.uint8)
    return Quantized(q, scale, zero_point)


def relative_error(reference: np.ndarray, approx: np.ndarray) -> float:
    """||reference - approx|| / ||reference|| (Frobenius); 0 for an all-zero reference matched exactly."""
    norm = float(np.linalg.norm(reference))
    diff = float(np.linalg.norm(np.asarray(reference, np.float64) - np.asarray(approx, np.float64)))
    return diff / norm if norm else (0.0 if diff == 0 else float("inf"))


# -- weights in a graph -----------------------------------------------------------------------------------------


@dataclass
class WeightUse(HeldInitializer):
    """A constant weight and the node that reads it: ``kind`` "matmul" ([K, N] right operand) or "gather"
    (axis-0 embedding table)."""

    node: ir.Node
    value: ir.Value
    kind: str

    @property
    def columns(self) -> int:
        return self.tensor.shape.numpy()[1]


def float_weights(graph: ir.Graph) -> Iterator[WeightUse]:
    """Float32 2-D initializers read as a MatMul's right operand or as a Gather's data on axis 0."""
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "MatMul":
            value, kind = node.inputs[1], "matmul"
        elif node.op_type == "Gather" and _attr_int(node, "axis", 0) == 0:
            value, kind = node.inputs[0], "gather"
        else:
            continue
        if value is None or value.const_value is None or value.is_graph_input():
            continue
        if value.const_value.dtype != ir.DataType.FLOAT or len(value.const_value.shape) != 2:
            continue
        yield WeightUse(node, value, kind)


def is_transposed_gemm(node: ir.Node, index: int) -> bool:
    """Whether ``node`` reads input ``index`` as ``w`` of a plain Gemm(a, w, transB=1) = a @ w.T: a tied lm_head
    reading the [vocab, hidden] embedding table, whose rows are its output channels."""
    if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or index != 1:
        return False
    scaled = any(node.attributes.get(name) is not None and node.attributes[name].as_float() != 1.0
                 for name in ("alpha", "beta"))
    no_bias = len(node.inputs) < 3 or node.inputs[2] is None
    return _attr_int(node, "transB", 0) == 1 and not _attr_int(node, "transA", 0) and not scaled and no_bias


def _attr_int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.as_int())


# -- reading compressed weights back ----------------------------------------------------------------------------


def unpack_nbits(packed: np.ndarray, bits: int, n: int, k: int, block_size: int) -> np.ndarray:
    """MatMulNBits' B ([N, blocks, block_size * bits / 8] uint8) -> quantized values [N, K] (uint8)."""
    packed = packed.reshape(n, -1).astype(np.uint8)
    if bits == 8:
        values = packed
    elif bits == 4:
        values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)
    else:
        raise ValueError(f"MatMulNBits with bits={bits} is not supported")
    return values[:, :k]


def nbits_zero_points(zp: np.ndarray | None, bits: int, n: int, blocks: int) -> np.ndarray:
    """MatMulNBits' zero points as [N, blocks] floats (ORT's default 2^(bits-1) when absent)."""
    if zp is None:
        return np.full((n, blocks), 2 ** (bits - 1), np.float32)
    zp = zp.reshape(n, -1)
    if np.issubdtype(zp.dtype, np.floating):
        return zp[:, :blocks].astype(np.float32)
    if bits == 4 and zp.shape[1] != blocks:  # packed two per byte, low nibble first
        zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)
    return zp[:, :blocks].astype(np.float32)


def matmul_nbits_weight(node: ir.Node) -> np.ndarray:
    """The dequantized [K, N] weight of a MatMulNBits node with constant inputs."""
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    return nbits_weight(node, constant(node.inputs[1]), constant(node.inputs[2]),
                        None if zp_value is None else constant_array(zp_value))


def nbits_weight(node: ir.Node, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None) -> np.ndarray:
    """The dequantized [K, N] weight of MatMulNBits ``node`` (its attributes) given its B, scales and zero points."""
    k, n = _attr_int(node, "K", 0), _attr_int(node, "N", 0)
    bits, block_size = _attr_int(node, "bits", 4), _attr_int(node, "block_size", 0)
    blocks = -(-k // block_size)
    q = unpack_nbits(b, bits, n, blocks * block_size, block_size)
    scale = scales.reshape(n, blocks).astype(np.float32)
    zp = nbits_zero_points(zero_points, bits, n, blocks)
    deq = (q.reshape(n, blocks, block_size).astype(np.float32) - zp[..., None]) * scale[..., None]
    return deq.reshape(n, -1)[:, :k].T.copy()


def dequantize_linear(node: ir.Node) -> np.ndarray:
    """The output of a DequantizeLinear node with constant inputs (per-tensor, per-axis or blocked)."""
    x = constant(node.inputs[0]).astype(np.float32)
    scale = constant(node.inputs[1]).astype(np.float32)
    zp_value = node.inputs[2] if len(node.inputs) > 2 else None
    zp = np.zeros_like(scale) if zp_value is None else constant(zp_value).astype(np.float32)
    axis = _attr_int(node, "axis", 1) % max(x.ndim, 1)
    block = _attr_int(node, "block_size", 0)
    if scale.size == 1:
        return (x - zp.reshape(())) * scale.reshape(())
    if block:
        scale, zp = (np.repeat(a, block, axis=axis).take(range(x.shape[axis]), axis=axis) for a in (scale, zp))
        return (x - zp) * scale
    if 1 < scale.ndim == x.ndim - 1:  # NNCF's INT8 of a 3-D [E, K, N] weight: [E, N], the reduction axis K squeezed
        return (x - np.expand_dims(zp, -2)) * np.expand_dims(scale, -2)
    shape = [1] * x.ndim
    shape[axis] = -1
    return (x - zp.reshape(shape)) * scale.reshape(shape)
