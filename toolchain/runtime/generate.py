"""Greedy generation on a Decoder, the same on every backend: a left-padded batch, prefill, then one token per
step until each row meets a stop id or the token budget is spent; and streamed text for one prompt."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np

from toolchain.errors import InputError
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.decoder import Decoder, RewindableDecoder
from toolchain.runtime.kernel_caches import KernelCaches
from toolchain.runtime.speculative import Speculation


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask [B, longest] of prompts padded on the left."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    return ids, mask


@dataclass
class Generation:
    tokens: list[list[int]]  # per row, the generated tokens before its stop token
    ttft_s: float  # cache reset, prefill and the first token
    itl_s: list[float]  # each later decode step (one forward and its argmax)
    prompt_tokens: list[int]  # per row, the prompt's length in tokens


def greedy_loop(decoder: Decoder, prompts: list[list[int]], stop_ids: set[int], pad_id: int,
                ignore_stop: bool = False, all_prefill_logits: bool = False
                ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The one greedy loop: per step, (tokens [B] with -1 where a row has stopped (its stop token and after),
    the step's logits [B, S, vocab] (S = 1: the last position only, unless ``all_prefill_logits`` asks for every
    prefill position), the attention mask the step ran with). Ends when every row has stopped; with ignore_stop,
    never (the caller takes what it needs)."""
    if not prompts or not all(prompts):
        raise InputError("every prompt needs at least one token")
    decoder.reset()
    ids, mask = left_pad(prompts, pad_id)
    live = np.ones(len(prompts), bool)
    stops = np.array(sorted(stop_ids), np.int64)
    keep = 0 if all_prefill_logits else 1
    while True:
        logits = decoder.forward(ids, mask, keep)
        keep = 1
        token = logits[:, -1].argmax(-1)
        if not ignore_stop:
            live &= ~np.isin(token, stops)
        yield np.where(live, token, -1), logits, mask
        if not live.any():
            return
        # A stopped row is still fed (pad), as the batch moves together; nothing of it is read any more.
        ids = np.where(live, token, pad_id)[:, None]
        mask = np.concatenate([mask, np.ones((len(mask), 1), np.int64)], axis=1)


def greedy_steps(decoder: Decoder, prompts: list[list[int]], stop_ids: set[int], pad_id: int,
                 ignore_stop: bool = False) -> Iterator[np.ndarray]:
    """The greedy loop's tokens [B], one array per step (see greedy_loop)."""
    for tokens, _logits, _mask in greedy_loop(decoder, prompts, stop_ids, pad_id, ignore_stop):
        yield tokens


def greedy_logits(decoder: Decoder, prompts: list[list[int]], new_tokens: int,
                  pad_id: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Exactly ``new_tokens`` greedy tokens [B, new_tokens] of a left-padded batch (stop tokens ignored), and the
    logits the loop decided them on: the prefill's at every real (non-padding) position, then each step's new
    position's. What parity compares between a runtime and the PyTorch reference."""
    tokens, collected = [], []
    for step, (token, logits, mask) in enumerate(greedy_loop(decoder, prompts, set(), pad_id, ignore_stop=True,
                                                             all_prefill_logits=True)):
        collected.append(logits[mask.astype(bool)] if step == 0 else logits[:, -1])
        tokens.append(token)
        if step == new_tokens - 1:
            break
    return np.stack(tokens, axis=1), collected


def greedy_generate(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                    pad_id: int, on_token: Callable[[int, np.ndarray], None] | None = None,
                    ignore_stop: bool = False) -> Generation:
    """Greedy decoding of a batch. ``on_token(step, tokens)`` sees each step's tokens [B] (-1 for rows that have
    stopped) outside the timed region. ``ignore_stop`` runs exactly max_new_tokens steps (latency runs)."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    out: list[list[int]] = [[] for _ in prompts]
    steps = greedy_steps(decoder, prompts, stop_ids, pad_id, ignore_stop)
    times = []
    for step in range(max_new_tokens):
        started = time.perf_counter()
        tokens = next(steps, None)
        if tokens is None:
            break
        times.append(time.perf_counter() - started)
        for row, token in enumerate(tokens.tolist()):
            if token >= 0:
                out[row].append(token)
        if on_token is not None:
            on_token(step, tokens)
    return Generation(out, times[0], times[1:], [len(p) for p in prompts])


def prompt_ids(artifact: Artifact, prompt: str, *, chat: bool) -> list[int]:
    """The prompt's token ids: through the tokenizer's chat template as a user turn with the assistant's
    generation prompt, or encoded as the embedded models were trained, with only the special tokens the
    tokenizer adds by default (BOS for DeepSeek's)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # the command line hands undecodable bytes over as lone surrogates
        raise InputError("the prompt is not valid UTF-8 text") from None
    tokenizer = artifact.tokenizer()
    if chat:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def answer_tokens(artifact: Artifact, decoder: Decoder, ids: list[int], *, max_new_tokens: int,
                  speculation: Speculation | None = None) -> Iterator[list[int]]:
    """The greedy answer's tokens to the prompt ``ids`` as they come, until an eos id (not included) or
    max_new_tokens: one per step, or each verify step's accepted drafts and next token with ``speculation``
    (whose decoder must roll back: open_decoder's do)."""
    stops = set(artifact.eos_token_ids)
    if speculation is not None:
        yield from speculation.steps(cast(RewindableDecoder, decoder), ids, max_new_tokens=max_new_tokens,
                                     stop_ids=stops)
        return
    for tokens in itertools.islice(greedy_steps(decoder, [ids], stops, artifact.pad_token_id), max_new_tokens):
        if tokens[0] < 0:
            return
        yield [int(tokens[0])]


def stream_text(artifact: Artifact, decoder: Decoder, prompt: str, *, max_new_tokens: int,
                chat: bool, speculation: Speculation | None = None) -> Iterator[str]:
    """Text increments of a greedy answer as its tokens arrive, until an eos id or max_new_tokens.

    Each step decodes the whole answer so far and yields what is new: a character whose bytes span several
    tokens decodes as U+FFFD until its last token arrives, so a prefix ending in one is held back.
    """
    tokenizer = artifact.tokenizer()
    ids = prompt_ids(artifact, prompt, chat=chat)
    artifact.check_length(len(ids), max_new_tokens)
    generated: list[int] = []
    sent = ""
    for tokens in answer_tokens(artifact, decoder, ids, max_new_tokens=max_new_tokens, speculation=speculation):
        generated += tokens
        text = tokenizer.decode(generated)
        if text.endswith("\ufffd") or not text.startswith(sent) or text == sent:
            continue
        yield text[len(sent):]
        sent = text
    text = tokenizer.decode(generated)
    if text != sent:
        yield text[len(sent):]


def answer_record(artifact: Artifact, decoder: Decoder, prompt: str, *, max_new_tokens: int, chat: bool,
                  speculation: Speculation | None = None) -> dict:
    """The greedy answer as JSON: its tokens and text, the decoding's wall time and rate (prefill included), the
    prefill's time to the first token and its query chunks (toolchain/runtime/prefill_chunks.py), on OpenVINO the
    CPU plugin's kernel caches and why (toolchain/runtime/kernel_caches.py), and with ``speculation`` its acceptance
    per draft position."""
    ids = prompt_ids(artifact, prompt, chat=chat)
    artifact.check_length(len(ids), max_new_tokens)
    started = time.perf_counter()
    steps = answer_tokens(artifact, decoder, ids, max_new_tokens=max_new_tokens, speculation=speculation)
    tokens = list(next(steps, []))
    ttft = time.perf_counter() - started
    chunks = list(getattr(decoder, "chunks", [len(ids)]))  # the prefill's, before a decode step replaces them
    tokens += [t for step in steps for t in step]
    seconds = time.perf_counter() - started
    caches: KernelCaches | None = getattr(decoder, "kernel_caches", None)
    return {"prompt_tokens": len(ids), "new_tokens": len(tokens), "tokens": tokens,
            "text": artifact.tokenizer().decode(tokens), "seconds": round(seconds, 6),
            "ttft_seconds": round(ttft, 6), "prefill_chunks": len(chunks), "largest_prefill_chunk": max(chunks),
            "tokens_per_second": round(len(tokens) / seconds, 3) if seconds else None,
            "openvino_kernel_caches": caches.record() if caches is not None else None,
            "speculation": speculation.summary() if speculation is not None else None}
