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
from toolchain.checkpoint.reference import cache_argument, is_moe, watch_expert_choice
from toolchain.runtime.decoder import positions

_loaded: dict[str, object] = {}  # source path -> the loaded model (one at a time)


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
    """transformers' eager model with a DynamicCache, behind the runtime Decoder interface."""

    backend = "pytorch"

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

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0) -> np.ndarray:
        del logits_to_keep  # the reference computes every position (transformers' own default)
        ids, mask = np.ascontiguousarray(input_ids, np.int64), np.ascontiguousarray(attention_mask, np.int64)
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             position_ids=torch.from_numpy(np.ascontiguousarray(positions(mask, ids.shape[1]))),
                             use_cache=True, **{cache_argument(): self.cache})
        self.extras = dict(self.model._dstc_routing)
        return out.logits.float().numpy()
