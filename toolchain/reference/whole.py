"""The fp32 PyTorch reference: transformers' eager model behind the Decoder calls, so that it decodes with exactly
the loop and stop rules the artifacts do (toolchain/runtime/generate.py), and records which experts each MoE layer
selected.

The model is loaded once per process and source checkpoint (``reference_model``): a build's export, passes,
compile and eval stages check against the same reference, and loading it is what costs (the whole model in
fp32). ``release_reference`` drops it.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from toolchain import source as sources
from toolchain.export.architectures import architecture_for
from toolchain.export.reference import cache_argument, is_moe, watch_expert_choice
from toolchain.runtime.decoder import positions

_loaded: dict[str, object] = {}  # source path -> the loaded model (one at a time)

SCORE_ROWS = 256  # positions reduced at a time by score()


def reference_model(source: sources.Source):
    key = str(source.path.resolve())
    if key not in _loaded:
        release_reference()
        _loaded[key] = sources.load(source)
    return _loaded[key]


def release_reference() -> None:
    import gc

    _loaded.clear()
    gc.collect()  # transformers models hold reference cycles


class TorchDecoder:
    """transformers' eager model with a DynamicCache, behind the runtime Decoder interface; and ``score``, the
    layer-by-layer reference's (toolchain/reference/layered.py) for an architecture that one does not run."""

    backend = "pytorch"
    resident = True  # every layer built (what eval's reference record asks of a reference)

    def __init__(self, source: sources.Source, threads: int | None = None, choice: dict | None = None) -> None:
        t0 = time.perf_counter()
        self.source: sources.Source | None = source  # None: over() a model already loaded
        self.choice = choice or {}  # how the reference was chosen (resolve_reference), recorded in the report
        self.model = reference_model(source)
        self.load_seconds = time.perf_counter() - t0
        self.threads = threads or torch.get_num_threads()
        self.runtime_config = {"dtype": "float32", "attn_implementation": "eager", "threads": self.threads}
        self.extras: dict[str, np.ndarray] = {}
        self._routers = self._capture_routing()
        self.reset()

    @classmethod
    def over(cls, model, threads: int | None = None) -> TorchDecoder:
        """A decoder over a transformers model already loaded (tests, callers that built it themselves)."""
        decoder = cls.__new__(cls)
        decoder.source, decoder.choice, decoder.model, decoder.load_seconds = None, {}, model, 0.0
        decoder.threads = threads or torch.get_num_threads()
        decoder.runtime_config = {"dtype": "float32", "attn_implementation": "eager", "threads": decoder.threads}
        decoder.extras = {}
        decoder._routers = decoder._capture_routing()
        decoder.reset()
        return decoder

    def _capture_routing(self) -> dict[int, str]:
        """Watch each MoE layer's expert choice, once per model, to keep its indices in the model's routing record,
        which each forward reads into ``extras``."""
        names = {}
        record = getattr(self.model, "_dstc_routing", None)
        if record is None:
            self.model._dstc_routing = {}
        for name, module in self.model.named_modules():
            if not is_moe(module):
                continue
            layer = int(name.split("layers.")[1].split(".")[0])
            names[layer] = key = f"router.{layer}"
            if record is None:  # else watched by an earlier decoder over this (cached) model
                watch_expert_choice(module, functools.partial(self.model._dstc_routing.__setitem__, key))
        return names

    def router_outputs(self) -> dict[int, str]:
        return dict(self._routers)

    @property
    def config(self):
        return self.model.config

    @property
    def row_by_row(self) -> bool:
        """A batch run one row at a time (the architecture says why: Architecture.reference_row_by_row)."""
        return architecture_for(self.model.config.model_type).reference_row_by_row

    def close(self) -> None:
        """Release the loaded model (eval's reference is let go before the artifact runs)."""
        self.model = None
        release_reference()

    def score(self, sequences: list[list[int]], reduce, log=lambda _: None) -> dict[int, list[np.ndarray]]:
        """LayeredReference.score's contract on the whole model: each sequence alone (positions from 0, no cache),
        ``reduce(sequence, first_position, logits [n, vocab])`` in blocks of SCORE_ROWS positions; returns each MoE
        layer's expert indices per sequence ([length, top_k])."""
        routes: dict[int, list[np.ndarray]] = {}
        for s, ids in enumerate(sequences):
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([ids], dtype=torch.int64), use_cache=False).logits[0]
            for a in range(0, len(ids), SCORE_ROWS):
                reduce(s, a, logits[a:a + SCORE_ROWS].float())
            for layer, key in self._routers.items():
                routes.setdefault(layer, []).append(self.model._dstc_routing[key])
            if (s + 1) % 50 == 0 or s + 1 == len(sequences):
                log(f"reference: {s + 1}/{len(sequences)} sequences, whole model")
        return routes

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.row_caches: list = []

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0,
                inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
        del logits_to_keep  # the reference computes every position (transformers' own default)
        if inputs:
            raise ValueError(f"the PyTorch reference takes no further inputs ({', '.join(inputs)})")
        ids, mask = np.ascontiguousarray(input_ids, np.int64), np.ascontiguousarray(attention_mask, np.int64)
        if len(ids) > 1 and self.row_by_row:
            return self._row_by_row(ids, mask)
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             position_ids=torch.from_numpy(np.ascontiguousarray(positions(mask, ids.shape[1]))),
                             use_cache=True, **{cache_argument(): self.cache})
        self.extras = dict(self.model._dstc_routing)
        return out.logits.float().numpy()

    def _row_by_row(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Each row's new real tokens (its attention_mask's ones) through the model with the row's own cache; the
        logits [B, S, vocab] left-padded as the batch's (zeros at padding, which no caller reads), and the expert
        choices of the real tokens, row after row."""
        from transformers import DynamicCache

        if not self.row_caches:
            self.row_caches = [DynamicCache(config=self.model.config) for _ in ids]
        new = ids.shape[1]
        logits = np.zeros((*ids.shape, self.model.config.vocab_size), np.float32)
        routing: dict[str, list[np.ndarray]] = {}
        for row, cache in enumerate(self.row_caches):
            real = mask[row, -new:].astype(bool)
            if not real.any():
                continue
            tokens = torch.from_numpy(ids[row, real][None])
            past = cache.get_seq_length()
            with torch.no_grad():
                total = past + tokens.shape[1]
                out = self.model(input_ids=tokens, attention_mask=torch.ones(1, total, dtype=torch.long),
                                 position_ids=torch.arange(past, total)[None], use_cache=True,
                                 **{cache_argument(): cache})
            logits[row, new - tokens.shape[1]:] = out.logits[0].float().numpy()
            for key, chosen in self.model._dstc_routing.items():
                routing.setdefault(key, []).append(chosen)
        self.extras = {key: np.concatenate(parts) for key, parts in routing.items()}
        return logits
