"""Continuous batching on an OpenVINO artifact with dstc's own runner, for the graphs openvino_genai cannot page.

openvino_genai's ContinuousBatchingPipeline replaces the graph's ScaledDotProductAttention by paged attention;
MLA's latent cache (toolchain/export/deepseek.py, the default of every DeepSeek-V2/V3 export) has no such node
(its scores are two products over two cached tensors), so the pipeline refuses those artifacts. They are batched
here instead, as ONNX Runtime artifacts are in batching.py's PersistentBatch: one infer request of the stateful IR
holds the whole running batch's cache in its variables, so a decode step copies no cache in or out.

- A join prefills the new sequences on a second infer request, then merges both caches (left-padded to one width)
  into the running request's variables: one copy of the cache, as PersistentBatch's rebuild.
- A sequence that leaves is dropped at the next step by the graph's ``beam_idx`` input (the Gather that the
  compile stage puts on every cache variable, toolchain/compile/openvino_ir.py): the running rows are selected in
  the graph, with no copy through Python.

Variables are read and written in f32: the CPU plugin converts to and from the cache precision the artifact asks
for (its rt_info ``runtime_options``). With an f16 or bf16 cache that is exact (they widen to f32 and back without
loss); with a u8 cache a merged row would be quantized again, so the artifact's precision is used as it is and a u8
cache is not asked for here.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path

import numpy as np

from toolchain.interface.graph import (
    KV_CACHE,
    PRESENT_PREFIX,
    UNPAGEABLE,
    cache_lengths,
    extra_cache_kinds,
    graph_metadata,
)
from toolchain.runtime.batch_holes import Holes, compact_cache, compacted
from toolchain.runtime.batching import BatchedDecoder, merged_rows, stack_left_padded
from toolchain.runtime.decoder import positions
from toolchain.runtime.generate import left_pad
from toolchain.runtime.last_logits import INPUT as LOGITS_TO_KEEP
from toolchain.runtime.prefill_chunks import prefill_spans


def pageable(xml: Path) -> bool:
    """Whether openvino_genai's continuous batching can page this IR's KV cache: it converts the graph's
    ScaledDotProductAttention, which every cache but MLA's latent one and DeepSeek-V4's per-token state is read by
    (the graph's ``dstc.kv_cache``), and pages keys and values only (not, e.g., DeepSeek-V3.2's indexer keys)."""
    metadata = graph_metadata(xml)
    return metadata.get(KV_CACHE) not in UNPAGEABLE and not extra_cache_kinds(metadata)


class StatefulBatch(Holes, BatchedDecoder):
    """A running batch of sequences in the variables of one infer request of a stateful OpenVINO IR (an
    OpenVINODecoder's); the interface is BatchedDecoder's, with speculative decoding's ``verify`` and ``keep``
    (toolchain/runtime/batch_holes.py), whose holes are compacted in the variables."""

    layout = "batch"

    def __init__(self, decoder, pad_id: int) -> None:
        super().__init__(pad_id)
        # the compressed V4 cache's length rules (batching.merged_rows)
        self._lengths: Mapping[str, tuple[str, int]] = cache_lengths(decoder.metadata)
        self._request = decoder.request
        self._side = decoder.compiled.create_infer_request()  # prefills of joining sequences
        self._chunking = decoder.chunking
        self._rows: list[Hashable | None] = []  # None: left, dropped at the next step
        self._mask = np.zeros((0, 0), np.int64)
        self._spans = {}
        self._extra = tuple(getattr(decoder, "extra_outputs", ()))  # e.g. the hidden states MTP drafts read
        self.extras: dict[str, np.ndarray] = {}  # the extra outputs of the last join or verify, [rows, S, ...]

    @property
    def keys(self) -> list[Hashable]:
        return [key for key in self._rows if key is not None]

    def tokens_held(self) -> int:
        live = self._live()
        return int(self._mask[live].sum()) if live else 0

    def _live(self) -> list[int]:
        return [row for row, key in enumerate(self._rows) if key is not None]

    def join(self, prompts: dict[Hashable, list[int]]) -> dict[Hashable, np.ndarray]:
        self._check_join(prompts)
        keys = list(prompts)
        ids, mask = left_pad([list(prompts[k]) for k in keys], self.pad_id)
        if not self.keys:
            logits = self._prefill(self._request, ids, mask)
            self._rows, self._mask = keys, mask
        else:
            logits = self._prefill(self._side, ids, mask)
            if self.holes():
                self._compact()
            self._merge(keys, mask)
        self._spans = {key: (row, ids.shape[1] - len(prompts[key]), ids.shape[1]) for row, key in enumerate(keys)}
        return {key: logits[row] for row, key in enumerate(keys)}

    def _prefill(self, request, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The last positions' logits of joining sequences prefilled from an empty cache on ``request``, in the
        decoder's prefill chunks (toolchain/runtime/prefill_chunks.py)."""
        request.reset_state()
        parts: dict[str, list[np.ndarray]] = {}
        for start, end in prefill_spans(self._chunking, len(ids), ids.shape[1]):
            logits, extras = _run(request, ids[:, start:end], mask[:, :end], np.arange(len(ids), dtype=np.int32),
                                  extra=self._extra)
            for name, value in extras.items():
                parts.setdefault(name, []).append(value)
        self.extras = {name: np.concatenate(chunks, axis=1) for name, chunks in parts.items()}
        return logits[:, -1]

    def _merge(self, keys: list[Hashable], mask: np.ndarray) -> None:
        """The live rows' cache, then the side request's, left-padded to one width with the columns only padding
        occupies cut off, written into the running request's variables."""
        live = self._live()
        first = int(np.argmax(self._mask[live].any(axis=0)))
        merged_mask = stack_left_padded([self._mask[live, first:], mask], axis=1)
        side = {state.name: state for state in self._side.query_state()}
        for state in self._request.query_state():
            # in the variable's own element type (float32, or the float16 of export.cache_dtype)
            old = np.array(state.state.data[live])
            new = np.asarray(side[state.name].state.data, old.dtype)
            rule = self._lengths.get(past_of(state.name))
            state.state = _tensor(merged_rows(old, first, self._mask.shape[1] - first, new, rule))
        self._rows = [self._rows[row] for row in live] + keys
        self._mask = merged_mask

    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        self._check_step(tokens)
        live = self._live()
        self._rows = [self._rows[row] for row in live]
        mask = np.concatenate([self._mask[live], np.ones((len(live), 1), np.int64)], axis=1)
        ids = np.array([[tokens[key]] for key in self._rows], np.int64)
        # beam_idx = the live rows: the graph's Gather drops the rows that left from every variable
        logits, _ = _run(self._request, ids, mask, np.asarray(live, np.int32))
        self._mask = mask
        return {key: logits[row, -1] for row, key in enumerate(self._rows)}

    def verify(self, fed: dict[Hashable, list[int]]) -> dict[Hashable, np.ndarray]:
        """PersistentBatch.verify's: every running sequence fed its tokens in one infer, its logits [its tokens,
        vocab] returned; ``keep`` must follow."""
        self._check_step(fed)
        live = self._live()
        self._rows = [self._rows[row] for row in live]
        ids, new, _ = self._verify_feeds(fed, None)
        mask = np.concatenate([self._mask[live], new], axis=1)
        logits, self.extras = _run(self._request, ids, mask, np.asarray(live, np.int32), keep=0, extra=self._extra)
        self._mask = mask
        return {key: logits[row, :len(fed[key])] for row, key in enumerate(self._rows) if key is not None}

    def _compact(self) -> None:
        """Each row's held columns right-aligned in every variable (rows that left too: the next infer drops
        them)."""
        mask, columns = compacted(self._mask)
        for state in self._request.query_state():
            state.state = _tensor(compact_cache(np.array(state.state.data), columns, mask.shape[1]))
        self._mask = mask

    def leave(self, keys: Iterable[Hashable]) -> None:
        drop = set(keys)
        self._rows = [None if key in drop else key for key in self._rows]
        if not self.keys:
            self._rows, self._mask = [], np.zeros((0, 0), np.int64)
            self._request.reset_state()


def _run(request, ids: np.ndarray, mask: np.ndarray, beam_idx: np.ndarray, keep: int = 1,
         extra: tuple[str, ...] = ()) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The logits [B, ``keep`` positions, vocab] of one infer (the IR computes the lm_head for them alone; 0: for
    every position) and the ``extra`` outputs."""
    ids = np.ascontiguousarray(ids, np.int64)
    mask = np.ascontiguousarray(mask, np.int64)
    result = request.infer({"input_ids": ids, "attention_mask": mask,
                            "position_ids": np.ascontiguousarray(positions(mask, ids.shape[1])),
                            "beam_idx": beam_idx, LOGITS_TO_KEEP: np.array(keep, np.int64)},
                           share_inputs=True)  # as the decoder feeds the same request (no copy into its tensors)
    return np.array(result["logits"], np.float32), {name: np.array(result[name]) for name in extra}


def past_of(variable: str) -> str:
    """The cache input a variable of the stateful IR stands for: OpenVINO names it input + output
    (``past_key_values.0.keypresent.0.key``)."""
    return variable[:variable.index(PRESENT_PREFIX)]


def _tensor(array: np.ndarray):
    import openvino as ov

    return ov.Tensor(np.ascontiguousarray(array))


def own_request_batch(decoder, pad_id: int) -> StatefulBatch:
    """A StatefulBatch over an infer request of its own on ``decoder``'s compiled model (the cache lives in a
    request's variables): beside others, for batch_rows.RowByRow's one-row batches."""
    view = copy.copy(decoder)
    view.request = decoder.compiled.create_infer_request()
    return StatefulBatch(view, pad_id)
