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


def apply(specs: dict, statistics: dict, read: Callable[[str], np.ndarray]) -> list[str]:
    """Set AWQ's scales on the specs (graph weight name -> streaming.Spec) of every INT4 down_proj whose up_proj
    and both inputs' statistics are known, and update ``statistics`` in place; returns the down_proj names.
    ``read(name)``: the weight in float32."""
    from nncf.common.tensor_statistics.statistics import WCTensorStatistic
    from nncf.quantization.advanced_parameters import AdvancedAWQParameters
    from nncf.quantization.algorithms.weight_compression.awq import AWQ
    from nncf.tensor import Tensor

    p = AdvancedAWQParameters()
    awq = AWQ(p.subset_size, p.percent_to_apply, p.alpha_min, p.alpha_max, p.steps, p.prefer_data_aware_scaling)
    done = []
    for name, down in specs.items():
        if not name.endswith(DOWN):
            continue
        up_name = name[:-len(DOWN)] + UP
        up = specs.get(up_name)
        if up is None or down.bits != 4 or down.group is None or name not in statistics or \
                up_name not in statistics:
            continue
        mode = f"INT4_{'SYM' if down.sym else 'ASYM'}"
        step = SimpleNamespace(compression_config=lowering.config(mode, down.group), reduction_axes=(0,))
        scale = awq._data_aware_step(step, Tensor(read(name)), statistics[name], -1, Tensor(read(up_name)),
                                     statistics[up_name])
        scale = np.array(scale.data, np.float32).reshape(-1)
        down.row_scale, up.column_scale = scale, (1.0 / scale).astype(np.float32)
        old = statistics[name]
        statistics[name] = WCTensorStatistic(mean_values=[Tensor(np.asarray(m.data) / scale) for m in old.mean_values],
                                             shape_values=old.shape_values)
        done.append(name)
    return done
