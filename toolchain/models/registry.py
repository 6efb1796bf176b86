"""Names and locations of the embedded tiny models and of the real models' reference configs."""

from __future__ import annotations

import json
import struct
from math import prod
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


def stored_parameters(checkpoint: Path) -> int:
    """Number of values in the checkpoint's safetensors files, read from their headers without loading them."""
    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(prod(t["shape"]) for key, t in header.items() if key != "__metadata__")
    return total


def reference_parameters(config: dict) -> int:
    """Parameter count of the full-size reference model, from a model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolchain.models.shape_faithful import reference_to_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(reference_to_config(config))
    return sum(p.numel() for p in model.parameters())


def list_embedded() -> list[dict]:
    """One row per embedded model (with its training.json metrics when present), then one per reference."""
    rows = []
    for name, model_type in EMBEDDED.items():
        path = embedded_path(name)
        row = {"name": name, "kind": "embedded", "model_type": model_type, "path": str(path),
               "parameters": stored_parameters(path),
               "size_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else 0}
        training = path / "training.json"
        if training.is_file():
            record = json.loads(training.read_text())
            row.update(record["metrics"], steps=record["settings"]["steps"], wall_time_s=record["wall_time_s"])
        rows.append(row)
    for name in REFERENCES:
        config = reference_config(name)
        rows.append({"name": name, "kind": "reference", "model_type": config["model_type"],
                     "parameters": reference_parameters(config), "path": str(REFERENCE_ROOT / f"{name}.json"),
                     "size_bytes": None})
    return rows
