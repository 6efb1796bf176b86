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
    "deepseek-v32-tiny": "deepseek_v32",
    "deepseek-v4-tiny": "deepseek_v4",
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
