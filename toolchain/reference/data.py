"""The token data the reference and an artifact are both run on (toolchain/evaluate/dataset.py reads it from the
embedded corpus or a user's file): what the reference's record is computed on and what its cache key hashes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


@dataclass
class Sequence:
    ids: list[int]
    score_from: int = 1  # the first token whose prediction is scored (the ones before are context)


@dataclass
class EvalData:
    sequences: list[Sequence]  # next-token distributions, perplexity, routing
    prefixes: list[list[int]]  # prompts of greedy continuations
    problems: list[tuple[list[int], str]]  # prompt tokens and the exact answer
    answer_tokens: int  # greedy tokens generated for an answer
    answer_stops_at_newline: bool
    description: dict = field(default_factory=dict)  # what report.json records of the data

    @property
    def digest(self) -> str:
        """What the reference's outputs depend on, of the data (its tokens, not how they were read)."""
        h = hashlib.sha256()
        for part in ([[*s.ids, -1, s.score_from] for s in self.sequences], self.prefixes,
                     [[*p, -1] for p, _ in self.problems], [a for _, a in self.problems],
                     [self.answer_tokens, self.answer_stops_at_newline]):
            h.update(json.dumps(part, separators=(",", ":")).encode())
        return h.hexdigest()
