"""DeepSeek-V4's MTP block (its PyTorch module and wiring: deepseek_v4_mtp_reference.py) as a graph of its own, from
the checkpoint, beside the main one.

Interface: toolchain/export/mtp.py's, with V4's hidden state: the input ``hidden_states`` and the output
``mtp_hidden_states`` are hyper-connection streams [B, S, hc_mult, hidden] (the main graph's ``hidden_states``
output, the streams before its hc_head; toolchain/export/deepseek_v4.py). The block's cache is one sliding layer's,
``present.0.key`` [B, 1, T, head_dim] (one K=V entry per position, the window a mask over it: the main graph's
cache contract, so the runtime's decoders cut it back as they cut the main graph's). The layer is built by the
main graph's own code (DeepseekV4Architecture.layer) in the scope ``layers.N`` of its checkpoint index N.
"""

from __future__ import annotations

import json

import onnx_ir as ir
import torch

from toolchain.export import blocks, deepseek_v4_attention as v4attn
from toolchain.export.decoder import architecture_metadata
from toolchain.export.deepseek_v4 import (
    FLOAT,
    INT64,
    DeepseekV4Architecture,
    cache_inputs,
    hyper_head,
    step_inputs,
)
from toolchain.export.deepseek_v4_mtp_reference import SLIDING, V4MtpModel, layer_config
from toolchain.export.graph import GraphBuilder, rename_output, tensor_input
from toolchain.export.weights import HFModule, Params
from toolchain.interface.graph import (
    ATTENTION_MASK,
    HIDDEN_STATES,
    INPUT_IDS,
    KV_CACHE,
    LOGITS,
    MODEL_TYPE,
    MOE_LAYERS,
    MTP_HIDDEN,
    MTP_LAYER,
    NUM_LAYERS,
    PER_TOKEN,
    POSITION_IDS,
    PRESENT_PREFIX,
)


def build_v4_mtp_graph(model: HFModule, arch: DeepseekV4Architecture, reader, index: int,
                       weights: str = "float32") -> ir.Model:
    """The graph of MTP block ``index`` (module doc). ``model``: the main model's meta-device skeleton (its
    embedding, head and rotary embedding); ``reader``: the checkpoint opened with its MTP blocks."""
    config = model.config
    arch.check(config)
    with torch.device("meta"):
        mtp = V4MtpModel(config, index, model.model.embed_tokens, model.lm_head, model.model.rotary_emb)
    params = Params(model, reader)
    named = {**dict(mtp.layer.named_parameters()), **dict(mtp.layer.named_buffers())}
    params.add({mtp.layer.checkpoint_names(index)[name]: t for name, t in named.items()})
    reaching = layer_config(config, index)
    g = GraphBuilder(params, weights)
    streams = [config.hc_mult, config.hidden_size]
    input_ids = tensor_input(INPUT_IDS, INT64, ["batch_size", "sequence_length"])
    mask_2d = tensor_input(ATTENTION_MASK, INT64, ["batch_size", "total_sequence_length"])
    position_ids = tensor_input(POSITION_IDS, INT64, ["batch_size", "sequence_length"])
    hidden = tensor_input(HIDDEN_STATES, FLOAT, ["batch_size", "sequence_length", *streams])
    past = cache_inputs(config, SLIDING, 0)
    layer = mtp.layer

    with g.role("embeddings"):
        table = g.weight("embed_tokens.weight", params.array(model.model.embed_tokens.weight))
    embedded = g.op("Gather", table, input_ids, axis=0)
    step = step_inputs(g, model, input_ids, mask_2d, position_ids)
    step.past = past
    with g.scope(f"layers.{index}"):
        e = blocks.rms_norm(g, embedded, layer.enorm, "enorm")
        h = blocks.rms_norm(g, hidden, layer.hnorm, "hnorm")  # each stream over its hidden axis
        with g.role("mlp"):  # compression treats the projections like the layer's other matrices
            x = g.op("Add", g.op("Unsqueeze", blocks.linear(g, e, layer.e_proj, "e_proj"), g.const([2])),
                     blocks.linear(g, h, layer.h_proj, "h_proj"))
        y, presents = arch.layer(g, reaching, index, layer.block, x, step, input_ids)
        with g.scope("hc_head"), g.role("hyper_connection"):
            out = hyper_head(g, layer.hc_head, y)
        out = blocks.rms_norm(g, out, layer.shared_head.norm, "shared_head.norm")
    with g.role("lm_head"):
        logits = blocks.matmul_weight(g, out, params.array(model.lm_head.weight), "lm_head")
    widths = v4attn.cache_widths(config, SLIDING)
    outputs = [rename_output(logits, LOGITS, FLOAT, ["batch_size", "sequence_length", config.vocab_size]),
               *(rename_output(value, f"{PRESENT_PREFIX}0.{name}", FLOAT,
                               ["batch_size", 1, "total_sequence_length", widths[name]])
                 for name, value in presents.items()),
               rename_output(g.op("Identity", y), MTP_HIDDEN, FLOAT, ["batch_size", "sequence_length", *streams])]
    ir_model = g.model([input_ids, mask_2d, position_ids, hidden, *past.values()], outputs,
                       doc=f"{config.model_type} MTP block {index} exported by dstc")
    ir_model.metadata_props.update({
        MODEL_TYPE: config.model_type,
        NUM_LAYERS: "1",
        **architecture_metadata(arch, config),
        KV_CACHE: PER_TOKEN,  # its sliding layer's cache, whatever the main graph's layout
        MOE_LAYERS: json.dumps([index]),
        MTP_LAYER: str(index),
    })
    return ir_model
