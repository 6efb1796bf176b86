"""Accuracy of an artifact against its reference's record (toolchain/reference/record.py) on the same data.

The artifact runs each sequence whole, as a prompt is run in deployment, and its next-token distributions are
compared with the reference's at the same positions: KL(reference || artifact) over the reference's top-k tokens
and the rest of the vocabulary as one outcome (exact when the vocabulary is no larger than k), top-1 agreement,
perplexity of the scored tokens, and each MoE layer's expert choice. Greedy continuations and answers come from the
one greedy loop both sides use (toolchain/runtime/generate.py), so a difference is the artifact's, not the harness's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from toolchain.evaluate.dataset import EvalData
from toolchain.progress import due
from toolchain.reference.record import ReferenceRecord, answer_stops, first_scored, generate
from toolchain.report.schema import Metric
from toolchain.settings.evaluation import EvalSettings

ROWS = 256  # positions whose log-softmax is computed at a time (a real vocabulary is 150k wide)
PREFILL_CHUNK = 512


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    # torch's, in float64: numpy's logaddexp.reduce gives the same values (to 3e-13) 6.6x slower, which was most
    # of an eval's artifact side at a 152k vocabulary
    return torch.log_softmax(torch.from_numpy(np.ascontiguousarray(logits)).double(), -1).numpy()


def compare_distributions(logits: np.ndarray, start: int, ids: list[int], first: int, top_ids: np.ndarray,
                          top_logp: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the scored positions (from ``first``) among those whose ``logits`` start at position ``start``: KL(reference
    || artifact), whether the top tokens agree, and the artifact's negative log-likelihood of the next token (none
    at the sequence's last position)."""
    kl, top1, nll = [], [], []
    end = start + len(logits)
    for a in range(max(first, start), end, ROWS):
        b = min(end, a + ROWS)
        log_q = _log_softmax(logits[a - start:b - start])
        ref_ids, ref_logp = top_ids[a - first:b - first], top_logp[a - first:b - first].astype(np.float64)
        p, log_q_top = np.exp(ref_logp), np.take_along_axis(log_q, ref_ids.astype(np.int64), -1)
        row_kl = (p * (ref_logp - log_q_top)).sum(-1)
        if ref_ids.shape[1] < vocab:  # the tokens outside the reference's top-k, as one outcome
            rest_p = np.clip(1 - p.sum(-1), 0, 1)
            rest_q = np.clip(1 - np.exp(log_q_top).sum(-1), np.finfo(np.float64).tiny, 1)
            row_kl += np.where(rest_p > 0, rest_p * (np.log(np.maximum(rest_p, 1e-300)) - np.log(rest_q)), 0.0)
        kl.append(np.maximum(row_kl, 0.0))  # a KL below 0 is the stored log-probabilities' float32 rounding
        top1.append(log_q.argmax(-1) == ref_ids[:, 0])
        pos = np.arange(a, b)
        has_next = pos < len(ids) - 1
        nll.append(-log_q[np.flatnonzero(has_next), np.asarray(ids)[pos[has_next] + 1]])
    if not kl:
        return np.zeros(0), np.zeros(0, bool), np.zeros(0)
    return np.concatenate(kl), np.concatenate(top1), np.concatenate(nll)


def answer_given(continuation: str, want: str) -> str:
    """The answer a greedy continuation gives: for a one-line answer its first line, as lm-eval's ``until: ["\\n"]``
    stops it (a continuation runs on past the answer, e.g. ``9750\\n000+100=``, where no stop token ends the line);
    a longer answer is compared whole."""
    text = continuation.strip()
    return text.split("\n", 1)[0].strip() if "\n" not in want.strip() else text


def measure_accuracy(decoder, record: ReferenceRecord, data: EvalData, routers: dict[int, str], tokenizer, *,
                     eos_ids: list[int], pad_id: int, newline_id: int | None, settings: EvalSettings,
                     log: Callable[[str], None] = lambda _: None) -> tuple[dict[str, Metric], dict]:
    """Metrics, and the series for the report's plots (KL per position, routing agreement per MoE layer).

    ``routers``: MoE layer -> the artifact's router output name (toolchain/runtime/routing.py)."""
    what = data.description.get("dataset", "data")
    nll, ref_nll, kl_rows, top1 = [], [], [], []
    same_route: dict[int, list[np.ndarray]] = {layer: [] for layer in routers}
    if data.sequences:
        log(f"next-token distributions on {len(data.sequences)} sequences of {what}")
    for s, sequence in enumerate(data.sequences):
        first = first_scored(sequence)
        decoder.reset()
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        routes: dict[int, list[np.ndarray]] = {layer: [] for layer in routers}
        # a long window is run PREFILL_CHUNK tokens at a time through the cache, as a server prefills it: its
        # logits are [chunk, vocab], not [window, vocab] (1.2 GB at 2048 tokens of a 152k vocabulary)
        for a in range(0, len(sequence.ids), PREFILL_CHUNK):
            b = min(len(sequence.ids), a + PREFILL_CHUNK)
            logits = decoder.forward(np.asarray([sequence.ids[a:b]], np.int64), np.ones((1, b), np.int64))[0]
            parts.append(compare_distributions(logits, a, sequence.ids, first, record.top_ids[s],
                                               record.top_logp[s], record.vocab))
            for layer, name in routers.items():
                routes[layer].append(decoder.extras[name].reshape(-1, decoder.extras[name].shape[-1]))
            del logits
        kl_rows.append((first, np.concatenate([p[0] for p in parts])))
        top1.append(np.concatenate([p[1] for p in parts]))
        nll.append(np.concatenate([p[2] for p in parts]))
        ref_nll.append(-record.target_logp[s])
        for layer in routers:
            same_route[layer].append((np.sort(np.concatenate(routes[layer]), -1) == record.routes[layer][s]).all(-1))
        if len(data.sequences) > 1 and due(s + 1, len(data.sequences)):
            so_far = np.concatenate([r for _, r in kl_rows])
            log(f"  {s + 1}/{len(data.sequences)} sequences" + (f", mean KL so far {so_far.mean():.3g}"
                                                                 if so_far.size else ""))

    metrics: dict[str, Metric] = {}
    series: dict = {"kl_per_position": [], "routing_agreement_per_layer": {}}
    if data.sequences:
        kl = np.concatenate([r for _, r in kl_rows])
        width = max(first + len(r) for first, r in kl_rows)
        sums, counts = np.zeros(width), np.zeros(width)
        for first, r in kl_rows:
            sums[first:first + len(r)] += r
            counts[first:first + len(r)] += 1
        series["kl_per_position"] = [float(v) for v in sums[counts > 0] / counts[counts > 0]]
        tokens = sum(len(r) for r in nll)
        ppl, ref_ppl = float(np.exp(np.concatenate(nll).mean())), float(np.exp(np.concatenate(ref_nll).mean()))
        routing = {str(layer): float(np.concatenate(rows).mean()) for layer, rows in same_route.items()}
        series["routing_agreement_per_layer"] = routing
        exact = record.top_k >= record.vocab
        metrics.update({
            "perplexity": Metric(value=ppl, unit="", direction="lower", reference=ref_ppl,
                                 description=f"perplexity of {what} ({tokens} tokens)"),
            "perplexity_increase": Metric(value=ppl / ref_ppl - 1, unit="ratio", direction="lower",
                                          description="relative perplexity increase over the fp32 reference"),
            "kl_mean": Metric(value=float(kl.mean()), unit="nats", direction="lower",
                              description="mean KL(reference || artifact) of next-token distributions"
                                          + ("" if exact else f" (the reference's top {record.top_k} tokens and "
                                                              "the rest as one)")),
            "kl_max": Metric(value=float(kl.max()), unit="nats", direction="lower",
                             description="largest KL(reference || artifact) at any position"),
            "top1_agreement": Metric(value=float(np.concatenate(top1).mean()), unit="ratio", direction="higher",
                                     description="share of positions where the artifact's top token is the "
                                                 "reference's"),
            "routing_agreement": Metric(value=min(routing.values()) if routing else None, unit="ratio",
                                        direction="higher",
                                        description="MoE layers' share of tokens routed to the same expert set as "
                                                    "the reference (lowest layer)" if routing else
                                                    "not applicable: no mixture-of-experts layers"),
        })

    if data.prefixes:
        log(f"greedy continuations of {len(data.prefixes)} prefixes, {settings.greedy_tokens} tokens")
        continuations = generate(decoder, data.prefixes, settings.batch, settings.greedy_tokens, set(eos_ids), pad_id,
                                 log=log)
        metrics["greedy_match_rate"] = Metric(
            value=float(np.mean([a == b for a, b in zip(continuations, record.greedy)])), unit="ratio",
            direction="higher",
            description=f"share of {len(data.prefixes)} greedy continuations ({settings.greedy_tokens} tokens) "
                        "identical to the reference's")
    if data.problems:
        log(f"exact match on {len(data.problems)} problems")
        outputs = generate(decoder, [p for p, _ in data.problems], settings.batch, data.answer_tokens,
                           answer_stops(data, eos_ids, newline_id), pad_id, log=log)

        def score(outputs: list[list[int]]) -> float:
            return float(np.mean([answer_given(tokenizer.decode(a, skip_special_tokens=True), want) == want.strip()
                                  for a, (_, want) in zip(outputs, data.problems)]))

        em, ref_em = score(outputs), score(record.answers)
        metrics["exact_match"] = Metric(value=em, unit="ratio", direction="higher", reference=ref_em,
                                        description=f"problems of {what} answered exactly ({len(data.problems)})")
        metrics["exact_match_drop"] = Metric(value=100 * (ref_em - em), unit="points", direction="lower",
                                             description="exact-match points lost against the fp32 reference")
    else:
        for name in ("exact_match", "exact_match_drop"):
            metrics[name] = Metric(value=None, unit="ratio" if name == "exact_match" else "points",
                                   direction="higher" if name == "exact_match" else "lower",
                                   description="not applicable: no problems with answers in the data (the "
                                               "embedded task is measured on the embedded models only)")
    return metrics, series
