"""A checkpoint's tensor names as transformers' module names, by transformers' own conversion mapping.

DeepSeek-V4's hub checkpoint keeps DeepSeek's names (``layers.0.attn.wq_a.weight``, ``layers.0.ffn.experts.3.w1
.weight``, ``embed.weight``), which transformers renames while it loads (``conversion_mapping.py``, read here at
run time, with ``core_model_loading.rename_source_key`` and the model's own prefix rule). Its WeightConverters merge
the per-expert tensors into fused ``gate_up_proj`` / ``down_proj``; the reader keeps experts apart, under the names
dstc's exporters ask for with every DeepSeek model: ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``
(the first source of ``gate_up_proj`` is its gate half, as transformers concatenates them).

DeepSeek-V4's multi-token-prediction blocks (``mtp.N.``), which transformers does not load, are given the names
dstc's MTP exporter reads (``mtp_module_name``; toolchain/export/deepseek_v4_mtp_reference.py).

Model types whose mapping only fuses experts (DeepSeek-V2/V3/V3.2) have hub names that are already the module
names and are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from toolchain.errors import InputError
from toolchain.quiet_transformers import quiet_transformers

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# an MTP block's own tensors (beside its layer's) -> their module names in the MTP reference's layer
MTP_MODULES = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
               "hnorm.weight": "hnorm.weight", "norm.weight": "shared_head.norm.weight",
               "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_MTP_BLOCK = re.compile(r"(?:model\.)?mtp\.(\d+)\.(.*)")


def mtp_module_name(name: str, layers: int) -> str | None:
    """``model.layers.{layers + N}.<module>`` of MTP block N's own tensor ``name`` (``mtp.N.e_proj.weight``);
    None for the block's layer tensors, which are renamed as a layer's."""
    match = _MTP_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in MTP_MODULES:
        return None
    return f"model.layers.{layers + int(match.group(1))}.{MTP_MODULES[match.group(2)]}"


def module_names(path: Path, config: dict, names: list[str]) -> dict[str, str] | None:
    """checkpoint name -> module name for each of ``names``, or None when the checkpoint's model type has no
    renaming in transformers. ``path``: the checkpoint directory (its config.json builds the model's skeleton,
    whose parameter names decide the ``model.`` prefix as transformers decides it)."""
    model_type = config.get("model_type")
    transforms = _transforms(model_type) if isinstance(model_type, str) else None
    if transforms is None:
        return None
    parameters, prefix = _skeleton_names(path)
    return _rename(names, transforms, parameters, prefix)


def model_module_names(model, names: list[str]) -> dict[str, str]:
    """checkpoint name -> module name of transformers model ``model`` (a writer's check of its hub names)."""
    transforms = _transforms(model.config.model_type)
    if transforms is None:
        return {name: name for name in names}
    return _rename(names, transforms, dict.fromkeys(model.state_dict(), True), model.base_model_prefix)


def _transforms(model_type: str) -> tuple[list, list] | None:
    """(WeightRenamings, WeightConverters) of ``model_type`` in transformers, None when nothing is renamed."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_checkpoint_conversion_mapping(model_type)
    renamings = [t for t in mapping or [] if isinstance(t, WeightRenaming)]
    if not renamings:
        return None
    return renamings, [t for t in mapping or [] if isinstance(t, WeightConverter)]


def _rename(names: list[str], transforms: tuple[list, list], parameters: dict[str, bool],
            prefix: str) -> dict[str, str]:
    from transformers.core_model_loading import rename_source_key

    renamings, converters = transforms
    out = {}
    for name in names:
        module, source = rename_source_key(name, renamings, converters, prefix, parameters)
        if module not in parameters and name in parameters:
            # already a module name that a renaming matches by accident (transformers saves V4's final norm as
            # model.norm.weight, which `.norm.` -> `.kv_norm.` renames): kept, as transformers' loader keeps it
            module, source = rename_source_key(name, [], [], prefix, parameters)
        if source is not None:
            module = _per_expert(name, module, source, converters, renamings)
        out[name] = module
    return out


def _per_expert(name: str, fused: str, source: str, converters: list, renamings: list) -> str:
    """The per-expert module name of a checkpoint tensor that a converter would merge into ``fused``."""
    from transformers.core_model_loading import apply_renamings

    head, _, leaf = fused.rpartition(".")
    expert = _EXPERT.search(apply_renamings(name, renamings))
    converter = next(c for c in converters if source in c.source_patterns)
    parts = _FUSED_PARTS.get(leaf)
    if expert is None or parts is None or len(parts) != len(converter.source_patterns):
        raise ValueError(f"transformers merges {name} into {fused}, which dstc does not split per expert")
    return f"{head}.{expert.group(1)}.{parts[converter.source_patterns.index(source)]}.weight"


def _skeleton_names(path: Path) -> tuple[dict[str, bool], str]:
    """(the parameter and buffer names of the checkpoint's causal LM, built on the meta device; its
    base_model_prefix)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers raises several types for a field of the wrong type or value
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path / 'config.json'} does not load in transformers: {message}") from None
    return dict.fromkeys(model.state_dict(), True), model.base_model_prefix

