"""Finding and loading a source checkpoint: an embedded name, a local directory, or a hub id in the local cache.

Everything a user can get wrong is checked here, before any output is written, and reported as one InputError.
Nothing is ever downloaded: the CLI runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from toolchain.errors import InputError, UnsupportedModelError


@dataclass(frozen=True)
class Source:
    spec: str  # what the user typed
    path: Path
    kind: str  # "embedded" | "directory" | "hf-cache"
    config: dict


def resolve(spec: str, revision: str | None = None, hint: str = "--model DIR") -> Source:
    """Find the checkpoint; with a revision (a recipe's pinned commit), only that snapshot of a cached hub id.
    ``hint``: the option that names another checkpoint instead, for the message when it is not cached."""
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
        path, kind = _from_hf_cache(spec, revision, hint), "hf-cache"
    else:
        raise InputError(f"{spec}: no such directory, and not an embedded model ({', '.join(sorted(EMBEDDED))})")
    return Source(spec, path, kind, _read_config(path, spec))


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def _from_hf_cache(repo_id: str, revision: str | None, hint: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        at = f" at revision {revision}" if revision else ""
        raise InputError(f"{repo_id}{at} is not in the local Hugging Face cache, and dstc never downloads: "
                         f"download it first (huggingface-cli download {repo_id}"
                         f"{' --revision ' + revision if revision else ''}) or pass {hint}") from None


def _read_config(path: Path, spec: str) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(f"{spec} is not a model directory: no config.json in {path}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f"{config_file} has no model_type")
    _check_config(config, config_file)
    return config


# Sizes and counts that must be positive integers where a config gives them (first_k_dense_replace may be 0).
POSITIVE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim",
                   "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                   "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group",
                   "topk_group")


def _check_config(config: dict, config_file: Path) -> None:
    """Types through transformers' own config class (its strict fields), then the sizes it accepts but no model
    can have; one line naming the field."""
    from toolchain.export.architectures import ARCHITECTURES

    if config["model_type"] not in ARCHITECTURES:
        return  # the exporter refuses it with the list of supported types
    for name in POSITIVE_FIELDS:
        value = config.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{config_file}: {name} must be a positive integer, not {value!r}")
    first_dense = config.get("first_k_dense_replace")
    if first_dense is not None and (not isinstance(first_dense, int) or first_dense < 0):
        raise InputError(f"{config_file}: first_k_dense_replace must be an integer >= 0, not {first_dense!r}")
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            AutoConfig.for_model(**config)
    except Exception as e:  # transformers raises several types for a field of the wrong type or value
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise InputError(f"{config_file}: {' '.join(lines[:2]) or type(e).__name__}") from None


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


def transformers_config(source: Source):
    """The transformers config of the checkpoint, as the fp32 eager reference runs it: a quantization_config (the
    FP8 hub format) describes how the weights are stored, which the checkpoint reader undoes, not the model."""
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(source.path)
    except (OSError, ValueError, TypeError) as e:
        raise InputError(f"cannot read the config of {source.spec}: {str(e).splitlines()[0]}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def skeleton(source: Source, reader):
    """The transformers model of the checkpoint on the meta device (structure and attributes, no weights), checked
    against the tensors ``reader`` holds: every weight present with the shape the config implies."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolchain.export.architectures import architecture_for

    arch = architecture_for(source.config["model_type"])
    config = transformers_config(source)
    try:
        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    except (ValueError, RuntimeError, TypeError) as e:
        raise InputError(f"cannot build {source.spec} from its config.json: {str(e).splitlines()[0]}") from None
    _check_tensors(source, model, reader)
    arch.fix_reference(model)
    return model.eval()


def _expected_tensors(model) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every weight the model needs (fused experts as the hub's per-expert names)."""
    expected = {}
    for name, t in model.state_dict(keep_vars=True).items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and prefix.endswith(".experts") and t.dim() == 3:
            experts, rows, cols = t.shape
            for e in range(experts):
                if leaf == "gate_up_proj":
                    expected[f"{prefix}.{e}.gate_proj.weight"] = expected[f"{prefix}.{e}.up_proj.weight"] = \
                        (rows // 2, cols)
                else:
                    expected[f"{prefix}.{e}.down_proj.weight"] = (rows, cols)
        else:
            expected[name] = tuple(t.shape)
    return expected


def _check_tensors(source: Source, model, reader) -> None:
    expected = _expected_tensors(model)
    missing = sorted(n for n in expected if not reader.has(n))
    if missing:
        raise InputError(f"{source.spec}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    wrong = sorted(n for n, shape in expected.items() if tuple(reader.shape(n)) != shape)
    if wrong:
        name = wrong[0]
        raise InputError(f"{source.spec}: the weights do not fit its config.json: {name} is "
                         f"{list(reader.shape(name))} in the checkpoint, the config implies {list(expected[name])}"
                         + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' load report, warnings and progress bar off: they repeat, in 10-15 lines on stderr, what a
    one-line error says (and say nothing when all is well)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def load(source: Source, trust_remote_code: bool = False):
    """The model in fp32 with eager attention (the reference the exported graph is compared with)."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolchain.export.architectures import architecture_for

    arch = architecture_for(source.config["model_type"])
    check_weights(source)
    try:
        with quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=torch.float32, attn_implementation="eager", trust_remote_code=trust_remote_code,
                output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        raise InputError(f"cannot load {source.spec}: {str(e).splitlines()[0]}") from None
    mismatched = sorted(info.get("mismatched_keys", ()))
    if mismatched:
        name, found, expected = mismatched[0]
        raise InputError(f"{source.spec}: the weights do not fit its config.json: {name} is {list(found)} in the "
                         f"checkpoint, the config implies {list(expected)}"
                         + (f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""))
    missing = [k for k in info.get("missing_keys", ()) if k != "lm_head.weight" or not model.config.tie_word_embeddings]
    if missing:
        raise InputError(f"{source.spec}: weights missing from the checkpoint: {', '.join(sorted(missing)[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    if not type(model).__module__.startswith("transformers.models."):
        raise UnsupportedModelError(f"{source.spec}: the graph builder needs transformers' own implementation "
                                    f"of {source.config['model_type']}, not remote code")
    arch.fix_reference(model)
    return model.eval()
