"""The fp32 PyTorch reference as a Decoder, so that it decodes with exactly the artifact's loop and stop rules,
and records which experts each MoE layer selected."""

from __future__ import annotations

import time

import numpy as np
import torch

from toolchain import source as sources
from toolchain.errors import InputError


def source_changes(manifest: dict, source: sources.Source) -> list[str]:
    """How the checkpoint at ``source`` differs from the files the artifact was built from ([] when identical)."""
    from toolchain.manifest import file_hashes

    recorded = (manifest.get("source") or {}).get("files") or {}
    actual = file_hashes(source.path)
    changes = [f"changed {n}" for n in sorted(recorded) if n in actual and actual[n] != recorded[n]]
    changes += [f"missing {n}" for n in sorted(set(recorded) - set(actual))]
    changes += [f"extra {n}" for n in sorted(set(actual) - set(recorded))]
    return changes


def resolve_reference(manifest: dict, override: str | None) -> tuple[sources.Source, dict]:
    """The checkpoint an artifact was built from (its manifest's model and pinned revision), checked against the
    source hashes the manifest recorded; or ``override``, used as given. Returns the source and what the report
    records of the choice."""
    if override:
        source = sources.resolve(override, hint="--reference MODEL")
        changes = source_changes(manifest, source) if (manifest.get("source") or {}).get("files") else None
        return source, {"override": True, "matches_build_source": None if changes is None else not changes}
    src = manifest.get("source") or {}
    if not src.get("model"):
        raise InputError("the artifact has no manifest.json naming its source model: pass --reference MODEL")
    source = sources.resolve(src["model"], revision=src.get("revision"), hint="--reference MODEL")
    changes = source_changes(manifest, source)
    if changes:
        raise InputError(f"the checkpoint now at {source.path} is not the one the artifact was built from "
                         f"({', '.join(changes[:3])}{' ...' if len(changes) > 3 else ''}); pass --reference "
                         f"{src['model']} to evaluate against it anyway")
    return source, {"override": False, "matches_build_source": True}


class TorchDecoder:
    """transformers' eager model with a DynamicCache, behind the runtime Decoder interface."""

    backend = "pytorch"

    def __init__(self, source: sources.Source, threads: int | None = None, choice: dict | None = None) -> None:
        t0 = time.perf_counter()
        self.source = source
        self.choice = choice or {}  # how the reference was chosen (resolve_reference), recorded in the report
        self.model = sources.load(source, False)
        self.load_seconds = time.perf_counter() - t0
        self.threads = threads or torch.get_num_threads()
        self.runtime_config = {"dtype": "float32", "attn_implementation": "eager", "threads": self.threads}
        self.extras: dict[str, np.ndarray] = {}
        self._routers = self._capture_routing()
        self.reset()

    def _capture_routing(self) -> dict[int, str]:
        """Wrap each MoE layer's route_tokens_to_experts (transformers 5.5 DeepSeek-V2/V3) to keep its indices."""
        names = {}
        for name, module in self.model.named_modules():
            if not hasattr(module, "route_tokens_to_experts"):
                continue
            layer = int(name.split("layers.")[1].split(".")[0])
            key = f"router.{layer}"
            names[layer] = key
            original = module.route_tokens_to_experts

            def wrapped(router_logits, _original=original, _key=key):
                indices, weights = _original(router_logits)
                self.extras[_key] = indices.numpy().astype(np.int64)
                return indices, weights

            module.route_tokens_to_experts = wrapped
        return names

    def router_outputs(self) -> dict[int, str]:
        return dict(self._routers)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        positions = np.clip(attention_mask.cumsum(-1) - 1, 0, None)[:, -input_ids.shape[1]:]
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention_mask),
                             position_ids=torch.from_numpy(positions), past_key_values=self.cache, use_cache=True)
        return out.logits.float().numpy()
