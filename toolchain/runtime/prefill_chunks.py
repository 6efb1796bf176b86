"""A long prompt fed in query chunks through the KV cache, so that prefill memory grows linearly with the prompt.

Attention's score tensor is [B, heads, new, past + new] float32 per layer. MLA's latent graph
(toolchain/export/deepseek.py, the default of every DeepSeek-V2/V3 export) computes it as MatMuls over the cached
latent and rope keys with no fused kernel in between: a 4k-token prompt at DeepSeek-V3's 128 heads needs 8 GiB of
it, a 16k one 128 GiB. Fed C positions at a time, each forward's scores are [B, heads, C, past + C].

Why chunks rather than a fused kernel over the latent (ONNX Runtime's Attention, OpenVINO's
ScaledDotProductAttention with one 576-wide key head and a 512-wide value head): every dstc graph already takes new
positions on top of a past cache with a causal mask over both (a speculative verify step does), so this is the same
arithmetic with no graph change (the artifacts' bytes stay as built), on both backends and every architecture; and
each chunk attends to the keys before it only, so a long prompt's attention does about half the one-shot work (the
one-shot product also computes the masked upper triangle).

C is chosen per chunk from a byte budget for that tensor (the largest C with 4·B·heads·C·(past + C) ≤ budget, so
chunks shrink as the cache grows), the budget being the larger of BUDGET_FLOOR and the model files' size over
WEIGHTS_SHARE: a prompt that fits is one forward, as before, and a large model (whose every chunk reads its weights
again) gets larger chunks. A runtime holds several tensors of about that size at once (the latent's and the rope
key's scores, their sum, the softmax; the absorbed queries and outputs, [C, heads, 512]): at DeepSeek-V3 widths
(2 layers, INT4, 2.5 GB of weights), OpenVINO's peak for a 4k prompt was 1.3 GiB over a 19-token one's with an
eighth of the weights (312 MB) and 0.9 GiB with a sixteenth, which keeps it within 2× the weights and the cache
(the issue #26 target). What a forward used is kept in ``chunks``.

DeepSeek-V3.2's latent graph also gathers, per query, the latent and rotary-key rows of the k = min(index_topk,
past + C) tokens its indexer chose (toolchain/export/deepseek_v32.py), 4·B·C·k·(kv_lora_rank + qk_rope_head_dim)
bytes, 4.5x a 128-head score row at DeepSeek-V3.2's widths while the cache is shorter than index_topk: counted in
the chunk's bytes beside the indexer's own scores over every key, which the score term bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BUDGET_FLOOR = 128 << 20
WEIGHTS_SHARE = 16


@dataclass(frozen=True)
class PrefillChunking:
    heads: int  # query heads: the score tensor's
    budget_bytes: int
    gathered: tuple[int, int] = (0, 0)  # DeepSeek-V3.2: (index_topk, floats gathered per query and chosen key)

    @classmethod
    def for_model(cls, config: dict, weights_bytes: int) -> PrefillChunking | None:
        """The chunking of a model of this config.json and model files' size; None if it names no head count."""
        heads = config.get("num_attention_heads")
        if not isinstance(heads, int) or heads < 1:
            return None
        gathered = (0, 0)
        if config.get("index_topk") and config.get("kv_lora_rank"):
            gathered = (config["index_topk"], config["kv_lora_rank"] + config["qk_rope_head_dim"])
        return cls(heads, max(BUDGET_FLOOR, weights_bytes // WEIGHTS_SHARE), gathered)

    def spans(self, batch: int, past: int, new: int) -> list[tuple[int, int]]:
        """[start, end) of each chunk of ``new`` positions fed on top of ``past`` cached ones."""
        per = 4 * batch * self.heads  # bytes per query position and key
        top_k, width = self.gathered

        def held_bytes(size: int, held: int) -> int:
            return per * size * (held + size) + 4 * batch * size * min(held + size, top_k) * width

        spans, start = [], 0
        while start < new:
            held = past + start
            size = int((math.sqrt(held * held + 4 * self.budget_bytes / per) - held) / 2)
            while size > 1 and held_bytes(size, held) > self.budget_bytes:
                size -= 1
            size = max(1, min(new - start, size))
            spans.append((start, start + size))
            start += size
        return spans


def prefill_spans(chunking: PrefillChunking | None, batch: int, new: int) -> list[tuple[int, int]]:
    """The chunks of a prompt of ``new`` positions fed from an empty cache; one without ``chunking``."""
    return chunking.spans(batch, 0, new) if chunking is not None else [(0, new)]


class ChunkedForward:
    """The Decoder ``forward`` of dstc's decoders (toolchain/runtime/decoder.py) over their one-shot ``_forward``:
    the new positions in chunks (``chunking`` None: one forward), the requested logits and extra outputs of every
    chunk joined as one forward would have returned them."""

    chunking: PrefillChunking | None = None
    chunks: list[int]  # the last forward's chunk sizes
    extras: dict[str, np.ndarray]

    def _forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int,
                 inputs: dict[str, np.ndarray] | None) -> np.ndarray:
        raise NotImplementedError

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0,
                inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
        batch, new = input_ids.shape
        past = attention_mask.shape[1] - new
        spans = self.chunking.spans(batch, past, new) if self.chunking is not None else [(0, new)]
        self.chunks = [end - start for start, end in spans]
        if len(spans) == 1:
            return self._forward(input_ids, attention_mask, logits_to_keep, inputs)
        first_kept = max(0, new - logits_to_keep) if logits_to_keep else 0
        logits, extras = [], []
        for start, end in spans:
            # a chunk before the kept positions still asks for one row (0 would be all of them)
            keep = (end - max(start, first_kept) if end > first_kept else 1) if logits_to_keep else 0
            out = self._forward(input_ids[:, start:end], attention_mask[:, :past + end], keep,
                                {name: value[:, start:end] for name, value in (inputs or {}).items()})
            if end > first_kept:
                logits.append(out[:, -keep:] if keep else out)  # a stateless graph returns every position
            extras.append((end - start, self.extras))
        self.extras = {name: _joined([(n, e[name]) for n, e in extras], batch) for name in self.extras}
        return np.concatenate(logits, axis=1)


def _joined(parts: list[tuple[int, np.ndarray]], batch: int) -> np.ndarray:
    """An extra output's chunks as one forward returns it: per position [B, S, ...] (hidden states), or flattened
    [B·S, ...] (a router's expert indices, toolchain/runtime/routing.py)."""
    (size, first), *_ = parts
    if first.ndim >= 2 and first.shape[:2] == (batch, size):
        return np.concatenate([value for _, value in parts], axis=1)
    rows = [value.reshape(batch, n, *value.shape[1:]) for n, value in parts]
    return np.concatenate(rows, axis=1).reshape(-1, *first.shape[1:])
