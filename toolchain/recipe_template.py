"""A first recipe for a model, without writing YAML: `dstc recipe init MODEL --backend B --scheme S` (issue #41).

The recipe is the shipped recipes' shape for the backend and scheme, checked by the recipe model before it is
written, so that what `dstc build` then reads is valid; its gates are a starting point the comments say how to
tighten.
"""

from __future__ import annotations

import re

import yaml

from toolchain.errors import InputError
from toolchain.recipe import Backend, CompressSection, Recipe

# the shipped recipes' compression per scheme (recipes/*-int4.yaml, *-int8-per-head.yaml)
SCHEMES: dict[str, dict | None] = {
    "int4-grouped": {"scheme": "int4-grouped", "group_size": 128, "sym": False, "backup": "int8"},
    "int8-per-channel": {"scheme": "int8-per-channel"},
    "int8-per-head": {"scheme": "int8-per-head"},
    "fp32": None,
}
# what an INT4 build of a real model passes against its fp32 reference (recipes/deepseek-r1-distill-qwen-1.5b-*.yaml)
GATES = {"max_perplexity_increase": 0.05, "max_kl_mean": 0.1, "min_top1_agreement": 0.85, "max_weight_error": 0.5}


def recipe_name(model: str, backend: str, scheme: str) -> str:
    """``deepseek-ai/DeepSeek-V3`` on openvino, int4-grouped -> ``deepseek-v3-openvino-int4``."""
    base = re.sub(r"[^a-z0-9._-]+", "-", model.rstrip("/").split("/")[-1].lower()).strip("-.") or "model"
    return f"{base}-{backend}-{scheme.split('-')[0]}"


def recipe_text(model: str, backend: Backend, scheme: str, name: str | None = None) -> str:
    """The YAML of a recipe building ``model`` for ``backend`` with ``scheme``, validated as `dstc build` will."""
    if scheme not in SCHEMES:
        raise InputError(f"unknown scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    compress = SCHEMES[scheme]
    data: dict = {"name": name or recipe_name(model, backend, scheme), "model": model,
                  "passes": {"target": backend}}
    if compress is not None:
        problem = CompressSection(**compress).problem(backend)
        if problem:
            raise InputError(f"--scheme {scheme} on {backend}: {problem}")
        data["compress"] = compress
    data |= {"compile": {"backend": backend}, "eval": {},
             "gates": {k: v for k, v in GATES.items() if compress is not None or k != "max_weight_error"}}
    Recipe.model_validate(data)  # what dstc build will read: a mistake here is a bug, not the user's
    return ("# Written by `dstc recipe init`; every key: docs/recipe.md. eval: {} measures the embedded corpus: give\n"
            "# your data with eval.dataset (JSONL text / prompt+answer / chat, or text). The gates are what an INT4\n"
            "# build of a real model passes; tighten them once you have seen your first report.\n"
            + yaml.safe_dump(data, sort_keys=False))
