"""Drafts for every sequence of a running batch, for speculative decoding under continuous batching
(toolchain/serve/engine_runner.py): prompt lookup per sequence, or DeepSeek's MTP layer or a smaller draft artifact
run on the whole batch at once, as the main model is.

The MTP layer (toolchain/runtime/mtp_drafter.py says what it reads and drafts) keeps its cache in a PersistentBatch
of its own graph (toolchain/runtime/batching.py; an ArrayBatch of an OpenVINO artifact's stateless MTP IR), its
rows the main batch's sequences: each propose feeds every
running sequence the positions the main model accepted since the last one (their hidden states from the main
model's verify step) in one forward, prefills the sequences that are new in another, then chains the layer on its
own output for the further drafts, one forward per draft for all rows. The chained positions are speculative: they
become holes in its cache once drafted (``forget``), as the main batch's rejected drafts do.

A draft artifact (``draft:ARTIFACT``, of the main model's tokenizer) runs the same way on a batch of its own graph
(a PersistentBatch of an ONNX Runtime artifact, a StatefulBatch of an OpenVINO one), with tokens in place of the
main model's hidden states: each propose feeds every running sequence the tokens it was given since its last
propose (the accepted drafts and the next token) in one forward, prefills the new sequences, and chains k-1
single-token forwards of all rows. The chained positions stay in its cache: the next propose keeps each row's
accepted ones (as DraftModel rolls back to them at batch 1) and forgets the rest, so an accepted draft is not
computed twice. Its drafts are greedy: one-hot to the server's speculative
sampling, which keeps a sampled request's tokens distributed as the main model's.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol

import numpy as np

from toolchain.errors import InputError
from toolchain.interface.files import MODEL_XML
from toolchain.interface.graph import HIDDEN_STATES, MTP_HIDDEN, require_positional_cache
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.batch_holes import holds_holes
from toolchain.runtime.batching import ArrayBatch, PersistentBatch
from toolchain.runtime.batching_openvino import StatefulBatch, pageable
from toolchain.runtime.decoder import OnnxRuntimeDecoder, StatelessDecoder, open_decoder
from toolchain.runtime.mtp_drafter import open_mtp_drafter
from toolchain.runtime.speculative import PromptLookup, draft_artifact
from toolchain.settings.speculation import MTP, PROMPT_LOOKUP, SpeculationSettings


class BatchDrafter(Protocol):
    main_outputs: tuple[str, ...]  # extra outputs of the main graph it reads (the batch's decoder opens them)

    def propose(self, sequences: dict[Hashable, list[int]], hidden: dict[Hashable, np.ndarray],
                k: int) -> dict[Hashable, list[int]]:
        """Up to ``k`` drafts after each running sequence's tokens so far (all of them, every step). ``hidden``: the
        main model's hidden states (``main_outputs``) at the positions its last forward of that sequence kept: the
        prompt's after the prefill, then the fed token's and the accepted drafts'."""

    def leave(self, keys: Iterable[Hashable]) -> None:
        """Sequences that left the running batch."""

    def reset(self) -> None:
        """Forget every sequence."""


class BatchPromptLookup:
    """PromptLookup's n-gram drafts, sequence by sequence (no cache)."""

    main_outputs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.lookup = PromptLookup()

    def propose(self, sequences: dict[Hashable, list[int]], hidden: dict[Hashable, np.ndarray],
                k: int) -> dict[Hashable, list[int]]:
        del hidden
        return {key: self.lookup.propose(tokens, {}, k) for key, tokens in sequences.items()}

    def leave(self, keys: Iterable[Hashable]) -> None:
        pass

    def reset(self) -> None:
        pass


class _OwnBatch:
    """A drafter running a batch of its own graph, its rows the main batch's sequences, and per sequence how far its
    cache has taken it in (``_seen``)."""

    def __init__(self, batch) -> None:
        self.batch = batch
        self._seen: dict[Hashable, int] = {}

    def _running(self, sequences: dict[Hashable, list[int]]) -> list[Hashable]:
        """The batch's sequences, every one of which each propose is given."""
        running = self.batch.keys
        if set(running) - set(sequences):
            raise ValueError("every running sequence is given to each propose")
        return running

    def leave(self, keys: Iterable[Hashable]) -> None:
        gone = [key for key in keys if key in self._seen]
        self.batch.leave(gone)
        for key in gone:
            del self._seen[key]

    def reset(self) -> None:
        self.batch.leave(self.batch.keys)
        self._seen = {}


class BatchMtp(_OwnBatch):
    """The MTP layer's greedy drafts for a running batch (see the module doc). ``_seen``: per sequence, the last
    position the MTP graph computed from the main model's states."""

    main_outputs: tuple[str, ...] = (HIDDEN_STATES,)

    def __init__(self, batch: PersistentBatch) -> None:
        super().__init__(batch)  # over the MTP graph

    def propose(self, sequences: dict[Hashable, list[int]], hidden: dict[Hashable, np.ndarray],
                k: int) -> dict[Hashable, list[int]]:
        if k < 1:
            return {}
        running = self._running(sequences)
        last: dict[Hashable, np.ndarray] = {}  # each sequence's logits of its first draft
        own: dict[Hashable, np.ndarray] = {}  # and the layer's hidden state there, which the next draft reads
        if running:
            fed = {key: sequences[key][self._seen[key] + 1:] for key in running}
            for key in running:
                if len(fed[key]) != len(hidden[key]):
                    raise ValueError(f"{len(fed[key])} new positions and {len(hidden[key])} hidden states")
            logits = self.batch.verify(fed, {HIDDEN_STATES: {key: hidden[key] for key in running}})
            states = self.batch.row_extras(MTP_HIDDEN)
            self.batch.keep({key: len(tokens) for key, tokens in fed.items()})
            last.update((key, rows[-1]) for key, rows in logits.items())
            own.update((key, rows[-1]) for key, rows in states.items())
        joining = [key for key in sequences if key not in self._seen]
        if joining:  # the prompt's positions: each reads the main model's state there and the token after it
            logits = self.batch.join({key: sequences[key][1:] for key in joining},
                                     {HIDDEN_STATES: {key: hidden[key] for key in joining}})
            states = self.batch.row_extras(MTP_HIDDEN)
            last.update(logits)
            own.update((key, states[key][-1]) for key in joining)
        for key, tokens in sequences.items():
            self._seen[key] = len(tokens) - 1
        drafts = {key: [int(row.argmax())] for key, row in last.items()}
        for _ in range(k - 1):
            logits = self.batch.verify({key: [drafted[-1]] for key, drafted in drafts.items()},
                                       {HIDDEN_STATES: {key: state[None] for key, state in own.items()}})
            states = self.batch.row_extras(MTP_HIDDEN)
            self.batch.keep(dict.fromkeys(drafts, 1))
            for key, rows in logits.items():
                drafts[key].append(int(rows[-1].argmax()))
                own[key] = states[key][-1]
        if k > 1:
            self.batch.forget(k - 1)
        return drafts


class BatchDraftModel(_OwnBatch):
    """A draft artifact's greedy drafts for a running batch (see the module doc). ``_seen``: per sequence, its tokens
    in the draft's cache before its chained drafts (``_chained``: the tokens those positions were fed)."""

    main_outputs: tuple[str, ...] = ()

    def __init__(self, batch: PersistentBatch | StatefulBatch, vocab: int | None) -> None:
        super().__init__(batch)  # over the draft artifact's graph
        # the main model's vocabulary: ids past it (a draft embedding padded wider) are never drafted
        self.vocab = vocab
        self._chained: dict[Hashable, list[int]] = {}

    def leave(self, keys: Iterable[Hashable]) -> None:
        keys = list(keys)
        super().leave(keys)
        for key in keys:
            self._chained.pop(key, None)

    def reset(self) -> None:
        super().reset()
        self._chained = {}

    def propose(self, sequences: dict[Hashable, list[int]], hidden: dict[Hashable, np.ndarray],
                k: int) -> dict[Hashable, list[int]]:
        del hidden
        if k < 1:
            return {}
        running = self._running(sequences)
        last: dict[Hashable, np.ndarray] = {}  # each sequence's logits of its first draft
        if running:
            fed, dropped = {}, {}
            for key in running:
                new, chained = sequences[key][self._seen[key]:], self._chained.pop(key, [])
                # the chained positions whose tokens the sequence now holds were computed as they are: kept
                taken = next((i for i, (a, b) in enumerate(zip(chained, new)) if a != b), min(len(chained), len(new)))
                taken = max(0, min(taken, len(new) - 1))  # the last new token is fed: its logits are the first draft's
                fed[key], dropped[key] = new[taken:], len(chained) - taken
            self.batch.forget(dropped)
            logits = self.batch.verify(fed)
            self.batch.keep({key: len(tokens) for key, tokens in fed.items()})
            last.update((key, rows[-1]) for key, rows in logits.items())
        joining = {key: tokens for key, tokens in sequences.items() if key not in self._seen}
        if joining:
            last.update(self.batch.join(joining))
        for key, tokens in sequences.items():
            self._seen[key] = len(tokens)
        drafts = {key: [self._greedy(row)] for key, row in last.items()}
        for _ in range(k - 1):
            logits = self.batch.verify({key: [drafted[-1]] for key, drafted in drafts.items()})
            self.batch.keep(dict.fromkeys(drafts, 1))
            for key, rows in logits.items():
                drafts[key].append(self._greedy(rows[-1]))
        self._chained = {key: drafted[:-1] for key, drafted in drafts.items()}
        return drafts

    def _greedy(self, row: np.ndarray) -> int:
        return int(row[:self.vocab].argmax())


def check_batch_speculation(settings: SpeculationSettings, artifact: Artifact, context: int | None = None) -> None:
    """InputError, before anything loads, where speculation in a running batch cannot work on ``artifact`` with
    sequences of up to ``context`` tokens (draft_artifact): dstc's
    runners verify drafts of prompt lookup, of the MTP layer or of a draft artifact (whose cache holds holes too);
    openvino_genai's pipeline (what serves a pageable OpenVINO artifact) does its own prompt lookup or draft-model
    speculation."""
    if settings.speculate is None:
        return
    # a sequence's rejected drafts become holes in the batch's cache (batch_holes.py), which a compressed cache
    # cannot hold; one sequence at a time (generate, eval) replays instead (toolchain/runtime/cache_replay.py)
    require_positional_cache(artifact.metadata, "speculative decoding in a running batch (its rejected drafts left "
                                                "as holes in the batch's cache)")
    if artifact.backend == "openvino" and pageable(artifact.path / MODEL_XML):
        if settings.speculate == MTP:
            raise InputError(f"{artifact.path}: served by openvino_genai's ContinuousBatchingPipeline, which drafts "
                             f"by {PROMPT_LOOKUP} or a draft model, not an MTP layer")
        draft = draft_artifact(settings, artifact, context)
        if draft is not None and not (draft.backend == "openvino" and pageable(draft.path / MODEL_XML)):
            raise InputError(f"{artifact.path}: served by openvino_genai's ContinuousBatchingPipeline, whose "
                             f"draft-model speculation pages the draft's KV cache as the main one's: the draft "
                             f"{draft.path} must be an OpenVINO artifact it can page too")
        return  # openvino_genai's own speculation
    draft_artifact(settings, artifact, context)  # an MTP layer, or a draft artifact of the same tokenizer: checked


def batch_drafter(settings: SpeculationSettings, artifact: Artifact, *, threads: int | None,
                  openvino_f32: bool = False) -> BatchDrafter | None:
    """The drafter ``settings`` ask for on a running batch of ``artifact``'s sequences (None: no speculation);
    InputError where check_batch_speculation says it cannot work."""
    if settings.speculate is None:
        return None
    check_batch_speculation(settings, artifact)
    if settings.speculate == PROMPT_LOOKUP:
        return BatchPromptLookup()
    draft = draft_artifact(settings, artifact)
    if draft is not None:  # opened as the main one is: its threads and numerics
        opened = open_decoder(draft, threads=threads, openvino_f32=openvino_f32)
        batch = StatefulBatch(opened, draft.pad_token_id) if opened.backend == "openvino" else \
            PersistentBatch(opened, draft.pad_token_id)
        batch.compact_each_step = not holds_holes(draft.metadata)
        return BatchDraftModel(batch, artifact.config.get("vocab_size"))
    drafter = open_mtp_drafter(artifact, threads=threads, openvino_f32=openvino_f32)
    decoder = drafter.decoder
    if isinstance(decoder, OnnxRuntimeDecoder):
        mtp: PersistentBatch = PersistentBatch(decoder, artifact.pad_token_id)
    else:
        assert isinstance(decoder, StatelessDecoder)  # an OpenVINO artifact's MTP IR (stateless)
        mtp = ArrayBatch(decoder.runner, decoder.past_specs, (MTP_HIDDEN,), decoder.chunking, artifact.pad_token_id)
    mtp.compact_each_step = not holds_holes(artifact.metadata)  # the MTP graph's cache is the main graph's kind
    return BatchMtp(mtp)
