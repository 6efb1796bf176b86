"""The PyTorch reference in bounded memory: transformers' own decoder layers built one at a time from the checkpoint
reader (toolchain/export/reference.py), run as the model's forward runs them.

Whole-model fp32 (toolchain/reference/whole.py) is 28 GiB at R1-Distill-Qwen-7B's widths and 2.7 TB at
DeepSeek-V3's. Here a layer's fp32 weights exist only while it runs, unless every layer together fits a small
budget (the embedded and few-layer models), when they stay built and the reference runs at whole-model speed.
A MoE layer whose routed experts are too large to build (DeepSeek-V3's: 45 GB per layer) is built without them,
and they are read from the checkpoint as the tokens hit them, a few at a time (experts_on_demand.py), bit for bit
what the layer built whole computes.

Two ways in:

* the Decoder protocol (``reset`` / ``forward``), with a KV cache across calls, for greedy generation: each forward
  runs every layer on the batch, so a model that does not stay built is read once per decode step;
* ``score(sequences, reduce)``, without a cache between calls: every sequence goes through layer 0, then layer 1,
  and so on, so each layer is built once for all of them; a sequence longer than ``chunk`` is prefilled a chunk of
  queries at a time through its own cache, so eager attention's scores are [heads, chunk, length], not
  [heads, length, length]. ``reduce(i, logits)`` gets each sequence's fp32 logits in blocks of positions.

Each MoE layer's expert choice is recorded per call (``extras``, ``routes``), as TorchDecoder records it.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from toolchain import source as sources
from toolchain.checkpoint.reader import EMBEDDING, LM_HEAD, open_checkpoint
from toolchain.errors import UnsupportedModelError
from toolchain.export import reference as ref
from toolchain.export.architectures import architecture_for
from toolchain.hardware import available_memory_bytes
from toolchain.runtime.decoder import positions

HEAD_ROWS = 8192  # lm_head rows widened to fp32 at a time
LOGIT_ROWS = 256  # positions whose logits are computed at a time in score()
RESIDENT_MAX = 4 * 2**30  # fp32 bytes of every layer below which the layers stay built
RESIDENT_SHARE = 0.25  # ... and at most this share of the memory available when the reference opens
# A layer's routed experts above this share of the memory available are read as tokens hit them (DeepSeek-V3's
# are 45 GB per layer in fp32), EXPERTS_AT_ONCE_BYTES of them at a time (toolchain/checkpoint/experts_on_demand.py)
EXPERTS_SHARE = 0.25
EXPERTS_AT_ONCE_BYTES = 1 << 30


def additive_mask(mask: np.ndarray, new: int) -> torch.Tensor:
    """[B, 1, new, total] additive mask as transformers' eager attention takes it: causal and padding."""
    total = mask.shape[1]
    query = torch.arange(total - new, total)[:, None]
    allowed = (torch.arange(total)[None, :] <= query)[None, None] & torch.from_numpy(mask.astype(bool))[:, None, None]
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


@dataclass(frozen=True)
class LayerSize:
    """A decoder layer's fp32 bytes from the checkpoint's headers: its routed experts (``model.layers.N.mlp.
    experts.E.*``) apart from the rest."""
    other: int = 0
    experts: int = 0
    count: int = 0  # routed experts

    @property
    def per_expert(self) -> int:
        return self.experts // self.count if self.count else 0

    def on_demand(self, available: int) -> bool:
        """Whether its routed experts are read as tokens hit them rather than built with the layer: when they
        are more than EXPERTS_SHARE of the memory available."""
        return self.count > 0 and self.experts > EXPERTS_SHARE * available

    def at_once(self) -> int:
        return max(1, EXPERTS_AT_ONCE_BYTES // max(1, self.per_expert))

    def built(self, available: int) -> int:
        """What building it holds: the layer, or without its routed experts and with ``at_once`` of them."""
        if not self.on_demand(available):
            return self.other + self.experts
        return self.other + min(self.count, self.at_once()) * self.per_expert


_ROUTED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def layer_sizes(reader, layers: int | None = None) -> list[LayerSize]:
    """Each decoder layer's LayerSize (the first ``layers``; default: every ``model.layers.N`` the reader has)."""
    other: dict[int, int] = {}
    experts: dict[int, int] = {}
    count: dict[int, set[int]] = {}
    for name in reader.names():
        parts = name.split(".")
        if not (name.startswith("model.layers.") and parts[2].isdigit()):
            continue
        i, size = int(parts[2]), math.prod(reader.shape(name)) * 4
        routed = _ROUTED.match(name)
        if routed:
            experts[i] = experts.get(i, 0) + size
            count.setdefault(i, set()).add(int(routed.group(2)))
        else:
            other[i] = other.get(i, 0) + size
    n = layers if layers is not None else max([*other, *experts], default=-1) + 1
    return [LayerSize(other.get(i, 0), experts.get(i, 0), len(count.get(i, ()))) for i in range(n)]


def memory_need(path, hidden_bytes: int) -> int:
    """What a LayeredReference of the checkpoint at ``path`` holds at most, from its headers: the table and head
    in their stored dtype, every layer in fp32 when they stay built (else the largest twice: the one running and
    its temporaries; a layer whose routed experts are read on demand without them and with EXPERTS_AT_ONCE_BYTES
    of them), ``hidden_bytes`` of hidden states and a block of fp32 / fp64 logits."""
    with open_checkpoint(path) as reader:
        sizes = layer_sizes(reader)
        ends = sum(math.prod(reader.shape(n)) * reader.natural_dtype(n).itemsize for n in (EMBEDDING, LM_HEAD))
        vocab = reader.shape(EMBEDDING)[0]
    available = available_memory_bytes()
    total = sum(s.other + s.experts for s in sizes)
    resident = total <= min(RESIDENT_MAX, RESIDENT_SHARE * available)
    layers = total if resident else 2 * max((s.built(available) for s in sizes), default=0)
    return ends + layers + hidden_bytes + LOGIT_ROWS * vocab * (4 + 8 + 8)


class LayeredReference:
    backend = "pytorch"

    def __init__(self, source: sources.Source, threads: int | None = None, choice: dict | None = None,
                 chunk: int = 1024) -> None:
        t0 = time.perf_counter()
        self.source = source
        self.choice = choice or {}
        self.chunk = chunk
        self.config = ref.reference_config(source.path)
        layer_types = getattr(self.config, "layer_types", None) or []
        # DeepSeek-V3.2's indexed_attention layers take the same additive mask (their indexer reads it too)
        if any(t not in ("full_attention", "indexed_attention") for t in layer_types):
            raise UnsupportedModelError("the layer-by-layer reference runs full-attention layers only "
                                        f"({source.spec} has {sorted(set(layer_types))})")
        self._stack = ExitStack()
        self.reader = self._stack.enter_context(open_checkpoint(source.path))
        self.sizes = layer_sizes(self.reader, self.num_layers)
        available = available_memory_bytes()
        self.resident = sum(s.other + s.experts for s in self.sizes) <= min(RESIDENT_MAX, RESIDENT_SHARE * available)
        # experts_at_once of each layer whose routed experts are read on demand (never when the layers stay built)
        self.experts_at_once = {} if self.resident else \
            {i: s.at_once() for i, s in enumerate(self.sizes) if s.on_demand(available)}
        # The table and the head in the dtype that holds them exactly (bf16 for bf16 and FP8 checkpoints): rows
        # gathered, or blocks widened, are the fp32 reference's values at half its memory.
        self.table = self.reader.tensor(EMBEDDING, self.reader.natural_dtype(EMBEDDING))
        self.head = self.reader.tensor(LM_HEAD, self.reader.natural_dtype(LM_HEAD))
        self.norm = ref.final_norm(self.config, self.reader)
        self.rotary = ref.rotary_embedding(self.config)
        self._built: dict[int, torch.nn.Module] = {}
        self.moe_layers: list[int] = []
        self._routes: dict[int, list[np.ndarray]] = {}  # layer -> index arrays recorded by its router, in order
        self.threads = threads or torch.get_num_threads()
        self.runtime_config = {"dtype": "float32", "attn_implementation": "eager", "threads": self.threads,
                               "layers": "resident" if self.resident else "built per pass from the checkpoint"}
        if self.experts_at_once:
            self.runtime_config["routed_experts"] = (f"read as tokens hit them, {min(self.experts_at_once.values())}"
                                                     " at a time")
        self.extras: dict[str, np.ndarray] = {}
        self.load_seconds = time.perf_counter() - t0
        self.reset()

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def close(self) -> None:
        self._built.clear()
        self._stack.close()

    def router_outputs(self) -> dict[int, str]:
        return {layer: f"router.{layer}" for layer in self._moe_layer_indices()}

    def _moe_layer_indices(self) -> list[int]:
        return list(architecture_for(self.config.model_type).moe_layers(self.config))

    def _layer(self, i: int) -> torch.nn.Module:
        if i in self._built:
            return self._built[i]
        layer = ref.decoder_layer(self.config, self.reader, i, self.experts_at_once.get(i))
        for module in layer.modules():
            if ref.is_moe(module):
                ref.watch_expert_choice(module, functools.partial(self._record_route, i))
        if self.resident:
            self._built[i] = layer
        return layer

    def _record_route(self, layer: int, indices: np.ndarray) -> None:
        self._routes.setdefault(layer, []).append(indices)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] @ head.T in fp32, the head widened HEAD_ROWS rows at a time."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.cat([flat @ self.head[s:s + HEAD_ROWS].float().T for s in range(0, len(self.head), HEAD_ROWS)],
                        dim=-1)
        return out.reshape(*hidden.shape[:-1], -1)

    # the Decoder protocol

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.config)

    @torch.no_grad()
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0) -> np.ndarray:
        ids, mask = np.ascontiguousarray(input_ids, np.int64), np.ascontiguousarray(attention_mask, np.int64)
        new = ids.shape[1]
        pos = torch.from_numpy(np.ascontiguousarray(positions(mask, new)))
        hidden = self.table[torch.from_numpy(ids)].float()
        rope, amask = self.rotary(hidden, pos), additive_mask(mask, new)
        self._routes.clear()
        for i in range(self.num_layers):
            out = self._layer(i)(hidden, attention_mask=amask, position_ids=pos, position_embeddings=rope,
                                 use_cache=True, **{ref.cache_argument(): self.cache})
            hidden = out[0] if isinstance(out, tuple) else out
        self.extras = {f"router.{layer}": np.concatenate(arrays) for layer, arrays in self._routes.items()}
        hidden = self.norm(hidden)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self._logits(hidden).numpy()

    # layer-major scoring

    @torch.no_grad()
    def score(self, sequences: list[list[int]], reduce: Callable[[int, int, torch.Tensor], None],
              log: Callable[[str], None] = lambda _: None) -> dict[int, list[np.ndarray]]:
        """Run every sequence (no padding, positions from 0) through every layer, layer after layer; call
        ``reduce(sequence, first_position, logits [n, vocab])`` for its positions in blocks of LOGIT_ROWS, and
        return each MoE layer's expert indices per sequence ([length, top_k])."""
        from transformers import DynamicCache

        hiddens = [self.table[torch.tensor(ids, dtype=torch.int64)][None].float() for ids in sequences]
        routes: dict[int, list[np.ndarray]] = {}
        started = time.perf_counter()
        for i in range(self.num_layers):
            layer = self._layer(i)
            for s, hidden in enumerate(hiddens):
                length = hidden.shape[1]
                cache, outs = DynamicCache(config=self.config), []
                self._routes.clear()
                for a in range(0, length, self.chunk):
                    b = min(length, a + self.chunk)
                    pos = torch.arange(a, b)[None]
                    part = hidden[:, a:b]
                    out = layer(part, attention_mask=additive_mask(np.ones((1, b), np.int64), b - a),
                                position_ids=pos, position_embeddings=self.rotary(part, pos), use_cache=True,
                                **{ref.cache_argument(): cache})
                    outs.append(out[0] if isinstance(out, tuple) else out)
                hiddens[s] = torch.cat(outs, dim=1)
                for layer_index, arrays in self._routes.items():
                    routes.setdefault(layer_index, []).append(np.concatenate(arrays))
            del layer
            log(f"reference layer {i + 1}/{self.num_layers} on {len(sequences)} sequences "
                f"({time.perf_counter() - started:.1f} s)")
        for s, hidden in enumerate(hiddens):
            normed = self.norm(hidden[0])
            for a in range(0, len(normed), LOGIT_ROWS):
                reduce(s, a, self._logits(normed[a:a + LOGIT_ROWS]))
            hiddens[s] = torch.empty(0)  # released as the sequences are reduced
        self._routes.clear()
        return routes
