"""NNCF's integer quantization of one weight (or one chunk of one), with arrays the caller owns.

NNCF's OpenVINO-optimized weight functions (used above 10,000 elements when OpenVINO is installed) infer with
``share_outputs=True`` and release the compiled model's memory after each call: the numpy arrays they return are
views of buffers that a later call reuses. Kept across calls (a weight's chunks, a stack's experts) they are
overwritten by the next ones — measured here: after two more calls, a [1536, 8960] weight's scales and values
no longer match what the first call returned. So every array kept is copied out before the next call, here and
nowhere else.

``integer_quantize_dequantize_weight`` gives the compressed weight and its dequantized form from one call (one
OpenVINO inference), the same tensors ``compress_weight`` gives: 3-5x faster than compressing and then
dequantizing with ``do_integer_dequantization`` in NNCF's numpy ops.

Those functions infer on one request per compiled model, which two threads must not share: each call holds
``NNCF_LOCK`` until its outputs are copied (streamed compression computes weights on its writer threads).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

NNCF_LOCK = threading.Lock()


@dataclass
class Quantized:
    """One quantization: integer values, scale, zero point (None when symmetric) in NNCF's shapes, the squared
    error ||W - Ŵ||² and squared norm ||W||² (numpy's pairwise float32 sums: within 1e-7 of float64 here, where a
    BLAS dot was 5e-5 off), and the dequantized weight when asked for."""

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    squared_error: float
    squared_norm: float
    restored: np.ndarray | None = None


def config(mode: str, group: int | None):
    """NNCF's WeightCompressionConfig for ``mode`` (a CompressWeightsMode name: "INT4_ASYM", "INT8_SYM", ...)
    with ``group`` input channels per scale (None: per channel)."""
    import nncf
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig

    return WeightCompressionConfig(mode=getattr(nncf.CompressWeightsMode, mode), group_size=group or -1)


def quantize(weight: np.ndarray, axis: int, mode: str, group: int | None, keep_restored: bool = False,
             scale: np.ndarray | None = None, zero_point: np.ndarray | None = None) -> Quantized:
    """``weight`` (float32, C order) quantized along ``axis`` in ``mode`` with ``group`` (see ``config``);
    ``scale`` (and ``zero_point``) given: those of a data-aware algorithm, in NNCF's shapes for this weight."""
    from nncf.quantization.algorithms.weight_compression.weight_lowering import integer_quantize_dequantize_weight
    from nncf.tensor import Tensor

    with NNCF_LOCK:  # NNCF's outputs are copied or used up before the next call can reuse them
        restored, compressed = integer_quantize_dequantize_weight(
            Tensor(weight), config(mode, group), (axis,), None if scale is None else Tensor(scale),
            None if zero_point is None else Tensor(zero_point), return_compressed_weight=True)
        zp = compressed.zero_point
        out = Quantized(q=np.array(compressed.tensor.data, copy=True),
                        scale=np.array(compressed.scale.data, copy=True),
                        zero_point=None if zp is None else np.array(zp.data, copy=True),
                        squared_error=0.0, squared_norm=0.0)
        diff = restored.data.reshape(weight.shape)
        if keep_restored:
            out.restored = np.array(diff, copy=True)
            diff = out.restored - weight
        else:  # NNCF's own buffer, not kept: the difference goes into it
            np.subtract(diff, weight, out=diff)
        out.squared_error = float(np.square(diff, out=diff).sum())
    out.squared_norm = float(np.square(weight).sum())
    return out


def estimate_scales(weight: np.ndarray, statistics, mode: str,
                    group: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """NNCF's scale estimation (``ScaleEstimation.calculate_quantization_params`` with NNCF's default parameters,
    what ``compress_weights(scale_estimation=True)`` runs per weight) of a [K, N] MatMul weight from its input's
    ``statistics`` (a WCTensorStatistic): the scale and zero point (None when symmetric) to quantize it with."""
    from nncf.quantization.advanced_parameters import AdvancedScaleEstimationParameters
    from nncf.quantization.algorithms.weight_compression.scale_estimation import ScaleEstimation
    from nncf.tensor import Tensor

    p = AdvancedScaleEstimationParameters()
    with NNCF_LOCK:
        scale, zp = ScaleEstimation.calculate_quantization_params(
            statistics, Tensor(weight), (0,), config(mode, group), -1, p.subset_size, p.initial_steps,
            p.scale_steps, p.weight_penalty)
        return np.array(scale.data, np.float32), None if zp is None else np.array(zp.data, copy=True)
