"""Names and locations of the embedded tiny models and of the real models' reference configs."""

from __future__ import annotations

import json
from pathlib import Path

from toolchain.errors import InputError

PACKAGE_DIR = Path(__file__).resolve().parent
EMBEDDED_ROOT = PACKAGE_DIR / "embedded"
REFERENCE_ROOT = PACKAGE_DIR / "reference_configs"

# name -> the real model family it stands for (its config's model_type).
EMBEDDED = {
    "deepseek-v3-tiny": "deepseek_v3",
    "deepseek-v2-lite-tiny": "deepseek_v2",
    "r1-distill-qwen-tiny": "qwen2",
    "r1-distill-llama-tiny": "llama",
}
REFERENCES = sorted(p.stem for p in REFERENCE_ROOT.glob("*.json"))


def _unknown(kind: str, name: str, known: list[str]) -> InputError:
    return InputError(f"unknown {kind} {name!r}; known: {', '.join(known)}")


def embedded_path(name: str) -> Path:
    if name not in EMBEDDED:
        raise _unknown("embedded model", name, list(EMBEDDED))
    return EMBEDDED_ROOT / name


def reference_config(name: str) -> dict:
    """The real checkpoint's config.json, with its original key names."""
    if name not in REFERENCES:
        raise _unknown("reference model", name, REFERENCES)
    return json.loads((REFERENCE_ROOT / f"{name}.json").read_text())


def model_parameters(config) -> int:
    """Parameters (toolchain/source.py parameter_count) of the model a transformers config describes, counted on
    the meta device: nothing is allocated, whatever the size."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolchain.source import parameter_count, quiet_transformers

    with torch.device("meta"), quiet_transformers():
        model = AutoModelForCausalLM.from_config(config)
    return parameter_count(model)


def list_embedded() -> list[dict]:
    """One row per embedded model (with its training.json metrics when present), then one per reference."""
    from toolchain.checkpoint.reference import reference_config as checkpoint_config
    from toolchain.models.shape_faithful import reference_to_config

    rows = []
    for name, model_type in EMBEDDED.items():
        path = embedded_path(name)
        row = {"name": name, "kind": "embedded", "model_type": model_type, "path": str(path),
               "parameters": model_parameters(checkpoint_config(path)),
               "size_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else 0}
        training = path / "training.json"
        if training.is_file():
            record = json.loads(training.read_text())
            row.update(record["metrics"], steps=record["settings"]["steps"], wall_time_s=record["wall_time_s"])
        rows.append(row)
    for name in REFERENCES:
        config = reference_config(name)
        rows.append({"name": name, "kind": "reference", "model_type": config["model_type"],
                     "parameters": model_parameters(reference_to_config(config)),
                     "path": str(REFERENCE_ROOT / f"{name}.json"),
                     "size_bytes": None})
    return rows
