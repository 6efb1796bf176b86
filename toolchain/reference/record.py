"""What the reference says on the evaluation data, computed once and compared with any artifact later.

An artifact's accuracy needs, of the reference: each scored position's next-token distribution (its top-k tokens
and their log-probabilities: the whole distribution when the vocabulary is no larger than k), the log-probability
of the token that follows (perplexity), each MoE layer's expert choice per token, its greedy continuations and its
answers. These depend on the source checkpoint, the data and the settings only, so they are kept in the reference
cache (toolchain/reference/cache.py) and every later artifact of the same model is compared with them
without running the reference again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from toolchain.progress import LINES, due
from toolchain.reference.data import EvalData
from toolchain.runtime.generate import greedy_generate
from toolchain.settings.evaluation import EvalSettings


def first_scored(sequence) -> int:
    """The first position whose next-token distribution is scored (logits at t predict token t + 1)."""
    return max(sequence.score_from, 1) - 1


@dataclass
class ReferenceRecord:
    vocab: int
    top_k: int
    top_ids: list[np.ndarray] = field(default_factory=list)  # per sequence [positions, k] int32, best first
    top_logp: list[np.ndarray] = field(default_factory=list)  # per sequence [positions, k] float32
    target_logp: list[np.ndarray] = field(default_factory=list)  # per sequence [positions - 1] float64
    routes: dict[int, list[np.ndarray]] = field(default_factory=dict)  # MoE layer -> per sequence [tokens, k] sorted
    greedy: list[list[int]] = field(default_factory=list)  # continuation of each prefix
    answers: list[list[int]] = field(default_factory=list)  # answer of each problem
    seconds: float = 0.0  # what computing it took

    def save(self, path: Path) -> None:
        arrays: dict[str, np.ndarray] = {"meta": np.array([self.vocab, self.top_k], np.int64),
                                         "seconds": np.array(self.seconds)}
        for i, (ids, logp, target) in enumerate(zip(self.top_ids, self.top_logp, self.target_logp)):
            arrays[f"top_ids.{i}"], arrays[f"top_logp.{i}"], arrays[f"target_logp.{i}"] = ids, logp, target
        for layer, rows in self.routes.items():
            for i, r in enumerate(rows):
                arrays[f"routes.{layer}.{i}"] = r
        for name, lists in (("greedy", self.greedy), ("answers", self.answers)):
            arrays[f"{name}.lengths"] = np.array([len(t) for t in lists], np.int64)
            arrays[f"{name}.tokens"] = np.array([t for row in lists for t in row], np.int64)
        with open(path, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> ReferenceRecord:
        with np.load(path) as z:
            vocab, top_k = (int(v) for v in z["meta"])
            count = sum(1 for k in z.files if k.startswith("top_ids."))
            record = cls(vocab, top_k, [z[f"top_ids.{i}"] for i in range(count)],
                         [z[f"top_logp.{i}"] for i in range(count)], [z[f"target_logp.{i}"] for i in range(count)],
                         seconds=float(z["seconds"]))
            routes: dict[int, dict[int, np.ndarray]] = {}
            for key in (k for k in z.files if k.startswith("routes.")):
                _, layer, i = key.split(".")
                routes.setdefault(int(layer), {})[int(i)] = z[key]
            record.routes = {layer: [rows[i] for i in sorted(rows)] for layer, rows in routes.items()}
            for name in ("greedy", "answers"):
                lengths, tokens = z[f"{name}.lengths"], z[f"{name}.tokens"].tolist()
                ends = np.cumsum(lengths)
                setattr(record, name, [tokens[e - n:e] for n, e in zip(lengths.tolist(), ends.tolist())])
        return record


def generate(decoder, prompts: list[list[int]], batch: int, max_new_tokens: int, stop: set[int],
             pad: int, log: Callable[[str], None] = lambda _: None) -> list[list[int]]:
    """Greedy continuations of ``prompts``, ``batch`` at a time, with a progress line now and then."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        out += greedy_generate(decoder, prompts[start:start + batch], max_new_tokens, stop, pad).tokens
        if len(prompts) > batch and due(len(out), len(prompts), most=LINES * batch):
            log(f"  {len(out)}/{len(prompts)} done")
    return out


def answer_stops(data: EvalData, eos_ids: list[int], newline_id: int | None) -> set[int]:
    return {*eos_ids, newline_id} if data.answer_stops_at_newline and newline_id is not None else set(eos_ids)


GROUP_BYTES = 1 << 30  # fp32 hidden states of the sequences that go through the layers together


def _groups(sequences: list[list[int]], hidden: int) -> list[slice]:
    """Consecutive runs of sequences whose hidden states fit GROUP_BYTES: each run goes through every layer before
    the next starts, so the states held stay bounded however much data there is (each run builds the layers
    again when they are not kept built)."""
    groups, start, size = [], 0, 0
    for i, ids in enumerate(sequences):
        need = len(ids) * hidden * 4
        if i > start and size + need > GROUP_BYTES:
            groups.append(slice(start, i))
            start, size = i, 0
        size += need
    groups.append(slice(start, len(sequences)))
    return groups


def compute_record(reference, data: EvalData, settings: EvalSettings, *, eos_ids: list[int], pad_id: int,
                   newline_id: int | None, log: Callable[[str], None] = lambda _: None) -> ReferenceRecord:
    """Run ``reference`` (a LayeredReference) on ``data``: next-token distributions layer by layer over every
    sequence, then the greedy continuations and answers through its Decoder protocol."""
    started = time.perf_counter()
    vocab = int(reference.config.vocab_size)
    k = settings.top_k(vocab)
    sequences = [s.ids for s in data.sequences]
    firsts = [first_scored(s) for s in data.sequences]
    record = ReferenceRecord(vocab, k)
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in sequences]

    def reduce(s: int, start: int, logits: torch.Tensor) -> None:
        ids, first = sequences[s], firsts[s]
        lo = max(first - start, 0)
        if lo >= len(logits):
            return
        log_p = torch.log_softmax(logits[lo:].double(), dim=-1)
        values, indices = torch.topk(log_p, k, dim=-1)
        pos = np.arange(start + lo, start + len(logits))
        has_next = pos < len(ids) - 1
        targets = torch.from_numpy(np.asarray(ids, np.int64)[pos[has_next] + 1])
        target = log_p[torch.from_numpy(np.flatnonzero(has_next)), targets]
        parts[s].append((indices.numpy().astype(np.int32), values.float().numpy(), target.numpy()))

    if sequences:
        log(f"reference: next-token distributions of {len(sequences)} sequences "
            f"({sum(len(s) for s in sequences)} tokens), layer by layer")
        routes: dict[int, list[np.ndarray]] = {}
        for group in _groups(sequences, int(reference.config.hidden_size)):
            def reduce_group(s: int, start: int, logits: torch.Tensor, _offset: int = group.start) -> None:
                reduce(_offset + s, start, logits)

            for layer, rows in reference.score(sequences[group], reduce_group, log=log).items():
                routes.setdefault(layer, []).extend(rows)
        for rows in parts:
            record.top_ids.append(np.concatenate([r[0] for r in rows]))
            record.top_logp.append(np.concatenate([r[1] for r in rows]))
            record.target_logp.append(np.concatenate([r[2] for r in rows]))
        record.routes = {layer: [np.sort(r.reshape(-1, r.shape[-1]), -1).astype(np.int32) for r in rows]
                         for layer, rows in routes.items()}
    # A reference that is read from the checkpoint at every step generates every prompt in one batch.
    batch = settings.batch if getattr(reference, "resident", True) else max(1, len(data.prefixes), len(data.problems))
    if data.prefixes:
        log(f"reference: greedy continuations of {len(data.prefixes)} prefixes, {settings.greedy_tokens} tokens")
        record.greedy = generate(reference, data.prefixes, batch, settings.greedy_tokens, set(eos_ids), pad_id,
                                 log=log)
    if data.problems:
        log(f"reference: answers to {len(data.problems)} problems")
        record.answers = generate(reference, [p for p, _ in data.problems], batch, data.answer_tokens,
                                  answer_stops(data, eos_ids, newline_id), pad_id, log=log)
    record.seconds = time.perf_counter() - started
    return record
