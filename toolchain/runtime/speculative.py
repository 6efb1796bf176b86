"""Lossless speculative decoding of one sequence (batch 1): a drafter proposes k tokens, one forward of the main
model scores them all, the accepted prefix is kept and the cache rolled back over the rest.

* Greedy: a draft token is accepted while it is the main model's argmax at its position; the first position that
  disagrees gives the main model's own token, so the output is the plain greedy decoding's, token for token (up to
  the floating-point difference between scoring k positions in one forward and one at a time).
* Sampling (temperature > 0): standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft x with
  probability q(x) is accepted with probability min(1, p(x) / q(x)), a rejection draws from the residual
  max(0, p - q) renormalised, and when every draft is accepted one more token is drawn from p; the output follows
  p, the main model's distribution (toolchain/runtime/sampling.py's temperature and top-p). A drafter that drafts
  deterministically (prompt lookup) has q one-hot at its token.

Drafters: :class:`PromptLookup` (n-gram match in the sequence so far, as transformers' prompt_lookup_num_tokens
and vLLM's ngram speculator), :class:`DraftModel` (a smaller artifact of the same tokenizer on a Decoder of its
own) and DeepSeek-V3's, V3.2's or V4's MTP layer (toolchain/runtime/mtp_drafter.py), which reads the main model's
hidden state from ``extras``: the main decoder is opened with the outputs ``Speculation.main_outputs`` names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from toolchain.errors import InputError
from toolchain.interface.files import MTP_DIR
from toolchain.interface.graph import HIDDEN_STATES
from toolchain.runtime.artifact import Artifact, open_artifact
from toolchain.runtime.decoder import RewindableDecoder, open_decoder
from toolchain.runtime.mtp_drafter import open_mtp_drafter
from toolchain.runtime.sampling import Sampling, distribution, next_token
from toolchain.settings.speculation import MTP, SpeculationSettings


class Drafter(Protocol):
    # The distribution each token of the last propose was drawn from ([vocab] each); None: drafted
    # deterministically (one-hot at the token), which speculative sampling takes as it is.
    draft_probs: list[np.ndarray] | None

    def reset(self) -> None:
        """A new sequence."""

    def propose(self, tokens: list[int], extras: dict[str, np.ndarray], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (the whole accepted sequence so far). ``extras``: the main
        decoder's extra outputs (Decoder.extras, [batch, positions, ...]) at the positions the last forward
        accepted: the prompt's at the first call, then those of the last verify step's fed token and accepted
        drafts."""

    def rollback(self, keep: int) -> None:
        """The drafter's own cache, if any, keeps at most its first ``keep`` positions: ``tokens[:keep]`` are
        accepted, what it cached beyond them may not be."""


@dataclass
class Acceptance:
    """Per draft position (0: the first draft token of a step): how many verify steps proposed a token there and
    how many of those were accepted."""

    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0  # verify steps (forwards of the main model after the prefill), drafts or none

    def add(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        grow = max(0, proposed - len(self.proposed))
        self.proposed += [0] * grow
        self.accepted += [0] * grow
        for position in range(proposed):
            self.proposed[position] += 1
            self.accepted[position] += position < accepted

    @property
    def rates(self) -> list[float]:
        return [a / p for a, p in zip(self.accepted, self.proposed)]

    @property
    def rate(self) -> float | None:
        """Accepted draft tokens over proposed ones, all positions together."""
        return sum(self.accepted) / sum(self.proposed) if sum(self.proposed) else None

    def summary(self) -> dict:
        return {"verify_steps": self.steps, "proposed_per_position": self.proposed,
                "accepted_per_position": self.accepted,
                "acceptance_per_position": [round(r, 6) for r in self.rates],
                "acceptance": None if self.rate is None else round(self.rate, 6)}


def verify_greedy(drafts: list[int], logits: np.ndarray) -> tuple[int, int]:
    """(accepted drafts, the next token) from the main model's logits [len(drafts) + 1, vocab] at the fed token
    and each draft: drafts are accepted while each is the argmax before it."""
    chosen = logits.argmax(-1)
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, int(chosen[accepted])


def verify_sampled(drafts: list[int], draft_probs: list[np.ndarray] | None, target_probs: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """(accepted drafts, the next token) by speculative sampling: ``draft_probs`` the distribution each draft was
    drawn from (None: one-hot), ``target_probs`` [len(drafts) + 1, vocab] the main model's at the fed token and
    each draft. The tokens returned (the accepted drafts, then the next) follow ``target_probs``'s chain."""
    vocab = target_probs.shape[-1]
    for position, token in enumerate(drafts):
        p = target_probs[position]
        q = _aligned(draft_probs[position], vocab) if draft_probs is not None else _one_hot(token, vocab)
        if token < vocab and rng.random() * q[token] < p[token]:  # accepted with probability min(1, p / q)
            continue
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0:  # p <= q everywhere only by rounding (p = q): the residual is p itself
            residual = p
        return position, int(rng.choice(len(residual), p=residual / residual.sum()))
    last = target_probs[len(drafts)]
    return len(drafts), int(rng.choice(len(last), p=last))


def _one_hot(token: int, size: int) -> np.ndarray:
    hot = np.zeros(size)
    if token < size:
        hot[token] = 1.0
    return hot


def _aligned(probs: np.ndarray, size: int) -> np.ndarray:
    """A draft model's distribution over the main model's vocabulary: a tokenizer's models may pad their embedding
    to different sizes (ids past the tokenizer's, never drawn by a trained model)."""
    if len(probs) >= size:
        return probs[:size]
    return np.concatenate([probs, np.zeros(size - len(probs))])


def speculative_steps(decoder: RewindableDecoder, drafter: Drafter, prompt: list[int], *, max_new_tokens: int,
                      stop_ids: set[int], draft_tokens: int, acceptance: Acceptance,
                      sampling: Sampling | None = None, rng: np.random.Generator | None = None
                      ) -> Iterator[list[int]]:
    """The new tokens of each forward of the main model as soon as it is verified (the prefill's one, then each
    verify step's accepted drafts and next token), until a stop id (not yielded) or ``max_new_tokens`` in all, as
    greedy_generate ends. ``acceptance`` counts the drafts. ``sampling`` None or at temperature 0: greedy; else
    ``rng`` draws."""
    if not prompt:
        raise InputError("every prompt needs at least one token")
    if draft_tokens < 1:
        raise InputError(f"draft_tokens must be at least 1, not {draft_tokens}")
    sampling = sampling or Sampling()
    rng = rng if rng is not None else sampling.generator()
    decoder.reset()
    drafter.reset()
    sequence = list(prompt)
    logits = decoder.forward(np.array([sequence], np.int64), np.ones((1, len(sequence)), np.int64), 1)
    extras = decoder.extras
    new = [next_token(logits[0, -1], sampling, rng)]  # the tokens the last forward decided
    while True:
        for index, token in enumerate(new):
            if token in stop_ids:
                if index:
                    yield new[:index]
                return
        sequence += new
        yield new
        produced = len(sequence) - len(prompt)
        if produced >= max_new_tokens:
            return
        # at most as many drafts as the budget has room for beside the next token: the cache never holds more
        # positions than plain decoding's
        k = min(draft_tokens, max_new_tokens - produced - 1)
        drafts = [int(t) for t in drafter.propose(sequence, extras, k)[:k]] if k else []
        cached = len(sequence) - 1  # the last token is not in the cache yet: fed now, with the drafts
        fed = [sequence[-1], *drafts]
        logits = decoder.forward(np.array([fed], np.int64), np.ones((1, cached + len(fed)), np.int64), 0)[0]
        if sampling.greedy:
            accepted, following = verify_greedy(drafts, logits)
        else:
            target = np.stack([distribution(row, sampling) for row in logits])
            accepted, following = verify_sampled(drafts, drafter.draft_probs, target, rng)
        acceptance.add(len(drafts), accepted)
        keep = cached + 1 + accepted
        if accepted < len(drafts):
            decoder.rollback(keep)
        drafter.rollback(keep)
        extras = {name: value[:, :1 + accepted] for name, value in decoder.extras.items()}
        new = [*drafts[:accepted], following]


class PromptLookup:
    """Drafts by n-gram match in the sequence so far, as transformers' prompt lookup decoding: the sequence's last
    n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked for earlier in it, and the tokens that followed
    their first occurrence are the draft. Nothing to cache, nothing to roll back."""

    draft_probs: list[np.ndarray] | None = None  # drafts deterministically

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, not {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def reset(self) -> None:
        pass

    def propose(self, tokens: list[int], extras: dict[str, np.ndarray], k: int) -> list[int]:
        del extras
        sequence = np.asarray(tokens, np.int64)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)  # every n-gram but the last
            starts = np.flatnonzero((windows == sequence[-n:]).all(axis=1))
            if len(starts):
                first = int(starts[0]) + n
                return sequence[first:first + k].tolist()
        return []

    def rollback(self, keep: int) -> None:
        pass


class DraftModel:
    """Drafts with a second, smaller model of the same tokenizer on a Decoder of its own (an artifact's, opened as
    the main one is): greedy, or sampled with the main model's sampling settings, recording the distributions for
    speculative sampling. Its cache follows the accepted sequence: rolled back past a rejected draft, it is fed
    only the tokens it has not seen at the next propose."""

    def __init__(self, decoder: RewindableDecoder, sampling: Sampling | None = None,
                 rng: np.random.Generator | None = None) -> None:
        self.decoder = decoder
        self.sampling = sampling or Sampling()
        # its own stream: one shared with the acceptance draws, or seeded alike, would correlate them
        self.rng = rng if rng is not None else np.random.default_rng()
        self.draft_probs: list[np.ndarray] | None = None
        self.cached = 0  # positions in the draft decoder's cache

    def reset(self) -> None:
        self.decoder.reset()
        self.cached = 0

    def propose(self, tokens: list[int], extras: dict[str, np.ndarray], k: int) -> list[int]:
        del extras
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        fed = tokens[self.cached:]
        while len(drafts) < k:
            self.cached += len(fed)
            row = self.decoder.forward(np.array([fed], np.int64), np.ones((1, self.cached), np.int64), 1)[0, -1]
            if self.sampling.greedy:
                token = int(row.argmax())
            else:
                p = distribution(row, self.sampling)
                token = int(self.rng.choice(len(p), p=p))
                probs.append(p)
            drafts.append(token)
            fed = [token]
        self.draft_probs = None if self.sampling.greedy else probs
        return drafts

    def rollback(self, keep: int) -> None:
        if self.cached > keep:
            self.decoder.rollback(keep)
            self.cached = keep


@dataclass
class Speculation:
    """A drafter and its draft length for a runner's sequences, and the acceptance counted over all of them."""

    method: str  # SpeculationSettings.speculate
    drafter: Drafter
    draft_tokens: int
    main_outputs: tuple[str, ...] = ()  # extra outputs the drafter reads of the main decoder (open it with them)
    acceptance: Acceptance = field(default_factory=Acceptance)

    def steps(self, decoder: RewindableDecoder, prompt: list[int], *, max_new_tokens: int, stop_ids: set[int],
              sampling: Sampling | None = None, rng: np.random.Generator | None = None) -> Iterator[list[int]]:
        """speculative_steps with this drafter, counting acceptance."""
        return speculative_steps(decoder, self.drafter, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                 draft_tokens=self.draft_tokens, acceptance=self.acceptance, sampling=sampling,
                                 rng=rng)

    def summary(self) -> dict:
        return {"method": self.method, "draft_tokens": self.draft_tokens, **self.acceptance.summary()}


def draft_artifact(settings: SpeculationSettings, artifact: Artifact, context: int | None = None) -> Artifact | None:
    """The draft model's artifact that ``settings`` name, if any, checked (InputError) to be one, to have
    ``artifact``'s tokenizer and a context of at least ``context`` tokens (the longest sequence it will draft
    after), or for MTP drafts that the artifact has its MTP layer: what a command checks before it does any work."""
    if settings.speculate == MTP and not (artifact.path / MTP_DIR).is_dir():
        raise InputError(f"{artifact.path} has no MTP layer ({MTP_DIR}/) to draft with: build it with export.mtp")
    if settings.draft_artifact is None:
        return None
    draft = open_artifact(Path(settings.draft_artifact))
    if draft.tokenizer().get_vocab() != artifact.tokenizer().get_vocab():
        raise InputError(f"the draft model {draft.path} has another tokenizer than {artifact.path}: speculative "
                         "decoding needs the same token ids")
    if context is not None and draft.context_length is not None and draft.context_length < context:
        # past its context a model does not fail, it drafts garbage: every draft rejected, each step a loss
        raise InputError(f"the draft model {draft.path} has a context of {draft.context_length} tokens, and "
                         f"sequences here reach {context}: use a shorter context (serve --max-context, generate "
                         "--new-tokens) or another draft")
    return draft


def open_speculation(settings: SpeculationSettings, artifact: Artifact, *, threads: int | None = None,
                     openvino_f32: bool = False, sampling: Sampling | None = None,
                     context: int | None = None) -> Speculation | None:
    """The speculation ``settings`` ask for on ``artifact``'s sequences (None when they ask for none): a draft
    artifact is opened as the main one is (same threads and numerics) and must have its tokenizer; InputError
    otherwise."""
    if settings.speculate is None:
        return None
    if settings.speculate == MTP:
        return Speculation(MTP, open_mtp_drafter(artifact, threads=threads, openvino_f32=openvino_f32),
                           settings.draft_tokens, main_outputs=(HIDDEN_STATES,))
    drafter: Drafter = PromptLookup()
    draft = draft_artifact(settings, artifact, context)
    if draft is not None:
        decoder = open_decoder(draft, threads=threads, openvino_f32=openvino_f32)
        seed = None if sampling is None or sampling.seed is None else [sampling.seed, 1]  # apart from the main's
        drafter = DraftModel(decoder, sampling, np.random.default_rng(seed))
    return Speculation(settings.speculate, drafter, settings.draft_tokens)
