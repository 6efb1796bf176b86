"""The PyTorch reference of a checkpoint, built one decoder layer at a time from a CheckpointReader.

``toolchain.source.load`` builds the whole model in fp32, which a 7B, 16B or 671B checkpoint does not fit in. Here
each piece is transformers' own module (e.g. ``DeepseekV3DecoderLayer``, the model's rotary embedding and norm),
created on the meta device and given its weights from the reader with ``load_state_dict(assign=True)``, so that
only one layer's weights exist at a time; ``logits`` runs a prompt through them with transformers' own mask code,
the way the model's forward does, and agrees with the whole model loaded by ``from_pretrained``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from toolchain import hardware
from toolchain.checkpoint.experts_on_demand import ExpertsOnDemand
from toolchain.checkpoint.reader import EMBEDDING, CheckpointReader, open_checkpoint, read_config
from toolchain.errors import InputError
from toolchain.export.architectures import architecture_for
from toolchain.quiet_transformers import quiet_transformers

M = TypeVar("M", bound=nn.Module)


def reference_config(path: str | Path):
    """The transformers config of the checkpoint as the reference runs it: fp32, eager attention, without its
    quantization_config (the reader dequantizes)."""
    from transformers import AutoConfig

    raw = {k: v for k, v in read_config(Path(path)).items() if k != "quantization_config"}
    arch = architecture_for(raw.get("model_type"))  # UnsupportedModelError for any other model_type
    try:
        with quiet_transformers():
            config = AutoConfig.for_model(**raw)
    except Exception as e:  # transformers raises several types for a field of the wrong type or value
        raise InputError(f"{Path(path) / 'config.json'}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
    config.dtype = torch.float32
    config._attn_implementation = "eager"
    # What from_pretrained picks for experts that have a choice of implementation (every MoE family's); a dense
    # model's class refuses the setting.
    if arch.moe_layers(config):
        config._experts_implementation = "grouped_mm"
    return config


@functools.cache
def cache_argument() -> str:
    """The name of the KV-cache argument of transformers' models, decoder layers and mask functions: ``cache``
    since transformers 5.24 (the old ``past_key_values`` still works there, with a warning), ``past_key_values``
    in 5.5."""
    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def is_moe(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers MoE block (its router ``gate`` and its routed ``experts``)."""
    return hasattr(module, "gate") and hasattr(module, "experts")


def watch_expert_choice(moe: nn.Module, record: Callable[[np.ndarray], None]) -> Callable[[], None]:
    """Call ``record(indices)`` ([tokens, top_k] int64) each time the MoE layer ``moe`` routes tokens; returns what
    stops it. transformers 5.24 routes in the ``gate`` module, whose outputs are (logits, weights, indices); 5.5 in
    the layer's own ``route_tokens_to_experts``, which returns (indices, weights)."""
    route = getattr(moe, "route_tokens_to_experts", None)
    if route is None:
        gate: nn.Module = moe.gate  # type: ignore[assignment]
        hook = gate.register_forward_hook(lambda _module, _inputs, out: record(out[2].numpy().astype(np.int64)))
        return hook.remove

    def wrapped(router_logits):
        indices, weights = route(router_logits)
        record(indices.numpy().astype(np.int64))
        return indices, weights

    setattr(moe, "route_tokens_to_experts", wrapped)  # noqa: B010  (nn.Module's attribute type is Tensor | Module)
    return lambda: setattr(moe, "route_tokens_to_experts", route)


def _module_class(config, name: str) -> type:
    """transformers' ``<Prefix><name>`` class of the model type, the prefix its causal LM's class name has
    (Qwen3MoeForCausalLM: Qwen3MoeDecoderLayer)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return getattr(module, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type].removesuffix("ForCausalLM") + name)


def load_weights(module: M, reader: CheckpointReader, prefix: str) -> M:
    """Give a meta-device module its weights: ``prefix + key`` for each of its state-dict keys, transformers'
    fused experts assembled from the per-expert tensors one expert at a time. Each tensor is read in the dtype
    that holds it exactly (bf16 for bf16 and FP8 checkpoints) and widened to fp32: the values the exporter
    writes."""
    state = {}
    for key, meta in module.state_dict().items():
        experts, _, fused = key.rpartition(".")
        if experts.endswith("mlp.experts") and fused in _FUSED_PARTS:
            state[key] = _fused_experts(reader, prefix + experts, _FUSED_PARTS[fused], tuple(meta.shape))
        else:
            _check_shape(reader, prefix + key, tuple(meta.shape))
            state[key] = _read(reader, prefix + key)
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


# transformers' fused expert tensors: [E, 2I, H] gate_up_proj (gate rows first) and [E, H, I] down_proj
_FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _fused_experts(reader: CheckpointReader, prefix: str, parts: tuple[str, ...], shape: tuple[int, ...],
                   experts: list[int] | None = None):
    """The fused tensor of ``experts`` (all by default), in that order: [len(experts), *shape[1:]]."""
    experts = list(range(shape[0])) if experts is None else experts
    fused = torch.empty((len(experts), *shape[1:]))
    rows = shape[1] // len(parts)
    for k, e in enumerate(experts):
        for j, proj in enumerate(parts):
            name = f"{prefix}.{e}.{proj}.weight"
            _check_shape(reader, name, (rows, shape[2]))
            fused[k, j * rows:(j + 1) * rows] = _read(reader, name)
    return fused


def experts_on_demand(moe: nn.Module, reader: CheckpointReader, prefix: str, at_once: int) -> None:
    """Replace the meta-device routed experts of the MoE block ``moe`` (``prefix``: its experts' names, e.g.
    ``model.layers.3.mlp.experts``) with ExpertsOnDemand, which reads them from ``reader`` ``at_once`` at a
    time as tokens hit them."""
    template: nn.Module = moe.experts  # type: ignore[assignment]
    shapes = {name: tuple(p.shape) for name, p in template.named_parameters() if name in _FUSED_PARTS}

    def load(experts: list[int]) -> dict[str, torch.Tensor]:
        return {name: _fused_experts(reader, prefix, _FUSED_PARTS[name], shape, experts)
                for name, shape in shapes.items()}

    moe.experts = ExpertsOnDemand(template, load, at_once)


def _read(reader: CheckpointReader, name: str) -> torch.Tensor:
    return reader.tensor(name, reader.natural_dtype(name)).to(torch.float32)


def _check_shape(reader: CheckpointReader, name: str, expected: tuple[int, ...]) -> None:
    if reader.shape(name) != expected:
        raise InputError(f"{reader.path}: the weights do not fit its config.json: {name} is "
                         f"{list(reader.shape(name))} in the checkpoint, the config implies {list(expected)}")


def embeddings(reader: CheckpointReader) -> nn.Embedding:
    return nn.Embedding.from_pretrained(_read(reader, EMBEDDING), freeze=True)


def largest_layer(path: str | Path) -> tuple[int, int]:
    """(index, fp32 bytes) of the decoder layer whose reference module is largest: what building one layer at a
    time holds at most (from the checkpoint's headers; a layer's tensors are ``model.layers.N.*``)."""
    sizes: dict[int, int] = {}
    with open_checkpoint(path) as reader:
        for name in reader.names():
            parts = name.split(".")
            if name.startswith("model.layers.") and parts[2].isdigit():
                sizes[int(parts[2])] = sizes.get(int(parts[2]), 0) + math.prod(reader.shape(name)) * 4
    index = max(sizes, key=lambda i: sizes[i], default=0)
    return index, sizes.get(index, 0)


def layer_too_large(path: str | Path, factor: float, what: str) -> str | None:
    """Why ``what`` (which holds ``factor`` x the largest layer's fp32 reference) does not run on this machine,
    or None."""
    index, size = largest_layer(path)
    need, ram = factor * size, hardware.memory_bytes()
    if need <= ram:
        return None
    return (f"{what} builds each decoder layer's transformers module in fp32, and layer {index}'s is "
            f"{size / 2**30:.1f} GiB: about {need / 2**30:.1f} GiB with what runs beside it ({factor:g}x), more "
            f"than this machine's {ram / 2**30:.1f} GiB")


def rotary_embedding(config) -> nn.Module:
    """The model's rotary module (cos/sin, or V2's complex frequencies, from position ids)."""
    return _module_class(config, "RotaryEmbedding")(config=config).eval()


def shared_decoder_layers(model_type: str) -> bool:
    """Whether the architecture's layers are those of the shared decoder skeleton (toolchain/export/decoder.py: one
    hidden stream, one rotary, a mask per layer type), which the layer-by-layer references run one at a time;
    DeepSeek-V4 builds its own graph (hyper-connection streams, per-type rotaries, hash routing by input ids)."""
    return getattr(architecture_for(model_type), "build_graph", None) is None


def with_computed_buffers(module: M) -> M:
    """``module`` with every rotary embedding inside it that is still on the meta device built on the CPU from its
    config: their buffers are computed, not stored (the model's own, and DeepSeek-V4's compressors' and indexers')."""
    for name, child in list(module.named_modules()):
        if name and type(child).__name__.endswith("RotaryEmbedding") and \
                any(b.is_meta for b in child.buffers(recurse=False)):
            parent, _, leaf = name.rpartition(".")
            with torch.device("cpu"):
                module.get_submodule(parent).register_module(leaf, type(child)(config=child.config).eval())
    return module


def decoder_layer(config, reader: CheckpointReader, i: int, experts_at_once: int | None = None) -> nn.Module:
    """Decoder layer ``i`` with its weights, fixed where transformers 5.5's own forward is broken (as
    ``toolchain.source.load`` fixes the whole model). ``experts_at_once``: its routed experts are not built
    with it but read when tokens hit them, that many at a time (experts_on_demand)."""
    with torch.device("meta"):
        layer = _module_class(config, "DecoderLayer")(config, i)
    if experts_at_once is not None:
        for name, module in layer.named_modules():
            if is_moe(module):
                experts_on_demand(module, reader, f"model.layers.{i}.{name}.experts", experts_at_once)
    with_computed_buffers(load_weights(layer, reader, f"model.layers.{i}."))
    architecture_for(config.model_type).fix_reference(SimpleNamespace(config=config,
                                                                      model=SimpleNamespace(layers=[layer])))
    return layer


def final_norm(config, reader: CheckpointReader) -> nn.Module:
    with torch.device("meta"):
        norm = _module_class(config, "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
    return load_weights(norm, reader, "model.norm.")


def final_norm_and_head(config, reader: CheckpointReader) -> tuple[nn.Module, nn.Linear]:
    with torch.device("meta"):
        norm = _module_class(config, "RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return load_weights(norm, reader, "model.norm."), load_weights(head, reader, "lm_head.")


@torch.no_grad()
def logits(path: str | Path, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
           on_layer=None) -> torch.Tensor:
    """The fp32 logits [batch, sequence, vocab] of a prompt (no KV cache), one layer in memory at a time, as the
    model's forward computes them: position ids 0..n-1, transformers' causal mask over ``attention_mask``.
    ``on_layer(i, n)`` is called after each of the n layers."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = reference_config(path)
    if not shared_decoder_layers(config.model_type):
        return _logits_of_own_forward(path, config, input_ids, attention_mask, on_layer)
    with open_checkpoint(path) as reader:
        hidden = embeddings(reader)(input_ids)
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
        mask_args = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, position_ids=position_ids,
                         **{cache_argument(): None})
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        masks = {"full_attention": create_causal_mask(**mask_args)}
        if "sliding_attention" in layer_types:  # Qwen2 with use_sliding_window
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_args)
        if "indexed_attention" in layer_types:  # DeepSeek-V3.2: its indexer reads the mask, which is always built
            masks["indexed_attention"] = create_causal_mask(**mask_args, allow_is_causal_skip=False)
        position_embeddings = rotary_embedding(config)(hidden, position_ids)
        for i in range(config.num_hidden_layers):
            layer = decoder_layer(config, reader, i)
            hidden = layer(hidden, attention_mask=masks[layer_types[i]], position_ids=position_ids,
                           position_embeddings=position_embeddings)
            del layer  # its weights go before the next layer's are read
            if on_layer:
                on_layer(i + 1, config.num_hidden_layers)
        norm, head = final_norm_and_head(config, reader)
        return head(norm(hidden))


class _LayerFromReader(nn.Module):
    """Decoder layer ``i``, built from the reader when it is called and let go when it returns."""

    def __init__(self, config, reader: CheckpointReader, i: int, on_layer) -> None:
        super().__init__()
        self.config, self.reader, self.i, self.on_layer = config, reader, i, on_layer

    def forward(self, *args, **kwargs):
        out = decoder_layer(self.config, self.reader, self.i)(*args, **kwargs)
        if self.on_layer:
            self.on_layer(self.i + 1, self.config.num_hidden_layers)
        return out


def _logits_of_own_forward(path, config, input_ids, attention_mask, on_layer) -> torch.Tensor:
    """``logits`` of an architecture whose layers are not the shared decoder's (DeepSeek-V4: hyper-connection
    streams, per-type rotaries, hash routing by input ids, hc_head): its causal LM's own forward, with every
    weight outside the layers loaded and each layer built from the reader when the forward reaches it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with open_checkpoint(path) as reader:
        model.model.layers = nn.ModuleList(_LayerFromReader(config, reader, i, on_layer)
                                           for i in range(config.num_hidden_layers))
        load_weights(model, reader, "")
        with_computed_buffers(model)
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False).logits
