"""Finding and loading a source checkpoint: an embedded name, a local directory, or a hub id in the local cache.

Everything a user can get wrong is checked here, before any output is written, and reported as one InputError.
Nothing is ever downloaded: the CLI runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import InputError
from toolchain.memory_guard import require_reference_memory
from toolchain.models.registry import EMBEDDED, embedded_path
from toolchain.quiet_transformers import quiet_transformers


@dataclass(frozen=True)
class Source:
    spec: str  # what the user typed
    path: Path
    kind: str  # "embedded" | "directory" | "hf-cache"
    config: dict


def resolve(spec: str, revision: str | None = None, hint: str = "--model DIR") -> Source:
    """Find the checkpoint; with a revision (a recipe's pinned commit), only that snapshot of a cached hub id.
    ``hint``: the option that names another checkpoint instead, for the message when it is not cached."""
    path, kind = locate(spec, revision, hint)
    return Source(spec, path, kind, _read_config(path, spec))


def locate(spec: str, revision: str | None = None, hint: str = "--model DIR") -> tuple[Path, str]:
    """The checkpoint's directory and kind, as ``resolve`` finds them, before its config is read and checked."""
    if revision and not _looks_like_hub_id(spec):
        raise InputError(f"{spec}: a pinned revision needs a hub id (org/name) in the local Hugging Face cache")
    if spec in EMBEDDED:
        return embedded_path(spec), "embedded"
    if Path(spec).exists() and not revision:
        if not Path(spec).is_dir():
            raise InputError(f"{spec} is a file, not a model directory")
        return Path(spec), "directory"
    if _looks_like_hub_id(spec):
        return _from_hf_cache(spec, revision, hint), "hf-cache"
    raise InputError(f"{spec}: no such directory, and not an embedded model ({', '.join(sorted(EMBEDDED))})")


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
                         f"download it first (hf download {repo_id}"
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
                   "topk_group", "decoder_sparse_step")


def _check_config(config: dict, config_file: Path) -> None:
    """Types through transformers' own config class (its strict fields), then the sizes it accepts but no model
    can have; one line naming the field."""
    # torch and the exporter load only once a config is checked: a build hashes the checkpoint meanwhile
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


def skeleton(source: Source, reader):
    """The transformers model of the checkpoint on the meta device (structure and attributes, no weights), checked
    against the tensors ``reader`` holds: every weight present with the shape the config implies."""
    # torch, transformers and the exporter load only where a model is built
    import torch
    from transformers import AutoModelForCausalLM

    from toolchain.export.architectures import architecture_for
    from toolchain.export.reference import reference_config

    arch = architecture_for(source.config["model_type"])
    config = reference_config(source.path)
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
    expected: dict[str, tuple[int, ...]] = {}
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


def load(source: Source):
    """The whole model in fp32 with eager attention, the reference the exported graph is compared with: the
    skeleton given every weight by dstc's checkpoint reader, exactly the values the exporter writes (FP8 weights
    dequantized to bf16, as DeepSeek's own cast does; transformers cannot load the FP8 hub format on a CPU).
    Transformers' own implementation of the architecture is used, never code shipped with the checkpoint.
    InputError before anything is read when it would not fit in the memory available (toolchain/memory_guard.py)."""
    # torch loads only where the model is built
    from toolchain.checkpoint.reader import open_checkpoint
    from toolchain.export.reference import load_weights, with_computed_buffers

    require_reference_memory(source.path, source.spec)
    with open_checkpoint(source.path) as reader:
        model = skeleton(source, reader)
        load_weights(model, reader, "")
    with_computed_buffers(model)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"tensors left without values after loading {source.spec}: {', '.join(left[:3])}")
    return model.eval()
