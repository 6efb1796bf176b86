"""Batch-invariant decoding (``dstc serve --deterministic``): a running batch whose every sequence runs alone.

Some kernels give a row other bits beside other rows than alone: ONNX Runtime's 4-bit MatMulNBits takes another
path for one row than for two or more, and its QMoE groups a batch's tokens by expert
(benchmarks/ort_int4_batch_invariance.py), so a near-tied greedy choice can flip with the batch a request happens to
share. ``RowByRow`` gives each sequence a batch of its own (one row; its prefill and every step one run of the
graph), so each request runs exactly the kernels of a request served alone, whatever else is running: the same
tokens, at the cost of one forward per sequence and step instead of one per step (docs/serve.md "Batch
invariance").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import numpy as np

from toolchain.runtime.batching import BatchedDecoder


class RowByRow(BatchedDecoder):
    """BatchedDecoder's interface over one-row batches made by ``make`` (sharing the decoder's session or compiled
    model); a batch that a sequence leaves is kept for the next one to join (an OpenVINO one holds infer requests)."""

    layout = "rows"

    def __init__(self, make: Callable[[], BatchedDecoder], pad_id: int) -> None:
        super().__init__(pad_id)
        self._make = make
        self._rows: dict[Hashable, BatchedDecoder] = {}
        self._free: list[BatchedDecoder] = []

    @property
    def keys(self) -> list[Hashable]:
        return list(self._rows)

    def tokens_held(self) -> int:
        return sum(batch.tokens_held() for batch in self._rows.values())

    def join(self, prompts: dict[Hashable, list[int]]) -> dict[Hashable, np.ndarray]:
        self._check_join(prompts)
        logits = {}
        for key, prompt in prompts.items():
            batch = self._free.pop() if self._free else self._make()
            try:
                logits[key] = batch.join({key: prompt})[key]
            except BaseException:
                self.leave(logits)  # all or none joins, as a batched prefill
                self._free.append(batch)
                raise
            self._rows[key] = batch
        return logits

    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        self._check_step(tokens)
        return {key: self._rows[key].step({key: token})[key] for key, token in tokens.items()}

    def leave(self, keys: Iterable[Hashable]) -> None:
        for key in list(keys):
            batch = self._rows.pop(key, None)
            if batch is not None:
                batch.leave([key])
                self._free.append(batch)


# ONNX Runtime ops whose output for a row depends on the other rows of its batch: MatMulNBits and QMoE (measured,
# benchmarks/ort_int4_batch_invariance.py), and the dynamically quantized int8 ones, whose activations' scale is
# taken over the whole batch. A graph without them (fp32) decodes a row bit-equally in any batch.
VARIANT_OPS = frozenset({"MatMulNBits", "QMoE", "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulInteger",
                         "MatMulIntegerToFloat"})


def batch_variance(artifact) -> str | None:
    """Why a row of this artifact may decode to other bits beside other rows than alone, or None when it cannot:
    the variant ops of an ONNX Runtime graph; an OpenVINO artifact always (the CPU plugin picks its kernels by
    shape, and its compute precision by CPU)."""
    if artifact.backend == "openvino":
        return "the OpenVINO CPU plugin chooses kernels by the batch's shape"
    import onnx

    ops = sorted({node.op_type for node in onnx.load(artifact.graph, load_external_data=False).graph.node}
                 & VARIANT_OPS)
    return f"its graph's {', '.join(ops)} give a row other bits in a batch than alone" if ops else None
