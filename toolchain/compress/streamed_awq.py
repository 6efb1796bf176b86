"""AWQ in bounded memory: NNCF's data-aware AWQ step for each gated MLP's up_proj -> Multiply -> down_proj, the
pattern NNCF's own AWQ matches there (``MatMul_Mul_MatMul``: the scale of down_proj's input channels merged into
up_proj's output channels), on statistics computed layer by layer (toolchain/compress/layer_statistics.py).

Per pair, the two [K, N] weights are read whole once; ``AWQ._data_aware_step`` (NNCF's grid search with its
default parameters, what ``compress_weights(awq=True)`` runs per matched pair) gives the scale s; down_proj is then
quantized as W * s per input channel and up_proj as W / s per output channel (streaming.Spec.row_scale /
column_scale, applied as each chunk is read), and down_proj's statistics become those of its input / s, as NNCF's
``update_statistics`` makes them for a scale estimation that follows. A private NNCF method is called because no
public one takes a single pair: the pairs NNCF's graph matching finds are found here from the exporter's names.

Routed experts are paired as every gated MLP is (the dispatch lowering's MatMul -> Mul -> MatMul), where the
calibration tokens reach them (toolchain/compress/layer_statistics.py). AWQ's other patterns (an activation before
a MatMul, which inserts a Multiply node into the graph) are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from toolchain.compress import lowering

UP, DOWN = "/up_proj/weight", "/down_proj/weight"


def pair_scale(down: np.ndarray, down_stats, up: np.ndarray, up_stats, sym: bool, group: int) -> np.ndarray:
    """AWQ's scale s of down_proj's input channels: NNCF's data-aware step (its default parameters, what
    ``compress_weights(awq=True)`` runs per matched pair) on the [K, N] down_proj and up_proj weights (float32) and
    their inputs' statistics."""
    from nncf.quantization.advanced_parameters import AdvancedAWQParameters
    from nncf.quantization.algorithms.weight_compression.awq import AWQ
    from nncf.tensor import Tensor

    p = AdvancedAWQParameters()
    awq = AWQ(p.subset_size, p.percent_to_apply, p.alpha_min, p.alpha_max, p.steps, p.prefer_data_aware_scaling)
    step = SimpleNamespace(compression_config=lowering.config(f"INT4_{'SYM' if sym else 'ASYM'}", group),
                           reduction_axes=(0,))
    with lowering.NNCF_LOCK:  # its grid search quantizes with NNCF's functions
        scale = awq._data_aware_step(step, Tensor(down), down_stats, -1, Tensor(up), up_stats)
    return np.array(scale.data, np.float32).reshape(-1)


def divided(stat, scale: np.ndarray):
    """down_proj's input statistics once AWQ's scale is applied (its input / s), as NNCF's ``update_statistics``
    makes them for a scale estimation that follows."""
    from nncf.common.tensor_statistics.statistics import WCTensorStatistic
    from nncf.tensor import Tensor

    return WCTensorStatistic(mean_values=[Tensor(np.asarray(m.data) / scale) for m in stat.mean_values],
                             shape_values=stat.shape_values)


def apply(specs: dict, statistics: dict, read: Callable[[str], np.ndarray]) -> list[str]:
    """Set AWQ's scales on the specs (graph weight name -> streaming.Spec) of every INT4 down_proj whose up_proj
    and both inputs' statistics are known, and update ``statistics`` in place; returns the down_proj names.
    ``read(name)``: the weight in float32."""
    done = []
    for name, down in specs.items():
        if not name.endswith(DOWN):
            continue
        up_name = name[:-len(DOWN)] + UP
        up = specs.get(up_name)
        if up is None or down.bits != 4 or down.group is None or name not in statistics or \
                up_name not in statistics:
            continue
        scale = pair_scale(read(name), statistics[name], read(up_name), statistics[up_name], down.sym, down.group)
        down.row_scale, up.column_scale = scale, (1.0 / scale).astype(np.float32)
        statistics[name] = divided(statistics[name], scale)
        done.append(name)
    return done
