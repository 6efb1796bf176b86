"""What `dstc models list` shows: each embedded model with its size and training metrics, and each real model's
reference config with its parameter count."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from toolchain.export.reference import reference_config as checkpoint_config
from toolchain.models.parameters import parameter_count
from toolchain.models.registry import EMBEDDED, REFERENCE_ROOT, REFERENCES, embedded_path, reference_config
from toolchain.models.shape_faithful import reference_to_config
from toolchain.quiet_transformers import quiet_transformers


def model_parameters(config) -> int:
    """Parameters (toolchain/models/parameters.py) of the model a transformers config describes, counted on
    the meta device: nothing is allocated, whatever the size."""
    with torch.device("meta"), quiet_transformers():
        model = AutoModelForCausalLM.from_config(config)
    return parameter_count(model)


def list_embedded() -> list[dict]:
    """One row per embedded model (with its training.json metrics when present), then one per reference."""
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
