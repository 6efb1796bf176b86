"""Continuous batching as a server runs it, for tests that compare it with each sequence decoded alone."""

from __future__ import annotations


def decode_joining_and_leaving(batch, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy tokens of every prompt decoded in ``batch`` (a PersistentBatch or StatefulBatch): two join every
    third step, beside the ones running, and each leaves once it has ``new`` tokens. In the prompts' order."""
    out: dict[int, list[int]] = {}
    waiting = list(range(len(prompts)))
    step = 0
    while waiting or len(batch):
        if waiting and step % 3 == 0:
            joining, waiting = waiting[:2], waiting[2:]
            for key, logits in batch.join({k: prompts[k] for k in joining}).items():
                out[key] = [int(logits.argmax())]
        batch.leave([k for k in batch.keys if len(out[k]) == new])
        if len(batch):
            for key, logits in batch.step({k: out[k][-1] for k in batch.keys}).items():
                out[key].append(int(logits.argmax()))
        step += 1
    return [out[k] for k in range(len(prompts))]
