"""Choosing the next token from one row of logits: greedy at temperature 0, else softmax sampling with temperature
and nucleus (top-p) truncation from a per-request random generator (so that a seed reproduces a request whatever
else shares its batch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # None: fresh entropy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def next_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator | None) -> int:
    """The next token id from float logits [vocab]."""
    if sampling.greedy:
        return int(np.argmax(logits))
    probs = _softmax(logits, sampling.temperature)
    if sampling.top_p < 1.0:
        keep = _nucleus(probs, sampling.top_p)
        kept = probs[keep] / probs[keep].sum()
        return int(keep[(rng or np.random.default_rng()).choice(len(keep), p=kept)])
    return int((rng or np.random.default_rng()).choice(len(probs), p=probs))


def distribution(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """The float64 probabilities [vocab] next_token draws from at temperature > 0 (zero outside the nucleus)."""
    probs = _softmax(logits, sampling.temperature)
    if sampling.top_p < 1.0:
        keep = _nucleus(probs, sampling.top_p)
        truncated = np.zeros_like(probs)
        truncated[keep] = probs[keep] / probs[keep].sum()
        return truncated
    return probs


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature
    scaled -= scaled.max()
    probs = np.exp(scaled)
    return probs / probs.sum()


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The tokens before the one whose cumulative probability reaches top_p, and that one, most probable first."""
    order = np.argsort(-probs, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]
