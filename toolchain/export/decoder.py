"""The decoder-only skeleton every architecture shares: embeddings, N pre-norm layers with a KV cache, lm_head.

Graph interface (optimum's names): inputs input_ids, attention_mask, position_ids, past_key_values.N.key/.value;
outputs logits, present.N.key/.value (and any further per-layer cache, past_key_values.N.<kind> -> present.N.<kind>,
that an architecture adds: extra_caches), and on request the final-normed hidden state ``hidden_states``
(``hidden_output``). Batch and sequence axes are dynamic, so one graph serves prefill (empty
past) and decode. An architecture module supplies the attention and MLP of a layer; everything else is here.
With tied embeddings (tie_word_embeddings) the lm_head reads the embedding table itself: one copy is stored.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import onnx_ir as ir
import torch

from toolchain.export import blocks
from toolchain.export.graph import GraphBuilder, rename_output, tensor_input
from toolchain.export.weights import HFModule, Params
from toolchain.interface.graph import (
    ATTENTION,
    ATTENTION_MASK,
    CACHE_KINDS,
    GENAI_MODEL_TYPE,
    HEAD_LAYOUT,
    HIDDEN_OUTPUT,
    HIDDEN_STATES,
    INPUT_IDS,
    KV_CACHE,
    LOGITS,
    MODEL_TYPE,
    MOE_LAYERS,
    MOE_LOWERING,
    NUM_LAYERS,
    PAST_PREFIX,
    POSITION_IDS,
    PRESENT_PREFIX,
    ROTATIONS_PER_LAYER,
)

FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64


@dataclass
class LayerInputs:
    """What a layer's attention needs besides its hidden state."""

    cos: ir.Value
    sin: ir.Value
    mask: ir.Value
    past_key: ir.Value
    past_value: ir.Value
    # The layer's caches beyond key and value (Architecture.extra_caches), by kind: their past inputs, and the
    # grown tensors, which attention sets in ``present`` (its return value stays (output, key, value)).
    past: dict[str, ir.Value] = field(default_factory=dict)
    present: dict[str, ir.Value] = field(default_factory=dict)


class Architecture(Protocol):
    """One module per model family implements this (registered in toolchain/export/architectures.py); it is the
    one place that knows the family. What later stages need of it (attention kind, head layout, MoE layers, the
    onnxruntime-genai model type, each weight's role) the exporter writes into the graph's metadata
    (``architecture_metadata``, ``GraphBuilder.role``), and passes, compression, compile and the runtime read it
    from there."""

    model_types: tuple[str, ...]
    attention_kind: str  # "gqa" (the fusion passes expect GroupQueryAttention) or "mla" (ONNX Attention)
    kv_cache: str  # what the cache holds: "per-head" keys and values, or MLA's "latent" (toolchain/export/deepseek.py)
    genai_model_type: str | None  # onnxruntime-genai's model type; None where its config cannot describe the model
    # how MoE layers' routed experts are lowered (toolchain/export/moe.py); None for a family without MoE layers
    moe_lowering: str | None
    rotations_per_layer: int  # tensors RoPE rotates in each layer (q and k: 2), for the passes' fusion counts
    # transformers' model is a reference for one sequence at a time only: the torch reference runs a batch row by row
    reference_row_by_row: bool
    # whether dstc exports the checkpoint's multi-token-prediction layer (export.mtp; toolchain/export/mtp.py)
    exports_mtp: bool
    # how that layer is wired (toolchain/export/mtp_block.py): "layer", one of the family's decoder layers over the
    # main model's final-normed hidden state, made of the transformers classes ``mtp_layer_classes`` names (module,
    # decoder layer, RMSNorm); "streams", DeepSeek-V4's block over its hyper-connection streams; None without one
    mtp_wiring: str | None
    mtp_layer_classes: tuple[str, str, str] | None
    # how the family's checkpoints ship on the hub, the layout toolchain/models/shape_faithful.py writes random ones
    # in: "bf16" (bf16 or fp32 safetensors), "fp8" (DeepSeek-V3's e4m3 projections with 128 x 128 block scales,
    # toolchain/checkpoint/fp8.py) or "v4" (toolchain/checkpoint/v4_layout.py, with multi-token-prediction blocks)
    hub_layout: str
    # an "fp8" family whose random checkpoints are bf16 unless the hub layout is asked for (--fp8): DeepSeek-V3,
    # whose bf16 form (DeepSeek's fp8_cast_bf16) dstc read first
    bf16_unless_asked: bool

    def check(self, config) -> None:
        """Raise UnsupportedModelError for a config variant the builder does not reproduce exactly."""

    def fix_reference(self, model) -> None:
        """Repair the loaded transformers model where its own forward is broken, so it can serve as reference."""

    def cache_dims(self, config) -> tuple[int, int, int]:
        """(cached heads, key dim, value dim) of one layer's KV cache (for MLA's latent cache: 1, the rotary key's
        and the latent's widths)."""

    def extra_caches(self, config) -> dict[str, tuple[int, int]]:
        """Per-layer cache tensors beyond key and value: kind -> (heads, dim) of ``past_key_values.N.<kind>``
        [batch, heads, past, dim], grown along the sequence with them (DeepSeek-V3.2's indexer keys); {} for most."""

    def head_layout(self, config) -> dict[str, tuple[str, int]]:
        """projection -> ("out", head width) for projections whose output channels are heads, ("in", width) for
        the output projection, whose input rows are, ("stacked", heads) for 3-D [heads, K, N] weights with a head
        per index of axis 0 (per-head quantization and its errors)."""

    def moe_layers(self, config) -> list[int]:
        """Indices of the layers whose MLP is a mixture of experts (a family with MoE layers builds them with
        toolchain/export/moe_layer.py's MoeArchitecture)."""

    def attention(self, g: GraphBuilder, attn: HFModule, h: ir.Value, inputs: LayerInputs):
        """Return (output, present key, present value)."""

    def mlp(self, g: GraphBuilder, mlp: HFModule, h: ir.Value) -> ir.Value: ...


def with_kv_cache(arch: Architecture, layout: str) -> Architecture:
    """``arch`` with its cache in ``layout`` (a copy: the registry's instance is shared), or itself when it already
    is (the cache-layout options of the families: deepseek.with_mla_cache, deepseek_v4.with_v4_cache)."""
    if arch.kv_cache == layout:
        return arch
    arch = copy.copy(arch)
    arch.kv_cache = layout
    return arch


def linear_weight_name(layer: int, module_path: str, dense_mlp: bool) -> str:
    """The graph's name for the weight of the nn.Linear at ``module_path`` in transformers' decoder layer
    ``layer`` (``self_attn.q_proj``, ``mlp.shared_experts.up_proj``): the exporter's scopes are the module's
    attribute names, with a dense (non-MoE) MLP's projections under ``mlp/dense`` (blocks.DENSE_MLP)."""
    parts = module_path.split(".")
    if dense_mlp and parts[0] == "mlp":
        parts.insert(1, blocks.DENSE_MLP)
    return "/".join([f"layers.{layer}", *parts, "weight"])


def expert_weight_name(layer: int, expert: int, projection: str) -> str:
    """The graph's name for routed expert ``expert``'s ``projection`` (gate_proj, up_proj, down_proj) weight in
    layer ``layer`` of the dispatch lowering (moe.dispatch: scopes mlp / experts / <e>)."""
    return f"layers.{layer}/mlp/experts/{expert}/{projection}/weight"


def tied_embeddings(model: HFModule) -> bool:
    """Whether lm_head reads the embedding table itself (tie_word_embeddings: one Parameter in PyTorch)."""
    return model.lm_head.weight is model.model.embed_tokens.weight


def rotary_module(model: HFModule) -> HFModule:
    """The model's rotary embedding with real inv_freq: a meta-device skeleton's is rebuilt from its config (it
    holds no checkpoint weights, only what the config and RoPE scaling define). The device is set around the
    constructor: transformers 5.24 dropped its ``device`` argument."""
    rotary = model.model.rotary_emb
    if rotary.inv_freq.device.type != "meta":
        return rotary
    with torch.device("cpu"):
        return type(rotary)(config=model.config)


def build_decoder(model: HFModule, arch: Architecture, reader=None,
                  on_layer: Callable[[int, int], None] | None = None, weights: str = "float32",
                  hidden_output: bool = False) -> ir.Model:
    """The whole graph of ``model``: a transformers model with its weights, or a meta-device skeleton whose
    weights ``reader`` (toolchain/checkpoint/reader.py) reads when the graph is saved. on_layer(i, n) is called
    as each of the n layers is built (progress on large models). ``weights``: their storage, "float32" or
    "bfloat16" (toolchain/export/weights.py storage_for). ``hidden_output``: also output the final-normed hidden
    state (``hidden_states`` [B, S, H], what the MTP layer reads; toolchain/export/mtp.py; DeepSeek-V4's graph
    its streams before hc_head), recorded in the metadata (HIDDEN_OUTPUT)."""
    own_graph = getattr(arch, "build_graph", None)  # an architecture whose layers are not this skeleton's
    if own_graph is not None:
        return own_graph(model, reader, on_layer, weights, hidden_output=hidden_output)
    config = model.config
    arch.check(config)
    cached_heads, key_dim, value_dim = arch.cache_dims(config)
    g = GraphBuilder(Params(model, reader), weights, config)
    input_ids = tensor_input(INPUT_IDS, INT64, ["batch_size", "sequence_length"])
    mask_2d = tensor_input(ATTENTION_MASK, INT64, ["batch_size", "total_sequence_length"])
    position_ids = tensor_input(POSITION_IDS, INT64, ["batch_size", "sequence_length"])
    inputs, outputs = [input_ids, mask_2d, position_ids], []
    present_dims = {"key": (cached_heads, key_dim), "value": (cached_heads, value_dim), **arch.extra_caches(config)}

    decoder = model.model
    with g.role("embeddings"):
        table = g.weight("embed_tokens.weight", g.params.array(decoder.embed_tokens.weight))
    h = g.op("Gather", table, input_ids, axis=0)
    cos, sin = blocks.rope_tables(g, position_ids, rotary_module(model))
    mask = blocks.attention_mask(g, input_ids, mask_2d)
    presents = []
    for i, layer in enumerate(decoder.layers):
        past = {kind: tensor_input(f"{PAST_PREFIX}{i}.{kind}", FLOAT,
                                   ["batch_size", heads, "past_sequence_length", dim])
                for kind, (heads, dim) in present_dims.items()}
        inputs += past.values()
        extra = {kind: value for kind, value in past.items() if kind not in ("key", "value")}
        layer_inputs = LayerInputs(cos, sin, mask, past["key"], past["value"], past=extra)
        with g.scope(f"layers.{i}"):
            h, key, value = decoder_layer(g, arch, layer, h, layer_inputs)
        presents += [(i, "key", key), (i, "value", value), *((i, kind, layer_inputs.present[kind]) for kind in extra)]
        if on_layer:
            on_layer(i + 1, len(decoder.layers))

    h = blocks.rms_norm(g, h, decoder.norm, "norm")
    hidden = h
    if tied_embeddings(model):
        logits = blocks.tied_lm_head(g, h, table, config.vocab_size)
    else:
        with g.role("lm_head"):
            logits = blocks.matmul_weight(g, h, g.params.array(model.lm_head.weight), "lm_head")
    outputs.append(rename_output(logits, LOGITS, FLOAT, ["batch_size", "sequence_length", config.vocab_size]))
    for i, kind, value in presents:
        heads, dim = present_dims[kind]
        outputs.append(rename_output(value, f"{PRESENT_PREFIX}{i}.{kind}", FLOAT,
                                     ["batch_size", heads, "total_sequence_length", dim]))
    if hidden_output:  # the last output, so the graph's others keep their places
        outputs.append(rename_output(hidden, HIDDEN_STATES, FLOAT, ["batch_size", "sequence_length",
                                                                    config.hidden_size]))
    ir_model = g.model(inputs, outputs, doc=f"{config.model_type} exported by dstc")
    ir_model.metadata_props.update({
        MODEL_TYPE: config.model_type,
        NUM_LAYERS: str(len(decoder.layers)),
        **architecture_metadata(arch, config),
        **({HIDDEN_OUTPUT: HIDDEN_STATES} if hidden_output else {}),
    })
    return ir_model


def decoder_layer(g: GraphBuilder, arch: Architecture, layer: HFModule, h: ir.Value, inputs: LayerInputs):
    """One pre-norm decoder layer (inside its ``layers.N`` scope): (its output, the grown key and value caches)."""
    normed = blocks.rms_norm(g, h, layer.input_layernorm, "input_layernorm")
    with g.scope("self_attn"), g.role("attention"):
        attn, key, value = arch.attention(g, layer.self_attn, normed, inputs)
    h = g.op("Add", h, attn)
    normed = blocks.rms_norm(g, h, layer.post_attention_layernorm, "post_attention_layernorm")
    with g.scope("mlp"), g.role("mlp"):
        h = g.op("Add", h, arch.mlp(g, layer.mlp, normed))
    return h, key, value


def architecture_metadata(arch: Architecture, config) -> dict[str, str]:
    """The architecture's facts as graph metadata (JSON values), for the stages that read the graph. The MoE
    lowering only where there are MoE layers: a dense graph has nothing lowered."""
    import json

    moe_layers = arch.moe_layers(config)
    return {ATTENTION: arch.attention_kind, KV_CACHE: arch.kv_cache,
            HEAD_LAYOUT: json.dumps(arch.head_layout(config)),
            MOE_LAYERS: json.dumps(moe_layers),
            GENAI_MODEL_TYPE: arch.genai_model_type or "",
            CACHE_KINDS: json.dumps(["key", "value", *arch.extra_caches(config)]),
            ROTATIONS_PER_LAYER: str(arch.rotations_per_layer),
            **({MOE_LOWERING: arch.moe_lowering or ""} if moe_layers else {})}
