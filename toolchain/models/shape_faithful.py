"""Random-weight checkpoints with a real model's widths and fewer layers (and experts), for export at real scale,
and a bf16 DeepSeek-V3 checkpoint rewritten in its hub's FP8 layout (write_fp8_checkpoint), for tests."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedConfig

from toolchain.atomic import atomic_output_dir, check_writable_target
from toolchain.checkpoint import v4_layout
from toolchain.checkpoint.fp8 import (
    BLOCK,
    QUANTIZATION_CONFIG,
    Group,
    float32_in_hub_layout,
    plan_shards,
    quantize_fp8,
    quantized_in_hub_layout,
    write_shard,
)
from toolchain.checkpoint.reader import EMBEDDING, FP8, INDEX_FILE, LM_HEAD, SCALE_SUFFIX, open_checkpoint
from toolchain.errors import InputError
from toolchain.export.architectures import ARCHITECTURES, architecture_for
from toolchain.models.registry import embedded_path, reference_config

# Generated in chunks of this many values, so filling a vocabulary-sized matrix needs no second full-size copy.
_CHUNK = 1 << 24
# The real checkpoints' dtype; V3 ships fp8 weights, whose dequantised form is bf16.
_DTYPE = torch.bfloat16
SHARD_BYTES = 2 * 10**9


def reference_to_config(raw: dict, num_layers: int | None = None, num_experts: int | None = None) -> PreTrainedConfig:
    """The installed transformers config for a reference config.json, optionally cut to fewer layers/experts.

    The references use the original checkpoints' RoPE keys (rope_theta, rope_scaling with "type"); transformers
    5 keeps them together in rope_parameters with "rope_type". Their quantization_config is the writer's to set
    (make_shape_faithful), and keys starting with "_" are notes.
    """
    fields = {k: v for k, v in raw.items()
              if k not in ("model_type", "rope_theta", "rope_scaling", "quantization_config") and not k.startswith("_")}
    rope = dict(raw.get("rope_scaling") or {"rope_type": "default"})
    rope["rope_type"] = rope.pop("type", rope.get("rope_type"))
    # transformers validates the YaRN factors as floats; the original configs write some as integers.
    rope.update({k: float(v) for k, v in rope.items()
                 if isinstance(v, int) and k != "original_max_position_embeddings"})
    fields["rope_parameters"] = {**rope, "rope_theta": float(raw.get("rope_theta", 10000.0))}
    if num_layers is not None:
        _cut_layers(fields, num_layers)
    if num_experts is not None:
        _cut_experts(fields, num_experts)
    return AutoConfig.for_model(raw["model_type"], **fields)


def _cut_layers(fields: dict, num_layers: int) -> None:
    if num_layers < 1:
        raise InputError(f"--layers must be at least 1, got {num_layers}")
    layers, fields["num_hidden_layers"] = fields.get("num_hidden_layers"), num_layers
    if "compress_ratios" in fields and isinstance(layers, int) and num_layers < layers:
        # DeepSeek-V4 (0 sliding, 4 CSA, 128 HCA; the shipped order is 0, 0, 4, 128, 4, 128, ...): one sliding layer
        # less, so that three layers have each attention type; and at least one top-k MoE layer after the hash ones
        ratios = fields["compress_ratios"]
        fields["compress_ratios"] = (ratios[:1] + ratios[2:])[:num_layers]
        fields["num_hash_layers"] = min(fields.get("num_hash_layers", 0), max(1, num_layers - 1))
    if "first_k_dense_replace" in fields:
        # Keep the leading dense layers, but leave at least one MoE layer whenever there are two layers or more.
        fields["first_k_dense_replace"] = min(fields["first_k_dense_replace"], max(1, num_layers - 1))


def _cut_experts(fields: dict, num_experts: int) -> None:
    if "n_routed_experts" not in fields:
        raise InputError("--experts applies to mixture-of-experts references only")
    n_group, topk_group = fields.get("n_group") or 1, fields.get("topk_group") or 1
    # DeepSeek-V3 scores a group by its two best experts, so a group needs two; keep the selected share of groups.
    groups = max((g for g in range(1, n_group + 1) if num_experts % g == 0 and num_experts // g >= min(2, n_group)),
                 default=None)
    if num_experts < 1 or num_experts > fields["n_routed_experts"] or groups is None:
        raise InputError(f"--experts must be between 1 and {fields['n_routed_experts']} and allow expert groups "
                         f"of two or more, got {num_experts}")
    kept_groups = max(1, round(topk_group * groups / n_group))
    fields.update(n_routed_experts=num_experts,
                  num_experts_per_tok=min(fields["num_experts_per_tok"], kept_groups * num_experts // groups))
    if "n_group" in fields:  # DeepSeek-V4 routes without groups
        fields.update(n_group=groups, topk_group=kept_groups)


@torch.no_grad()
def _fill_random(tensor: torch.Tensor, name: str, generator: torch.Generator, std: float) -> None:
    if "norm" in name:
        tensor.fill_(1.0)
        return
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK]
        chunk.copy_(torch.randn(chunk.numel(), generator=generator, dtype=torch.float32) * std)


def _shapes(model, tied: bool) -> list[tuple[str, tuple[int, ...], str, int | None, int | None]]:
    """(hub name, shape, state-dict name, expert, half) of every saved tensor, in state-dict order: transformers'
    fused experts as the hub's per-expert tensors (as save_pretrained writes them), a tied lm_head left out."""
    out: list[tuple[str, tuple[int, ...], str, int | None, int | None]] = []
    for name, meta in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if tied and name == "lm_head.weight":
            continue
        if prefix.endswith(".experts") and leaf in ("gate_up_proj", "down_proj") and meta.dim() == 3:
            experts, rows, cols = meta.shape
            for e in range(experts):
                if leaf == "gate_up_proj":
                    out.append((f"{prefix}.{e}.gate_proj.weight", (rows // 2, cols), name, e, 0))
                    out.append((f"{prefix}.{e}.up_proj.weight", (rows // 2, cols), name, e, 1))
                else:
                    out.append((f"{prefix}.{e}.down_proj.weight", (rows, cols), name, e, None))
        else:
            out.append((name, tuple(meta.shape), name, None, None))
    return out


def _write_shards(model, config, directory: Path, generator: torch.Generator, fp8: bool = False,
                  scale_fmt: str = "float") -> None:
    """The weights as safetensors shards of about SHARD_BYTES, each tensor drawn when its shard is written, with
    model.safetensors.index.json when there is more than one: memory holds one shard, not the model. ``fp8``:
    DeepSeek-V3's hub layout (toolchain/checkpoint/fp8.py), each projection weight quantized from its bf16 draw
    as write_fp8_checkpoint quantizes a bf16 checkpoint (``scale_fmt`` "ue8m0": with power-of-two scales, as
    V3.1 and later ship)."""
    from safetensors.torch import save_file

    shapes = _shapes(model, bool(config.tie_word_embeddings))
    shards: list[list[tuple]] = [[]]
    size = 0
    for entry in shapes:
        nbytes = int(np.prod(entry[1])) * (1 if fp8 and quantized_in_hub_layout(entry[0], entry[1]) else 2)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    fused: dict[tuple[str, int], torch.Tensor] = {}
    for file, shard in zip(names, shards):
        tensors = {}
        for hub_name, shape, state_name, expert, half in shard:
            if half is None:
                tensor = torch.empty(shape, dtype=_DTYPE)
                _fill_random(tensor, state_name, generator, config.initializer_range)
            else:  # gate and up rows of one expert are drawn together, as one row block of the fused tensor
                key = (state_name, expert)
                if key not in fused:
                    fused[key] = torch.empty((2 * shape[0], shape[1]), dtype=_DTYPE)
                    _fill_random(fused[key], state_name, generator, config.initializer_range)
                tensor = fused[key][half * shape[0]:(half + 1) * shape[0]].clone()
                if half == 1:
                    del fused[key]
            if fp8 and quantized_in_hub_layout(hub_name, shape):
                tensor, scale = quantize_fp8(tensor, scale_fmt=scale_fmt)
                tensors[hub_name + SCALE_SUFFIX] = scale
                weight_map[hub_name + SCALE_SUFFIX] = file
                total += scale.numel() * 4
            elif fp8 and float32_in_hub_layout(hub_name):
                tensor = tensor.float()
            tensors[hub_name] = tensor
            weight_map[hub_name] = file
            total += tensor.numel() * tensor.element_size()
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
    if len(names) > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _write_v4_shards(model, config, directory: Path, generator: torch.Generator, mtp_layers: int) -> None:
    """DeepSeek-V4 in its hub layout (toolchain/checkpoint/v4_layout.py), tensor by tensor as _write_shards."""
    def draw(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        _fill_random(tensor, name, generator, config.initializer_range)
        return tensor

    tensors = v4_layout.hub_tensors(model) + v4_layout.mtp_tensors(model, mtp_layers)
    shards = plan_shards(v4_layout.groups(tensors, draw, config.n_routed_experts), SHARD_BYTES)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        write_shard(directory / file, shard)
        weight_map.update({name: file for group in shard for name, _, _ in group.specs})
    if len(names) > 1:
        total = sum(group.nbytes for shard in shards for group in shard)
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                        "weight_map": weight_map}, indent=2) + "\n")


def make_shape_faithful(reference: str, out_dir: Path, num_layers: int = 4, num_experts: int | None = None,
                        seed: int = 0, fp8: bool = False, mtp_layers: int = 0) -> Path:
    """Write a seeded random checkpoint of ``reference`` in Hugging Face layout to ``out_dir``.

    Weights are N(0, initializer_range) drawn in fp32 and stored in bf16, norms are ones; the router's
    e_score_correction_bias gets random values too so its path matters. The vocabulary keeps its real size:
    the embedded tokenizer, copied for text I/O, uses only the lowest ids, and ids above it are valid inputs.
    Tensors are drawn and written a shard at a time (R1-Distill-Qwen-7B at 28 layers is 15 GB of bf16).
    ``fp8``: DeepSeek-V3 in its hub's FP8 layout (e4m3 projections with 128 x 128 block scales), the same values
    as write_fp8_checkpoint makes of the bf16 checkpoint, without writing that first (V3's real widths at 4
    layers: 17 GB instead of 30 + 17). DeepSeek-V3.2 and V4 are always written in their hub layouts: V3.2 as V3's
    with power-of-two scales and its indexer (wq_b and wk in e4m3), V4 as toolchain/checkpoint/v4_layout.py
    describes, with ``mtp_layers`` multi-token-prediction blocks.
    """
    raw = reference_config(reference)
    model_type = raw.get("model_type")
    if fp8 and architecture_for(model_type).hub_layout != "fp8":
        raise InputError(f"--fp8 writes DeepSeek-V3's hub layout; {reference} is {model_type}")
    config = reference_to_config(raw, num_layers, num_experts)
    scale_fmt = (raw.get("quantization_config") or {}).get("scale_fmt", "float")
    return write_random_checkpoint(config, out_dir, seed, fp8, scale_fmt, mtp_layers)


def write_random_checkpoint(config: PreTrainedConfig, out_dir: Path, seed: int = 0, fp8: bool = False,
                            scale_fmt: str = "float", mtp_layers: int = 0) -> Path:
    """make_shape_faithful's checkpoint of a supported architecture's transformers ``config``, in the layout its
    architecture module names (Architecture.hub_layout): bf16, or (``fp8``) DeepSeek-V3's FP8 hub layout with
    ``scale_fmt`` scales, which DeepSeek-V3.2 is always written in; DeepSeek-V4 always in its own."""
    model_type = config.model_type
    arch = architecture_for(model_type)
    fp8 = fp8 or (arch.hub_layout == "fp8" and not arch.bf16_unless_asked)
    if mtp_layers and arch.hub_layout != "v4":
        raise InputError(f"multi-token-prediction blocks are written for DeepSeek-V4 only, not {model_type}")
    check_writable_target(out_dir)  # before drawing a model that may take minutes
    config.dtype = _DTYPE
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPE)
    generator = torch.Generator().manual_seed(seed)
    # Written beside the target and renamed into place: an existing checkpoint there is replaced only if dstc
    # wrote it, and never left half-overwritten.
    with atomic_output_dir(Path(out_dir)) as tmp:
        if arch.hub_layout == "v4":
            _write_v4_shards(model, config, tmp, generator, mtp_layers)
            config.quantization_config = {**v4_layout.QUANTIZATION_CONFIG, "expert_dtype": "fp4"}
            config.num_nextn_predict_layers = mtp_layers
        else:
            _write_shards(model, config, tmp, generator, fp8, scale_fmt)
            if fp8:
                config.quantization_config = {**QUANTIZATION_CONFIG} if scale_fmt == "float" else \
                    {**QUANTIZATION_CONFIG, "scale_fmt": scale_fmt}
        config.architectures = [type(model).__name__]  # as save_pretrained records it (optimum-cli reads it)
        config.save_pretrained(tmp)
        GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(tmp)
        tokenizer_dir = embedded_path("r1-distill-qwen-tiny")
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_dir / file, tmp / file)
    return Path(out_dir)


def write_fp8_checkpoint(src_dir: str | Path, dst_dir: str | Path, shard_bytes: int = 5 * 10**9,
                         mtp_layers: int = 0, seed: int = 0) -> Path:
    """Write the bf16/fp32 DeepSeek-V3 checkpoint ``src_dir`` to ``dst_dir`` in the hub's FP8 layout
    (toolchain/checkpoint/fp8.py). MTP layers copy the last decoder layer's weights; their eh_proj is seeded
    random."""
    with open_checkpoint(src_dir) as reader:
        config = dict(reader.config)
        arch = ARCHITECTURES.get(config.get("model_type", ""))
        if arch is None or arch.hub_layout != "fp8" or not arch.bf16_unless_asked:  # V3.2's own is not V3's
            raise InputError(f"{src_dir}: the FP8 hub layout is DeepSeek-V3's, not {config.get('model_type')!r}")
        groups = _groups(reader, config, mtp_layers, torch.Generator().manual_seed(seed))
        shards = plan_shards(groups, shard_bytes)
        config.update(quantization_config=QUANTIZATION_CONFIG, num_nextn_predict_layers=mtp_layers, dtype="bfloat16")
        with atomic_output_dir(Path(dst_dir)) as tmp:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                write_shard(tmp / file, shard)
                weight_map.update({name: file for group in shard for name, _, _ in group.specs})
            index = {"metadata": {"total_size": sum(g.nbytes for g in groups)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            for extra in Path(src_dir).iterdir():  # tokenizer and generation config
                if extra.is_file() and not extra.name.startswith(".") and extra.suffix != ".safetensors" \
                        and extra.name not in ("config.json", INDEX_FILE):
                    shutil.copyfile(extra, tmp / extra.name)
    return Path(dst_dir)


def _groups(reader, config: dict, mtp_layers: int, generator: torch.Generator) -> list[Group]:
    def stored(name: str, source: str | None = None) -> Group:
        source = source or name
        shape = reader.shape(source)
        if quantized_in_hub_layout(name, shape):
            grid = (math.ceil(shape[0] / BLOCK[0]), math.ceil(shape[1] / BLOCK[1]))
            return Group([(name, FP8, shape), (name + SCALE_SUFFIX, torch.float32, grid)],
                          lambda: list(quantize_fp8(reader.tensor(source))))
        dtype = torch.float32 if float32_in_hub_layout(name) else torch.bfloat16
        return Group([(name, dtype, shape)], lambda: [reader.tensor(source, dtype=dtype)])

    def made(name: str, shape: tuple[int, ...], fill: Callable[[], torch.Tensor]) -> Group:
        return Group([(name, torch.bfloat16, shape)], lambda: [fill().to(torch.bfloat16)])

    groups = [stored(name) for name in reader.names() if not (reader.tied and name == LM_HEAD)]
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    last = f"model.layers.{layers - 1}."
    std = config.get("initializer_range", 0.02)
    for index in range(layers, layers + mtp_layers):
        prefix = f"model.layers.{index}."
        groups += [stored(prefix + name[len(last):], name) for name in reader.names() if name.startswith(last)]
        groups += [
            stored(prefix + "embed_tokens.weight", EMBEDDING),
            made(prefix + "enorm.weight", (hidden,), lambda: torch.ones(hidden)),
            made(prefix + "hnorm.weight", (hidden,), lambda: torch.ones(hidden)),
            made(prefix + "eh_proj.weight", (hidden, 2 * hidden),
                 lambda: torch.randn(hidden, 2 * hidden, generator=generator) * std),
            stored(prefix + "shared_head.norm.weight", "model.norm.weight"),
            stored(prefix + "shared_head.head.weight", LM_HEAD),
        ]
    return groups
