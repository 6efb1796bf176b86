"""DeepSeek's MTP layer (its PyTorch module: mtp_reference.py) as a graph of its own, from the checkpoint, beside the
main one.

Interface: the main graph's (toolchain/interface/graph.py) with one more input, ``hidden_states`` [B, S, H]: the
main graph's final-normed hidden state at positions i (its ``hidden_states`` output, toolchain/export/decoder.py),
with ``input_ids`` the tokens at i + 1 and ``position_ids`` i; outputs ``logits`` (of tokens i + 2), the layer's own
cache ``present.0.*`` (same layout as the main graph's layers: the MLA latent or per-head, with any further cache
of the architecture's layers, DeepSeek-V3.2's ``index_key``, named and recorded as the main graph's (extra_caches,
CACHE_KINDS); the same cache contract, so the runtime's decoders and the compile stage's IR treat it as a one-layer
decoder) and
``mtp_hidden_states`` (MTP_HIDDEN), the layer's output before its head's norm (for a further draft, fed back as
the hidden state).
The decoder layer is built by the main graph's own code (decoder_layer, the architecture's attention and MoE), in
the scope ``layers.N`` of its checkpoint index N, whose MoE rule is the family's (layers from first_k_dense_replace
on). DeepSeek-V4's block, over hyper-connection streams, is built by deepseek_v4_mtp.py (its family's
Architecture.mtp_wiring says so).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import onnx_ir as ir
import torch

from toolchain.export import blocks
from toolchain.export.decoder import (
    FLOAT,
    INT64,
    Architecture,
    LayerInputs,
    architecture_metadata,
    decoder_layer,
    rotary_module,
)
from toolchain.export.deepseek_v4_mtp import build_v4_mtp_graph
from toolchain.export.graph import GraphBuilder, rename_output, tensor_input
from toolchain.export.mtp_reference import OWN_EMBEDDING, OWN_HEAD, MtpModel, layer_config, layer_prefix
from toolchain.export.weights import HFModule, Params
from toolchain.interface.graph import (
    ATTENTION_MASK,
    HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    MODEL_TYPE,
    MOE_LAYERS,
    MTP_HIDDEN,
    MTP_LAYER,
    NUM_LAYERS,
    PAST_PREFIX,
    POSITION_IDS,
    PRESENT_PREFIX,
)


def build_mtp_graph(model: HFModule, arch: Architecture, reader, index: int, weights: str = "float32") -> ir.Model:
    """The graph of MTP layer ``index`` (module doc), as the family wires it (Architecture.mtp_block). ``model``:
    the main model's meta-device skeleton (its embedding, head and rotary embedding, shared unless the checkpoint
    holds the layer's own copies); ``reader``: the checkpoint opened with its MTP layers (open_checkpoint(path,
    mtp=True))."""
    if arch.mtp_wiring not in GRAPHS:
        raise ValueError(f"{model.config.model_type} has no MTP layer dstc exports")
    return GRAPHS[arch.mtp_wiring](model, arch, reader, index, weights)


def build_layer_mtp_graph(model: HFModule, arch: Architecture, reader, index: int,
                          weights: str = "float32") -> ir.Model:
    """The "layer" wiring: the family's decoder layer, built by the main graph's code."""
    config = model.config
    arch.check(config)
    with torch.device("meta"):
        mtp = MtpModel(config, index, model.model.embed_tokens, model.lm_head, rotary_module(model))
    params = Params(model, reader)
    named = {**dict(mtp.layer.named_parameters()), **dict(mtp.layer.named_buffers())}
    params.add({mtp.layer.checkpoint_names(index)[name]: t for name, t in named.items()})
    # the family's MoE rule (layers first_k_dense_replace .. num_hidden_layers - 1) reaching the MTP layer's index
    reaching = layer_config(config, index)
    g = GraphBuilder(params, weights, reaching)
    heads, key_dim, value_dim = arch.cache_dims(config)
    cache_dims = {"key": (heads, key_dim), "value": (heads, value_dim), **arch.extra_caches(config)}
    input_ids = tensor_input(INPUT_IDS, INT64, ["batch_size", "sequence_length"])
    mask_2d = tensor_input(ATTENTION_MASK, INT64, ["batch_size", "total_sequence_length"])
    position_ids = tensor_input(POSITION_IDS, INT64, ["batch_size", "sequence_length"])
    hidden = tensor_input(HIDDEN_STATES, FLOAT, ["batch_size", "sequence_length", config.hidden_size])
    past = {kind: tensor_input(f"{PAST_PREFIX}0.{kind}", FLOAT, ["batch_size", h, "past_sequence_length", d])
            for kind, (h, d) in cache_dims.items()}
    extra = {kind: value for kind, value in past.items() if kind not in ("key", "value")}
    prefix = layer_prefix(index)

    def shared(name: str, module_weight: torch.Tensor):
        if reader.has(prefix + name):
            return params.lazy(prefix + name, tuple(module_weight.shape))
        return params.array(module_weight)

    with g.role("embeddings"):
        table = g.weight("embed_tokens.weight", shared(OWN_EMBEDDING, model.model.embed_tokens.weight))
    embedded = g.op("Gather", table, input_ids, axis=0)
    cos, sin = blocks.rope_tables(g, position_ids, rotary_module(model))
    mask = blocks.attention_mask(g, input_ids, mask_2d)
    layer = mtp.layer
    with g.scope(f"layers.{index}"):
        e = blocks.rms_norm(g, embedded, layer.enorm, "enorm")
        h = blocks.rms_norm(g, hidden, layer.hnorm, "hnorm")
        with g.role("mlp"):  # compression treats the projection like the layer's other matrices
            x = blocks.linear(g, g.op("Concat", e, h, axis=-1), layer.eh_proj, "eh_proj")
        layer_inputs = LayerInputs(cos, sin, mask, past["key"], past["value"], past=extra)
        y, key, value = decoder_layer(g, arch, layer.block, x, layer_inputs)
        out = blocks.rms_norm(g, y, layer.shared_head.norm, "shared_head.norm")
    with g.role("lm_head"):
        logits = blocks.matmul_weight(g, out, shared(OWN_HEAD, model.lm_head.weight), "lm_head")
    presents = {"key": key, "value": value, **{kind: layer_inputs.present[kind] for kind in extra}}
    outputs = [rename_output(logits, LOGITS, FLOAT, ["batch_size", "sequence_length", config.vocab_size]),
               *(rename_output(present, f"{PRESENT_PREFIX}0.{kind}", FLOAT,
                               ["batch_size", cache_dims[kind][0], "total_sequence_length", cache_dims[kind][1]])
                 for kind, present in presents.items()),
               rename_output(g.op("Identity", y), MTP_HIDDEN, FLOAT,
                             ["batch_size", "sequence_length", config.hidden_size])]
    ir_model = g.model([input_ids, mask_2d, position_ids, hidden, *past.values()], outputs,
                       doc=f"{config.model_type} MTP layer {index} exported by dstc")
    moe = index in arch.moe_layers(reaching)
    ir_model.metadata_props.update({
        MODEL_TYPE: config.model_type,
        NUM_LAYERS: "1",
        **architecture_metadata(arch, config),
        MOE_LAYERS: json.dumps([index] if moe else []),
        MTP_LAYER: str(index),
    })
    return ir_model


# the graph of each wiring (Architecture.mtp_wiring; toolchain/export/mtp_block.py has their references)
GRAPHS: dict[str, Callable[..., ir.Model]] = {"layer": build_layer_mtp_graph, "streams": build_v4_mtp_graph}
