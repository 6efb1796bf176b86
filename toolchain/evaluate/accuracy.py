"""Accuracy of an artifact against the fp32 PyTorch reference of its source model, on held-out data.

Both sides are Decoders (toolchain/runtime/decoder.py, toolchain/evaluate/reference.py) and decode with the same
greedy loop and stop rules (toolchain/runtime/generate.py), so a difference is the artifact's, not the harness's.
The data is the embedded models' held-out split (toolchain/models/corpus.py): English text for perplexity and
next-token distributions, and the arithmetic task for exact match, which only the embedded models were
trained on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from toolchain.evaluate.settings import EvalSettings
from toolchain.models import corpus
from toolchain.models.train import END_OF_LINE
from toolchain.report.schema import Metric
from toolchain.runtime.generate import greedy_generate


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    return logits - np.logaddexp.reduce(logits, -1, keepdims=True)


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _generate(decoder, prompts: list[list[int]], settings: EvalSettings, max_new_tokens: int, stop: set[int],
              pad: int) -> list[list[int]]:
    out: list[list[int]] = []
    for chunk in _batches(prompts, settings.batch):
        out += greedy_generate(decoder, chunk, max_new_tokens, stop, pad).tokens
    return out


def measure_accuracy(decoder, reference, routers: dict[int, str], tokenizer, *, eos_ids: list[int], pad_id: int,
                     task: bool, settings: EvalSettings,
                     log: Callable[[str], None] = lambda _: None) -> tuple[dict[str, Metric], dict]:
    """Metrics, and the series for the report's plots (KL per position, routing agreement per MoE layer).

    ``routers``: MoE layer -> the artifact's router output name (toolchain/runtime/routing.py); the reference
    reports its own layers through ``reference.router_outputs()``.
    """
    texts = [tokenizer(t)["input_ids"] for t in corpus.text_samples("heldout", settings.texts, settings.seed)]
    log(f"next-token distributions on {len(texts)} held-out texts")
    nll, ref_nll, kl_rows, top1 = [], [], [], []
    same_route: dict[int, list[np.ndarray]] = {layer: [] for layer in routers}
    ref_routers = reference.router_outputs()
    for ids in texts:
        row = np.asarray([ids], np.int64)
        mask = np.ones_like(row)
        reference.reset()
        log_p = _log_softmax(reference.forward(row, mask)[0])
        ref_routes = {layer: reference.extras[name] for layer, name in ref_routers.items()}
        decoder.reset()
        log_q = _log_softmax(decoder.forward(row, mask)[0])
        targets = np.asarray(ids[1:])
        nll.append(-log_q[np.arange(len(ids) - 1), targets])
        ref_nll.append(-log_p[np.arange(len(ids) - 1), targets])
        kl_rows.append((np.exp(log_p) * (log_p - log_q)).sum(-1))
        top1.append(log_p.argmax(-1) == log_q.argmax(-1))
        for layer, name in routers.items():
            mine = np.sort(decoder.extras[name].reshape(-1, decoder.extras[name].shape[-1]), -1)
            theirs = np.sort(ref_routes[layer].reshape(-1, ref_routes[layer].shape[-1]), -1)
            same_route[layer].append((mine == theirs).all(-1))

    kl = np.concatenate(kl_rows)
    width = max(len(r) for r in kl_rows)
    kl_per_position = [float(np.mean([r[i] for r in kl_rows if len(r) > i])) for i in range(width)]
    ppl, ref_ppl = float(np.exp(np.concatenate(nll).mean())), float(np.exp(np.concatenate(ref_nll).mean()))
    routing = {str(layer): float(np.concatenate(rows).mean()) for layer, rows in same_route.items()}

    stop_eos = set(eos_ids)
    log(f"greedy continuations of {settings.greedy_prompts} held-out text prefixes, {settings.greedy_tokens} tokens")
    prefixes = [ids[:max(2, len(ids) // 2)] for ids in texts[:settings.greedy_prompts]]
    my_tokens = _generate(decoder, prefixes, settings, settings.greedy_tokens, stop_eos, pad_id)
    their_tokens = _generate(reference, prefixes, settings, settings.greedy_tokens, stop_eos, pad_id)
    greedy_match = float(np.mean([a == b for a, b in zip(my_tokens, their_tokens)]))

    metrics = {
        "perplexity": Metric(value=ppl, unit="", direction="lower", reference=ref_ppl,
                             description=f"held-out text perplexity ({sum(len(r) for r in nll)} tokens)"),
        "perplexity_increase": Metric(value=ppl / ref_ppl - 1, unit="ratio", direction="lower",
                                      description="relative perplexity increase over the fp32 reference"),
        "kl_mean": Metric(value=float(kl.mean()), unit="nats", direction="lower",
                          description="mean KL(reference || artifact) of next-token distributions"),
        "kl_max": Metric(value=float(kl.max()), unit="nats", direction="lower",
                         description="largest KL(reference || artifact) at any position"),
        "top1_agreement": Metric(value=float(np.concatenate(top1).mean()), unit="ratio", direction="higher",
                                 description="share of positions where the artifact's top token is the reference's"),
        "greedy_match_rate": Metric(value=greedy_match, unit="ratio", direction="higher",
                                    description=f"share of {len(prefixes)} greedy continuations "
                                                f"({settings.greedy_tokens} tokens) identical to the reference's"),
        "routing_agreement": Metric(value=min(routing.values()) if routing else None, unit="ratio",
                                    direction="higher",
                                    description="MoE layers' share of tokens routed to the same expert set as the "
                                                "reference (lowest layer)" if routing else
                                                "not applicable: no mixture-of-experts layers"),
    }
    if task:
        metrics.update(_exact_match(decoder, reference, tokenizer, eos_ids, pad_id, settings, log))
    else:
        for name in ("exact_match", "exact_match_drop"):
            metrics[name] = Metric(value=None, unit="ratio" if name == "exact_match" else "points",
                                   direction="higher" if name == "exact_match" else "lower",
                                   description="not applicable: the model was not trained on the embedded task")
    return metrics, {"kl_per_position": kl_per_position, "routing_agreement_per_layer": routing}


def _exact_match(decoder, reference, tokenizer, eos_ids, pad_id, settings, log) -> dict[str, Metric]:
    problems = corpus.task_examples("heldout", settings.problems, settings.seed)
    log(f"exact match on {len(problems)} held-out arithmetic problems")
    newline = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(END_OF_LINE))[0]
    stop = {*eos_ids, newline}
    prompts = [tokenizer(p)["input_ids"] for p, _ in problems]

    def score(side) -> float:
        answers = _generate(side, prompts, settings, 8, stop, pad_id)
        return float(np.mean([tokenizer.decode(a).strip() == want for a, (_, want) in zip(answers, problems)]))

    em, ref_em = score(decoder), score(reference)
    return {
        "exact_match": Metric(value=em, unit="ratio", direction="higher", reference=ref_em,
                              description=f"held-out arithmetic problems answered exactly ({len(problems)})"),
        "exact_match_drop": Metric(value=100 * (ref_em - em), unit="points", direction="lower",
                                   description="exact-match points lost against the fp32 reference"),
    }
