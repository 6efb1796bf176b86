"""Parity of an exported MTP graph (toolchain/export/mtp.py) with its PyTorch reference
(toolchain/export/mtp_reference.py).

On the export's parity prompts, the PyTorch main model decodes greedily; its final-normed hidden states over the
whole sequence feed both the reference MTP layer and the graph, which run the same chunks through their own KV
caches: the prompt (a prefill) and then one position at a time. Logits are compared at every real position
(left padding excluded) relative to the reference's range, at the main graph's tolerances (verify/parity.py), and
their argmax (the drafts) must be identical.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from toolchain.checkpoint.reader import open_checkpoint
from toolchain.export.mtp_block import MtpModule, load_mtp, mtp_block
from toolchain.export.mtp_reference import mtp_layer_indices
from toolchain.interface.graph import (
    HIDDEN_STATES,
    MTP_HIDDEN,
    cache_dtype as graph_cache_dtype,
    graph_cache_spec,
    graph_metadata,
)
from toolchain.reference.whole import TorchDecoder
from toolchain.runtime.decoder import Decoder, StatelessDecoder, positions
from toolchain.runtime.engines import GraphRunner
from toolchain.runtime.generate import greedy_logits
from toolchain.verify.parity import Case, tolerance as parity_tolerance


class MtpTorchDecoder:
    """The reference MTP layer behind the Decoder calls (``inputs`` carries the hidden states), with its own
    DynamicCache."""

    backend = "pytorch"
    threads, load_seconds = 0, 0.0
    runtime_config: dict = {}  # noqa: RUF012 - a default every instance shares and none mutates

    def __init__(self, mtp: MtpModule) -> None:
        self.mtp = mtp
        self.extras: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        self.cache = self.mtp.new_cache()

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0,
                inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
        del logits_to_keep
        assert inputs is not None  # the MTP layer always reads the main model's hidden states
        with torch.no_grad():
            logits, hidden = self.mtp(torch.from_numpy(np.ascontiguousarray(inputs[HIDDEN_STATES])),
                                      torch.from_numpy(np.ascontiguousarray(input_ids, np.int64)),
                                      torch.from_numpy(np.ascontiguousarray(attention_mask, np.int64)),
                                      torch.from_numpy(positions(attention_mask, input_ids.shape[1])), self.cache)
        self.extras = {MTP_HIDDEN: hidden.numpy()}
        return logits.numpy()


def reference_mtp(model, source_path: Path) -> MtpModule:
    """The checkpoint's first MTP layer over the loaded main ``model``."""
    with open_checkpoint(source_path, mtp=True) as reader:
        indices = mtp_layer_indices(reader.names(), reader.config)
        if not indices:
            raise ValueError(f"{source_path} has no MTP layer")
        return load_mtp(model, reader, indices[0])


def mtp_inputs(model, case: Case, new_tokens: int, pad_id: int):
    """(ids [B, S], mask [B, S], hidden [B, S, H]): the case's prompts left-padded with the main model's greedy
    tokens after them, and the main model's final-normed hidden state at each position."""
    tokens = greedy_logits(TorchDecoder.over(model), case.prompts, new_tokens, pad_id)[0]
    width = max(len(p) for p in case.prompts)
    ids = np.array([[pad_id] * (width - len(p)) + p for p in case.prompts], np.int64)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in case.prompts], np.int64)
    ids = np.concatenate([ids, np.asarray(tokens, np.int64)], axis=1)
    mask = np.concatenate([mask, np.ones_like(tokens, dtype=np.int64)], axis=1)
    return ids, mask, main_hidden(model, ids, mask)


def main_hidden(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """What the MTP layer reads of the main model at each position: its final-normed hidden state [B, S, H], or
    DeepSeek-V4's streams before hc_head [B, S, hc_mult, H] (deepseek_v4_mtp_reference.py), computed for each row
    alone as its reference runs (Architecture.reference_row_by_row), zeros at left padding."""
    return mtp_block(model.config.model_type).main_hidden(model, ids, mask, positions(mask, ids.shape[1]))


def run_mtp(decoder: Decoder, ids: np.ndarray, mask: np.ndarray, hidden: np.ndarray, prefill: int) -> np.ndarray:
    """The MTP logits at positions 0 .. S-2 (position i reads hidden state i and token i+1): ``prefill`` positions
    at once, then one at a time."""
    decoder.reset()
    chunks = [(0, prefill)] + [(i, i + 1) for i in range(prefill, ids.shape[1] - 1)]
    logits = [decoder.forward(ids[:, a + 1:b + 1], mask[:, :b], inputs={HIDDEN_STATES: hidden[:, a:b]})
              for a, b in chunks]
    return np.concatenate(logits, axis=1)


def compare_mtp(model, mtp: MtpModule, candidates: dict[str, Callable[[], Decoder]], cases: list[Case],
                new_tokens: int, pad_id: int, cache_dtype: str = "float32") -> dict[str, dict]:
    """{backend: result} of each backend's decoder of the MTP graph against the reference (module doc);
    ``cache_dtype``: the graph's KV cache's (export.cache_dtype), which widens the bound (verify/parity.py)."""
    inputs = [mtp_inputs(model, case, new_tokens, pad_id) for case in cases]
    widths = [max(len(p) for p in case.prompts) for case in cases]
    reference = [run_mtp(MtpTorchDecoder(mtp), ids, mask, hidden, w - 1)
                 for (ids, mask, hidden), w in zip(inputs, widths)]
    results = {}
    for backend, make in candidates.items():
        candidate = make()
        rows: list[dict] = []
        relative: list[float] = []
        identical: list[bool] = []
        for case, (ids, mask, hidden), w, ref in zip(cases, inputs, widths, reference):
            got = run_mtp(candidate, ids, mask, hidden, w - 1)
            real = mask[:, :-1].astype(bool)
            diff = float(np.abs(got - ref)[real].max())
            span = float(ref[real].max() - ref[real].min())
            same = bool((got.argmax(-1)[real] == ref.argmax(-1)[real]).all())
            relative.append(diff / span)
            identical.append(same)
            rows.append({"name": case.name, "positions": int(real.sum()), "max_abs_diff": diff,
                         "logits_range": span, "relative_diff": diff / span, "drafts_identical": same})
        tolerance = parity_tolerance(backend, cache_dtype)
        results[backend] = {
            "passed": max(relative) <= tolerance and all(identical),
            "tolerance_relative_to_logits_range": tolerance,
            "max_relative_diff": max(relative),
            "drafts_identical": all(identical),
            "cases": rows,
        }
    return results


def compare_mtp_graph(model, source_path: Path, graph: Path, backends: tuple[str, ...], cases: list[Case],
                      new_tokens: int, pad_id: int) -> dict[str, dict]:
    """An exported MTP graph file, run stateless on each backend, against the checkpoint's reference MTP layer
    over the loaded main ``model``."""
    spec = graph_cache_spec(graph)
    def stateless(backend: str) -> Decoder:
        return StatelessDecoder(GraphRunner(graph, backend), spec)

    candidates: dict[str, Callable[[], Decoder]] = {b: functools.partial(stateless, b) for b in backends}
    return compare_mtp(model, reference_mtp(model, source_path), candidates, cases, new_tokens, pad_id,
                       graph_cache_dtype(graph_metadata(graph)))
