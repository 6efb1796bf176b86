"""Continuous batching: sequences that join and leave a running batch between decode steps.

ONNX Runtime. dstc's graph takes a left-padded batch (``attention_mask`` [B, past + S], position ids from it) and a KV
cache of ``[B, heads, past, dim]`` per layer, and returns the cache grown by the new positions. Two layouts of that
cache over a changing set of sequences are implemented, told apart by ``layout``:

- ``"batch"`` (the default): the running batch keeps one cache tensor per layer for all its rows, as ORT returned
  it; a decode step binds last step's ``present.*`` OrtValues as this step's ``past_key_values.*`` with no copy.
  The cache is rebuilt (copied once) only when sequences join: they are prefilled as a batch of their own and
  then concatenated to it (the shorter side left-padded, masked out). A sequence that leaves stays as a dead row,
  fed padding, until that rebuild drops it (or until half the rows are dead); the columns that only padding
  occupies are then cut off.
- ``"gather"``: every sequence keeps its own cache; each step left-pads and concatenates them into a batch, runs
  it, and slices each row's cache back out of the result (per-sequence caches gathered every step: what a paged
  layout costs with a graph that takes a contiguous cache).

``benchmarks/serve_load.py layouts`` measures both (the numbers are in that script's docstring): per decode step,
"batch" is faster from 4 sequences on, 3.7x at 16 sequences of 512 tokens (3.1 against 11.5 ms), and within
0.15 ms of "gather" at one sequence; a join costs it one copy of the running cache. The server uses it.

OpenVINO. openvino_genai's ContinuousBatchingPipeline does this itself (paged attention over KV-cache blocks,
chunked prefill, prefix caching): ``openvino_pipeline`` builds one over a dstc artifact's stateful IR, which the
pipeline converts to paged attention when it loads it. It finds the attention to convert as
ScaledDotProductAttention, which MLA's latent cache (toolchain/export/deepseek.py) does not have: such an artifact
is batched by dstc's runner on its stateful IR instead (batching_openvino.py; told apart by ``dstc.kv_cache``
``latent`` in the graph's metadata).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from toolchain.errors import InputError
from toolchain.interface.files import MODEL_XML
from toolchain.interface.graph import (
    ATTENTION_MASK,
    INPUT_IDS,
    KV_CACHE,
    LATENT,
    LOGITS,
    POOLED,
    POSITION_IDS,
    UNPAGEABLE,
    WINDOW,
    cache_lengths,
    extra_cache_kinds,
    graph_metadata,
    present_of,
    require_positional_cache,
)
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.batch_holes import Holes, compact_cache, compacted
from toolchain.runtime.decoder import ort_cache, positions
from toolchain.runtime.engines import NUMERICS, runtime_cache_property
from toolchain.runtime.generate import left_pad
from toolchain.runtime.prefill_chunks import prefill_spans

LAYOUTS = ("batch", "gather")


def stack_left_padded(parts: list[np.ndarray], axis: int, right: bool = False) -> np.ndarray:
    """``parts`` stacked on axis 0 (rows of a batch), each left-padded with zeros on ``axis`` to the widest: the
    masks or KV caches of running and joining sequences of different lengths, in one new buffer. ``right``: padded
    on the right instead."""
    width = max(part.shape[axis] for part in parts)
    shape = list(parts[0].shape)
    shape[0], shape[axis] = sum(len(part) for part in parts), width
    out = np.zeros(shape, parts[0].dtype)
    row = 0
    for part in parts:
        index = [slice(row, row + len(part))] + [slice(None)] * (part.ndim - 1)
        index[axis] = slice(0, part.shape[axis]) if right else slice(width - part.shape[axis], None)
        out[tuple(index)] = part
        row += len(part)
    return out


def merged_rows(old: np.ndarray, first: int, own: int, new: np.ndarray | None, rule: tuple[str, int] | None
                ) -> np.ndarray:
    """A cache tensor of running rows ``old``, whose mask's first ``first`` columns are padding only and cut off
    (``own`` columns left), stacked with joining rows' ``new`` (None: none) by its length rule (``rule``,
    toolchain/interface/graph.py cache_lengths; None one entry per position): per position and window (the last
    slots) cut and left-padded as the mask is; pooled entries (a row's own windows, from its position 0) kept to the
    capacity of ``own`` columns and right-padded; a tail (fixed, per row) as it is."""
    if rule is None:
        kept = old[:, :, first:]
    elif rule[0] == WINDOW:
        kept = old[:, :, old.shape[2] - min(own, rule[1]):]
    elif rule[0] == POOLED:
        kept = old[:, :, :own // rule[1]]
    else:
        kept = old
    return stack_left_padded([kept, *([] if new is None else [new])], axis=2,
                             right=rule is not None and rule[0] == POOLED)


class BatchedDecoder:
    """A running batch of sequences, each named by a key, on a decoder's graph.

    ``join(prompts)`` prefills new sequences and returns the logits [vocab] of each one's last prompt position;
    ``step(tokens)`` feeds one token to every running sequence and returns each one's next-token logits;
    ``leave(keys)`` drops sequences (their cache is freed). Calls come from one thread. The layouts here run an
    ONNX Runtime decoder's session; batching_openvino.StatefulBatch runs an OpenVINO one.
    """

    layout = ""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    # -- what every layout provides ----------------------------------------------------------------------------

    @property
    def keys(self) -> list[Hashable]:
        raise NotImplementedError

    def tokens_held(self) -> int:
        """Positions held in the KV cache over all running sequences (padding not counted)."""
        raise NotImplementedError

    def join(self, prompts: dict[Hashable, list[int]]) -> dict[Hashable, np.ndarray]:
        raise NotImplementedError

    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        raise NotImplementedError

    def leave(self, keys: Iterable[Hashable]) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.keys)

    # -- shared ------------------------------------------------------------------------------------------------

    def _check_join(self, prompts: dict[Hashable, list[int]]) -> None:
        if not prompts or not all(prompts.values()):
            raise InputError("every joining sequence needs at least one prompt token")
        twice = set(prompts) & set(self.keys)
        if twice:
            raise ValueError(f"sequences already running: {sorted(map(str, twice))}")

    def _check_step(self, tokens: Mapping[Hashable, object]) -> None:
        if set(tokens) != set(self.keys):
            raise ValueError("a step feeds one token to every running sequence, and to no other")


class _OnnxRuntimeBatch(BatchedDecoder):
    """What both ONNX Runtime layouts share: the session, its cache inputs, one run of it."""

    def __init__(self, decoder, pad_id: int) -> None:
        super().__init__(pad_id)
        self.session = decoder.session
        # the compressed V4 cache's tensors that do not hold one entry per position (merged_rows)
        self._lengths: Mapping[str, tuple[str, int]] = cache_lengths(getattr(decoder, "metadata", {}))
        self._past = ort_cache(self.session)
        self._present = {name: present_of(name) for name in self._past}
        self._extra = list(getattr(decoder, "extra_outputs", ()))  # e.g. the hidden states MTP drafts read
        self._outputs = [LOGITS, *self._present.values(), *self._extra]
        self.extras: dict[str, np.ndarray] = {}  # the extra outputs of the last join or verify, [rows, S, ...]
        # A runner that adds a logits_to_keep input to the graph (toolchain/runtime/last_logits.py) gets 1: only the
        # last position's logits are read, so a prefill computes the lm_head for one position, not the whole prompt.
        self._keep_last = any(i.name == "logits_to_keep" for i in self.session.get_inputs())
        self._chunking = decoder.chunking

    def _prefill(self, ids: np.ndarray, mask: np.ndarray, inputs: dict[str, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, dict]:
        """_run's logits and presents of joining sequences from an empty cache, fed in the decoder's prefill chunks
        (toolchain/runtime/prefill_chunks.py); ``extras`` over all the chunks."""
        present = self._empty(len(ids))
        parts: dict[str, list[np.ndarray]] = {name: [] for name in self._extra}
        for start, end in prefill_spans(self._chunking, len(ids), ids.shape[1]):
            chunk = {name: value[:, start:end] for name, value in (inputs or {}).items()}
            logits, present = self._run(ids[:, start:end], mask[:, :end], present, inputs=chunk)
            for name in self._extra:
                parts[name].append(self.extras[name])
        self.extras = {name: np.concatenate(chunks, axis=1) for name, chunks in parts.items()}
        return logits, present

    def _run(self, ids: np.ndarray, mask: np.ndarray, past: dict, *, keep: int = 1,
             inputs: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, dict]:
        """Logits [B, S or ``keep``, vocab] (numpy; 0 keeps every position) and the presents as OrtValues (ORT's own
        buffers, not copied); the extra outputs in ``extras``. ``inputs``: the graph's further inputs (an MTP
        graph's hidden states)."""
        from onnxruntime import OrtValue

        ids = np.ascontiguousarray(ids, np.int64)
        mask = np.ascontiguousarray(mask, np.int64)
        pos = np.ascontiguousarray(positions(mask, ids.shape[1]))
        feeds = {INPUT_IDS: OrtValue.ortvalue_from_numpy(ids), ATTENTION_MASK: OrtValue.ortvalue_from_numpy(mask),
                 POSITION_IDS: OrtValue.ortvalue_from_numpy(pos), **past}
        held = {name: np.ascontiguousarray(value) for name, value in (inputs or {}).items()}
        feeds.update({name: OrtValue.ortvalue_from_numpy(value) for name, value in held.items()})
        if self._keep_last:
            feeds["logits_to_keep"] = OrtValue.ortvalue_from_numpy(np.array(keep, np.int64))
        values = dict(zip(self._outputs, self.session.run_with_ort_values(self._outputs, feeds)))
        self.extras = {name: values[name].numpy() for name in self._extra}
        return values[LOGITS].numpy(), {name: values[present] for name, present in self._present.items()}

    def _empty(self, batch: int) -> dict:
        from onnxruntime import OrtValue

        return {name: OrtValue.ortvalue_from_shape_and_type([batch, heads, 0, dim], dtype, "cpu", 0)
                for name, (heads, dim, dtype) in self._past.items()}


class PersistentBatch(Holes, _OnnxRuntimeBatch):
    """One cache tensor per layer for the whole running batch, rebuilt only when sequences join.

    A sequence that leaves becomes a dead row, fed padding, until the next join rebuilds the cache anyway (or until
    half the rows are dead): a leave costs no copy of the cache, a join one. Speculative decoding's ``verify`` and
    ``keep`` leave holes in it (toolchain/runtime/batch_holes.py), which a rebuild cuts.
    """

    layout = "batch"

    def __init__(self, decoder, pad_id: int) -> None:
        super().__init__(decoder, pad_id)
        self._rows: list[Hashable | None] = []  # None: a dead row
        self._mask = np.zeros((0, 0), np.int64)
        self._cache: dict = {}
        self._held: list[np.ndarray] = []  # numpy buffers the cache's OrtValues share, kept alive with them
        self._spans = {}

    @property
    def keys(self) -> list[Hashable]:
        return [key for key in self._rows if key is not None]

    @property
    def rows(self) -> int:
        """Rows the graph runs on, dead ones included."""
        return len(self._rows)

    def tokens_held(self) -> int:
        live = [row for row, key in enumerate(self._rows) if key is not None]
        return int(self._mask[live].sum()) if live else 0

    def padded_positions(self) -> int:
        """Positions the batch's cache tensors hold, padding, holes and dead rows included (rows x columns)."""
        return int(self._mask.size)

    def join(self, prompts: dict[Hashable, list[int]],
             inputs: dict[str, dict[Hashable, np.ndarray]] | None = None) -> dict[Hashable, np.ndarray]:
        """``inputs``: the graph's further inputs of each joining sequence ([its prompt's length, ...] each, e.g. an
        MTP graph's hidden states), left-padded as its tokens."""
        self._check_join(prompts)
        keys = list(prompts)
        ids, mask = left_pad([list(prompts[k]) for k in keys], self.pad_id)
        padded = {name: stack_left_padded([value[key][None] for key in keys], axis=1)
                  for name, value in (inputs or {}).items()}
        logits, present = self._prefill(ids, mask, padded)
        self._spans = {key: (row, ids.shape[1] - len(prompts[key]), ids.shape[1]) for row, key in enumerate(keys)}
        if not self.keys:
            self._rows, self._mask, self._cache, self._held = keys, mask, present, []
        else:
            self._rebuild(keys, mask, present)
        return {key: logits[row, -1] for row, key in enumerate(keys)}

    def _rebuild(self, keys: list[Hashable], mask: np.ndarray | None = None, present: dict | None = None) -> None:
        """The cache of the live rows, then of the joining ones (if any), in new buffers, one copy each: dead rows
        dropped, each row's holes and the columns that only padding occupies cut off, the shorter side
        left-padded."""
        live = [row for row, key in enumerate(self._rows) if key is not None]
        columns = None
        if self.holes():
            own, columns = compacted(self._mask[live])
        else:
            first = int(np.argmax(self._mask[live].any(axis=0)))
            own = self._mask[live, first:]
        merged_mask = stack_left_padded([own, *([] if mask is None else [mask])], axis=1)
        cache, buffers = {}, []
        for name in self._past:
            whole = self._array(self._cache[name])
            new = None if present is None else self._array(present[name])
            if columns is not None:  # holes: none in a compressed cache, which speculation refuses
                merged = stack_left_padded([compact_cache(whole[live], columns, own.shape[1]),
                                            *([] if new is None else [new])], axis=2)
            else:
                merged = merged_rows(whole[live], first, own.shape[1], new, self._lengths.get(name))
            buffers.append(merged)
            cache[name] = self._value(merged)
        self._rows = [self._rows[row] for row in live] + keys
        self._mask, self._cache, self._held = merged_mask, cache, buffers

    def _compact(self) -> None:
        self._rebuild([])

    @staticmethod
    def _array(value) -> np.ndarray:
        """A cache tensor as numpy (an OrtValue's buffer)."""
        return value.numpy()

    @staticmethod
    def _value(array: np.ndarray):
        """What the graph is fed a cache tensor as."""
        from onnxruntime import OrtValue

        return OrtValue.ortvalue_from_numpy(array)

    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        self._check_step(tokens)
        ids = np.array([[self.pad_id if key is None else tokens[key]] for key in self._rows], np.int64)
        mask = np.concatenate([self._mask, np.ones((len(self._rows), 1), np.int64)], axis=1)
        logits, present = self._run(ids, mask, self._cache)
        # the presents are ORT's buffers: bound as they are as the next step's past (no copy)
        self._mask, self._cache, self._held = mask, present, []
        return {key: logits[row, -1] for row, key in enumerate(self._rows) if key is not None}

    def verify(self, fed: dict[Hashable, list[int]],
               inputs: dict[str, dict[Hashable, np.ndarray]] | None = None) -> dict[Hashable, np.ndarray]:
        """Every running sequence fed its tokens (at least one: speculative decoding's last chosen token and its
        drafts) in one forward, a row fed fewer padded on the right with holes; each sequence's logits [its tokens,
        vocab]. ``inputs``: further inputs of each ([its tokens, ...]). ``keep`` must follow before the next call."""
        self._check_step(fed)
        ids, new, extra = self._verify_feeds(fed, inputs)
        mask = np.concatenate([self._mask, new], axis=1)
        logits, present = self._run(ids, mask, self._cache, keep=0, inputs=extra)
        self._mask, self._cache, self._held = mask, present, []
        return {key: logits[row, :len(fed[key])] for row, key in enumerate(self._rows) if key is not None}

    def leave(self, keys: Iterable[Hashable]) -> None:
        drop = set(keys)
        self._rows = [None if key in drop else key for key in self._rows]
        if not self.keys:
            self._rows, self._mask, self._cache, self._held = [], np.zeros((0, 0), np.int64), {}, []
        elif 2 * self._rows.count(None) >= len(self._rows):
            self._rebuild([])


class ArrayBatch(PersistentBatch):
    """PersistentBatch's layout on a stateless graph run by a GraphRunner (an OpenVINO artifact's MTP layer,
    toolchain/runtime/mtp_drafter.py): the cache is numpy arrays, each run's present.* fed back as the next one's
    past."""

    def __init__(self, runner, past_specs: dict[str, tuple[int, int]], extra_outputs: tuple[str, ...],
                 chunking, pad_id: int) -> None:
        BatchedDecoder.__init__(self, pad_id)
        self._runner = runner
        self._past = {name: (heads, dim, np.float32) for name, (heads, dim) in past_specs.items()}
        self._present = {name: present_of(name) for name in self._past}
        self._extra = list(extra_outputs)
        self.extras = {}
        self._keep_last = False
        self._chunking = chunking
        self._rows, self._mask, self._cache, self._held, self._spans = [], np.zeros((0, 0), np.int64), {}, [], {}

    def _run(self, ids: np.ndarray, mask: np.ndarray, past: dict, *, keep: int = 1,
             inputs: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, dict]:
        del keep  # a stateless graph computes every position's logits
        feeds = {**{name: np.ascontiguousarray(value) for name, value in (inputs or {}).items()}, **past,
                 INPUT_IDS: np.ascontiguousarray(ids, np.int64), ATTENTION_MASK: np.ascontiguousarray(mask, np.int64),
                 POSITION_IDS: np.ascontiguousarray(positions(mask, ids.shape[1]))}
        outputs = self._runner(feeds)
        self.extras = {name: outputs[name] for name in self._extra}
        return outputs[LOGITS], {name: outputs[present] for name, present in self._present.items()}

    def _empty(self, batch: int) -> dict:
        return {name: np.zeros((batch, heads, 0, dim), np.float32) for name, (heads, dim, _) in self._past.items()}

    @staticmethod
    def _array(value) -> np.ndarray:
        return value

    @staticmethod
    def _value(array: np.ndarray):
        return array


@dataclass
class _Sequence:
    length: int
    cache: dict  # past name -> np.ndarray [heads, length, dim] (a view into the step's present)


class GatheredBatch(_OnnxRuntimeBatch):
    """A cache per sequence; every step gathers them into a left-padded batch and slices the rows back out."""

    layout = "gather"

    def __init__(self, decoder, pad_id: int) -> None:
        super().__init__(decoder, pad_id)
        require_positional_cache(decoder.metadata, f"the {self.layout!r} KV-cache layout (a cache per sequence)")
        self._seqs: dict[Hashable, _Sequence] = {}

    @property
    def keys(self) -> list[Hashable]:
        return list(self._seqs)

    def tokens_held(self) -> int:
        return sum(s.length for s in self._seqs.values())

    def _split(self, keys: list[Hashable], lengths: list[int], present: dict) -> None:
        arrays = {name: value.numpy() for name, value in present.items()}
        width = next(iter(arrays.values())).shape[2]
        for row, (key, length) in enumerate(zip(keys, lengths)):
            self._seqs[key] = _Sequence(length, {name: a[row, :, width - length:] for name, a in arrays.items()})

    def join(self, prompts: dict[Hashable, list[int]]) -> dict[Hashable, np.ndarray]:
        self._check_join(prompts)
        keys = list(prompts)
        ids, mask = left_pad([list(prompts[k]) for k in keys], self.pad_id)
        logits, present = self._prefill(ids, mask)
        self._split(keys, [len(prompts[k]) for k in keys], present)
        return {key: logits[row, -1] for row, key in enumerate(keys)}

    def step(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        from onnxruntime import OrtValue

        self._check_step(tokens)
        keys = list(self._seqs)
        width = max(s.length for s in self._seqs.values())
        mask = np.zeros((len(keys), width + 1), np.int64)
        past, held = {}, []
        for name, (heads, dim, dtype) in self._past.items():
            batch = np.zeros((len(keys), heads, width, dim), dtype)
            for row, key in enumerate(keys):
                seq = self._seqs[key]
                batch[row, :, width - seq.length:] = seq.cache[name]
            held.append(batch)
            past[name] = OrtValue.ortvalue_from_numpy(batch)
        for row, key in enumerate(keys):
            mask[row, width - self._seqs[key].length:] = 1
        ids = np.array([[tokens[k]] for k in keys], np.int64)
        logits, present = self._run(ids, mask, past)
        self._split(keys, [self._seqs[k].length + 1 for k in keys], present)
        return {key: logits[row, -1] for row, key in enumerate(keys)}

    def leave(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._seqs.pop(key, None)


def batched_decoder(decoder, pad_id: int, layout: str = "batch") -> BatchedDecoder:
    """A BatchedDecoder over an ONNX Runtime Decoder (toolchain.runtime.decoder.open_decoder) in one of LAYOUTS (an
    OpenVINO decoder's is batching_openvino.StatefulBatch)."""
    if getattr(decoder, "backend", None) != "onnxruntime":
        raise InputError("these KV-cache layouts run an ONNX Runtime decoder; an OpenVINO one is batched by "
                         "toolchain.runtime.batching_openvino.StatefulBatch")
    if layout not in LAYOUTS:
        raise InputError(f"unknown KV-cache layout {layout!r} (one of {', '.join(LAYOUTS)})")
    return (PersistentBatch if layout == "batch" else GatheredBatch)(decoder, pad_id)


# -- OpenVINO: openvino_genai's continuous-batching pipeline ------------------------------------------------------

KV_BLOCK_TOKENS = 32  # the CPU plugin's paged-attention block size (openvino_genai 2026.4)


@dataclass(frozen=True)
class PipelineSettings:
    threads: int | None = None  # INFERENCE_NUM_THREADS; None: the plugin's choice
    max_batch: int = 16  # sequences decoded together (SchedulerConfig.max_num_seqs)
    max_context: int = 1024  # prompt + generated tokens per sequence, to size the KV cache
    max_batched_tokens: int = 256  # tokens per step; longer prompts are prefilled in chunks (dynamic split-fuse)
    prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix seen before
    f32: bool = False  # f32 compute and KV cache instead of the CPU plugin's default compute precision
    runtime_cache: int | None = None  # CPU_RUNTIME_CACHE_CAPACITY (kernels kept per input shape); None the plugin's
    # None: the compute precision (bf16 where the CPU has it). The plugin's own default, u8, is wrong under batching
    # in OpenVINO 2026.4 (see kv_cache_precision); "u8" asks for it anyway.
    kv_cache_precision: str | None = None
    # dstc serve --speculate prompt-lookup: openvino_genai's own prompt lookup, this many draft tokens (0: none)
    prompt_lookup: int = 0
    # dstc serve --speculate draft:ARTIFACT: openvino_genai's own draft-model speculation, the draft an OpenVINO
    # artifact it pages too (its directory), ``draft_tokens`` drafts per step
    draft_model: str | None = None
    draft_tokens: int = 0


def kv_cache_precision(settings: PipelineSettings) -> str:
    """The KV-cache precision the pipeline is given: the inference precision the CPU plugin picks (bf16 on CPUs
    with bf16 instructions, else f32), unless asked otherwise.

    Not the plugin's default u8: measured with OpenVINO 2026.4 on a Xeon with AMX, the paged-attention kernel with a
    u8 KV cache returns other tokens for a sequence decoded beside others than for the same sequence alone, from
    the first tokens on (16 concurrent greedy requests of the embedded DeepSeek-V3 model: 16 of 16 differ, most
    of them garbage; at f32 compute with a u8 cache as well), while bf16 and f16 caches give the batch-1 tokens
    for all 16. It looks tied to MLA's key and value widths differing (48 and 24 there): the embedded qwen2 model
    (equal widths) gives the batch-1 tokens at u8 too; bf16 is used for every model all the same, at twice u8's
    cache memory. The plugin accepts bf16 compute only with a bf16 (or u8) cache, and f32 compute with f32.
    """
    if settings.f32:
        return "f32"
    if settings.kv_cache_precision:
        return settings.kv_cache_precision
    import openvino as ov

    hint = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")
    name = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
    return {"bf16": "bf16", "f16": "f16"}.get(name, "f32")


def openvino_pipeline(artifact: Artifact, settings: PipelineSettings):
    """(openvino_genai.ContinuousBatchingPipeline over the artifact, the properties it was given, its
    SchedulerConfig). The KV cache is sized for ``max_batch`` sequences of ``max_context`` tokens."""
    if artifact.backend != "openvino":
        raise InputError(f"{artifact.path} is an {artifact.backend} artifact, not an OpenVINO one")
    kv_cache = graph_metadata(artifact.path / MODEL_XML).get(KV_CACHE)
    if kv_cache in UNPAGEABLE:
        # genai's paged attention replaces the graph's attention and its cache; MLA's latent cache and V4's
        # per-token state have neither form (toolchain/export/deepseek.py, deepseek_v4_attention.py)
        remedy = (", or build it with export.mla_cache: per-head (dstc export --mla-cache per-head)"
                  if kv_cache == LATENT else "")
        raise InputError(f"{artifact.path}: openvino_genai's continuous batching needs the graph's attention as "
                         f"ScaledDotProductAttention, to page its KV cache, and this artifact has none (a {kv_cache} "
                         f"cache); dstc's runner batches it (batching_openvino.StatefulBatch, what dstc serve "
                         f"uses){remedy}")
    extra = extra_cache_kinds(graph_metadata(artifact.path / MODEL_XML))
    if extra:
        raise InputError(f"{artifact.path}: openvino_genai's continuous batching pages keys and values only, and "
                         f"this artifact's layers cache {', '.join(extra)} too (DeepSeek-V3.2's indexer); dstc's "
                         f"runner batches it (batching_openvino.StatefulBatch, what dstc serve uses)")
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.max_num_seqs = settings.max_batch
    scheduler.max_num_batched_tokens = max(settings.max_batched_tokens, settings.max_batch)
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = settings.prefix_caching
    scheduler.cache_size = 0
    blocks_per_sequence = math.ceil(settings.max_context / KV_BLOCK_TOKENS)
    scheduler.num_kv_blocks = settings.max_batch * (blocks_per_sequence + 1)
    properties = {**(NUMERICS['exact'] if settings.f32 else {}), "KV_CACHE_PRECISION": kv_cache_precision(settings),
                  **({"INFERENCE_NUM_THREADS": settings.threads} if settings.threads else {}),
                  **runtime_cache_property(settings.runtime_cache),
                  **({"prompt_lookup": True} if settings.prompt_lookup else {})}
    draft = {}
    if settings.draft_model:  # on the main model's scheduler (its KV blocks apart) and numerics
        draft = {"draft_model": openvino_genai.draft_model(settings.draft_model, "CPU", scheduler_config=scheduler,
                                                           **properties)}
    pipeline = openvino_genai.ContinuousBatchingPipeline(str(artifact.path), scheduler, "CPU",
                                                         {**properties, **draft})
    return pipeline, {**properties, **({"draft_model": settings.draft_model} if draft else {})}, scheduler


def openvino_generation_config(*, max_new_tokens: int, stop_ids: Iterable[int], temperature: float, top_p: float,
                               seed: int | None, ignore_eos: bool = False, prompt_lookup: int = 0,
                               draft_tokens: int = 0):
    """An openvino_genai.GenerationConfig for one request given token ids (no chat template: the caller applied
    it): greedy at temperature 0, else multinomial sampling with temperature and top-p. ``prompt_lookup``: draft
    tokens of a pipeline built with it (which takes no request without them), n-grams of up to 3 tokens as
    toolchain/runtime/speculative.py's PromptLookup; ``draft_tokens``: those of a pipeline built with a draft
    model."""
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = max_new_tokens
    config.apply_chat_template = False
    config.stop_token_ids = {int(i) for i in stop_ids}
    config.ignore_eos = ignore_eos
    if prompt_lookup:
        config.num_assistant_tokens = prompt_lookup
        config.max_ngram_size = 3
    elif draft_tokens:  # a pipeline built with a draft model
        config.num_assistant_tokens = draft_tokens
    if temperature > 0:
        config.do_sample = True
        config.temperature = float(temperature)
        config.top_p = float(top_p)
        # genai's rng_seed defaults to 0 for every request: without a seed, each would draw the same numbers
        config.rng_seed = int(seed) if seed is not None else secrets.randbits(32)
    return config
