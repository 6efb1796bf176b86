"""Deterministic training of the embedded models, and backend-independent evaluation helpers.

``exact_match`` and ``perplexity`` take callables and work in numpy, so the same measurement applies to the
PyTorch model here and to an exported or quantized model later; ``torch_generate_fn`` and ``torch_logits_fn``
adapt a PyTorch causal LM to them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from toolchain.models import corpus

if TYPE_CHECKING:
    from toolchain.export.weights import HFModule

# A line of the corpus ends with a newline; the answer of a problem is what greedy decoding writes before it.
END_OF_LINE = "\n"

GenerateFn = Callable[[list[str]], list[str]]
LogitsFn = Callable[[list[int]], np.ndarray]


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int = 32
    seq_len: int = 64
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.0
    n_problems: int = 100_000
    n_texts: int = 15_000
    seed: int = 0
    # One thread: on a shared machine two threads stall on each other's barriers, and the count is part of what
    # makes the result bitwise reproducible.
    threads: int = 1


def exact_match(generate_fn: GenerateFn, examples: Sequence[tuple[str, str]]) -> float:
    """Fraction of (prompt, answer) pairs for which ``generate_fn`` (prompts -> completions) gives the answer."""
    completions = generate_fn([prompt for prompt, _ in examples])
    hits = sum(c.split(END_OF_LINE)[0].strip() == answer for c, (_, answer) in zip(completions, examples))
    return hits / len(examples)


def perplexity(logits_fn: LogitsFn, sequences: Sequence[Sequence[int]]) -> float:
    """exp of the mean next-token negative log-likelihood over all tokens after the first of each sequence.

    ``logits_fn`` maps a token id list to its logits, shape (len(ids), vocab).
    """
    total, count = 0.0, 0
    for ids in sequences:
        logits = np.asarray(logits_fn(list(ids)), dtype=np.float64)[:-1]
        logits = logits - logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        total -= log_probs[np.arange(len(ids) - 1), np.asarray(ids[1:])].sum()
        count += len(ids) - 1
    return math.exp(total / count)


def torch_generate_fn(model: HFModule, tokenizer, max_new_tokens: int = 8) -> GenerateFn:
    """Greedy decoding that stops at the end of the line or EOS, batched over prompts of equal token length."""
    stop_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(tokenizer.tokenize(END_OF_LINE))[0]}

    @torch.no_grad()
    def generate(prompts: list[str]) -> list[str]:
        encoded = [tokenizer(p)["input_ids"] for p in prompts]
        out: list[str] = [""] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        for indices in by_length.values():
            ids = torch.tensor([encoded[i] for i in indices])
            new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=sorted(stop_ids),
                                 pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
            for i, row in zip(indices, new.tolist()):
                kept = []
                for t in row:
                    if t in stop_ids:
                        break
                    kept.append(t)
                out[i] = tokenizer.decode(kept)
        return out

    return generate


def torch_logits_fn(model: torch.nn.Module) -> LogitsFn:
    @torch.no_grad()
    def logits(ids: list[int]) -> np.ndarray:
        return model(torch.tensor([ids])).logits[0].float().numpy()

    return logits


def encode_lines(tokenizer, lines: list[str]) -> list[list[int]]:
    """Token ids of each line followed by the end-of-line token, without BOS."""
    return [enc.ids for enc in tokenizer.backend_tokenizer.encode_batch(
        [line + END_OF_LINE for line in lines], add_special_tokens=False)]


def pack_rows(lines: list[list[int]], seq_len: int, bos: int, eos: int, pad: int) -> torch.Tensor:
    """Greedily pack consecutive lines into rows ``BOS line line ... EOS`` padded to ``seq_len``.

    A line too long for a row on its own is left out.
    """
    rows, row = [], [bos]
    for ids in lines:
        if len(ids) + 2 > seq_len:
            continue
        if len(row) + len(ids) + 1 > seq_len:
            rows.append(row + [eos] + [pad] * (seq_len - len(row) - 1))
            row = [bos]
        row = row + ids
    rows.append(row + [eos] + [pad] * (seq_len - len(row) - 1))
    return torch.tensor(rows)


def training_rows(tokenizer, settings: TrainSettings) -> tuple[torch.Tensor, dict]:
    """The packed, shuffled training set and its size."""
    lines = [p + a for p, a in corpus.task_examples("train", settings.n_problems, settings.seed)]
    lines += corpus.text_samples("train", settings.n_texts, settings.seed)
    random.Random(settings.seed).shuffle(lines)
    encoded = encode_lines(tokenizer, lines)
    rows = pack_rows(encoded, settings.seq_len, tokenizer.bos_token_id, tokenizer.eos_token_id,
                     tokenizer.pad_token_id)
    size = {"problems": settings.n_problems, "texts": settings.n_texts, "examples": len(lines),
            "tokens": int((rows != tokenizer.pad_token_id).sum()), "rows": len(rows)}
    return rows, size


def _lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def seed_everything(seed: int, threads: int) -> None:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)


def train(model: torch.nn.Module, rows: torch.Tensor, pad: int, settings: TrainSettings,
          log: Callable[[str], None] | None = None) -> dict:
    """Causal-LM training on ``rows`` (padding excluded from the loss); returns the final training loss."""
    seed_everything(settings.seed, settings.threads)
    model.train()

    def loss_of(batch: torch.Tensor, _step: int) -> torch.Tensor:
        return model(input_ids=batch, labels=batch.masked_fill(batch == pad, -100)).loss

    loss = run_steps(list(model.parameters()), rows, settings, torch.Generator().manual_seed(settings.seed), loss_of,
                     log, "step")
    model.eval()
    return {"final_train_loss": loss}


def run_steps(params: list[torch.nn.Parameter], rows: torch.Tensor, settings: TrainSettings,
              generator: torch.Generator, loss_of: Callable[[torch.Tensor, int], torch.Tensor],
              log: Callable[[str], None] | None, label: str) -> float:
    """``settings.steps`` AdamW steps on ``params`` over shuffled batches of ``rows`` (reshuffled by ``generator``
    when they run out), the learning rate on its schedule, gradients clipped at 1; the mean of the last 50
    losses. ``loss_of`` takes the batch and the step's index."""
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.98), weight_decay=settings.weight_decay)
    order, cursor = torch.randperm(len(rows), generator=generator), 0
    recent: list[float] = []
    for step in range(settings.steps):
        if cursor + settings.batch_size > len(order):
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        batch = rows[order[cursor:cursor + settings.batch_size]]
        cursor += settings.batch_size
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        loss = loss_of(batch, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        recent = [*recent, loss.item()][-50:]
        if log and (step + 1) % 100 == 0:
            log(f"{label} {step + 1}/{settings.steps} loss {sum(recent) / len(recent):.4f}")
    return round(sum(recent) / len(recent), 4)
