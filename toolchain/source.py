"""Finding and loading a source checkpoint: an embedded name, a local directory, or a hub id in the local cache.

Everything a user can get wrong is checked here, before any output is written, and reported as one InputError.
Nothing is ever downloaded: the CLI runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import InputError, UnsupportedModelError


@dataclass(frozen=True)
class Source:
    spec: str  # what the user typed
    path: Path
    kind: str  # "embedded" | "directory" | "hf-cache"
    config: dict


def resolve(spec: str, revision: str | None = None) -> Source:
    """Find the checkpoint; with a revision (a recipe's pinned commit), only that snapshot of a cached hub id."""
    from toolchain.models.registry import EMBEDDED, embedded_path

    if revision and not _looks_like_hub_id(spec):
        raise InputError(f"{spec}: a pinned revision needs a hub id (org/name) in the local Hugging Face cache")
    if spec in EMBEDDED:
        path, kind = embedded_path(spec), "embedded"
    elif Path(spec).exists() and not revision:
        path, kind = Path(spec), "directory"
        if not path.is_dir():
            raise InputError(f"{spec} is a file, not a model directory")
    elif _looks_like_hub_id(spec):
        path, kind = _from_hf_cache(spec, revision), "hf-cache"
    else:
        raise InputError(f"{spec}: no such directory, and not an embedded model ({', '.join(sorted(EMBEDDED))})")
    return Source(spec, path, kind, _read_config(path, spec))


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def _from_hf_cache(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        at = f" at revision {revision}" if revision else ""
        raise InputError(f"{repo_id}{at} is not in the local Hugging Face cache, and dstc never downloads: "
                         f"download it first (huggingface-cli download {repo_id}"
                         f"{' --revision ' + revision if revision else ''}) or pass --model DIR") from None


def _read_config(path: Path, spec: str) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(f"{spec} is not a model directory: no config.json in {path}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise InputError(f"{config_file} has no model_type")
    return config


def check_weights(source: Source) -> list[Path]:
    """The checkpoint's safetensors files, each with a readable header."""
    from safetensors import safe_open

    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise InputError(f"{source.spec}: no *.safetensors weights in {source.path}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises several types for a damaged header
            raise InputError(f"{file} is not a readable safetensors file: {e}") from None
    return files


def load(source: Source, trust_remote_code: bool = False):
    """The model in fp32 with eager attention (the reference the exported graph is compared with)."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolchain.export.architectures import architecture_for

    arch = architecture_for(source.config["model_type"])
    check_weights(source)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source.path, dtype=torch.float32, attn_implementation="eager", trust_remote_code=trust_remote_code,
            output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise InputError(f"cannot load {source.spec}: {str(e).splitlines()[0]}") from None
    missing = [k for k in info.get("missing_keys", ()) if k != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing:
        raise InputError(f"{source.spec}: weights missing from the checkpoint: {', '.join(sorted(missing)[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    if not type(model).__module__.startswith("transformers.models."):
        raise UnsupportedModelError(f"{source.spec}: the graph builder needs transformers' own implementation "
                                    f"of {source.config['model_type']}, not remote code")
    arch.fix_reference(model)
    return model.eval()
