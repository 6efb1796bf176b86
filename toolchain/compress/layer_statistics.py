"""Calibration statistics of a model too large to run whole: the inputs of each decoder layer's nn.Linear
modules on calibration text, computed one layer at a time from the checkpoint.

What NNCF's data-aware algorithms read from a model run (``WCTensorStatistic``: per calibration sequence, the
mean of a MatMul's input over its tokens, and the input's shape) is collected here from transformers' own layer
modules, built one at a time from the checkpoint reader (toolchain/export/reference.py): the embedding rows
of the sequences go through layer 0, its outputs through layer 1, and so on, so memory holds one layer and the
sequences' hidden states, whatever the model's size. Forward pre-hooks on each layer's nn.Linear modules take
their inputs; the graph's name for each weight comes from the exporter (toolchain/export/decoder.py
``linear_weight_name``). Routed experts have no nn.Linear (transformers' fused experts module holds them stacked):
a pre-hook on that module takes the tokens and the router's choice it is called with, and gives each expert the
rows routed to it, as the dispatch lowering's Gather does (its gate_proj and up_proj input), and the expert's
act(gate) * up of them (its down_proj input), computed as the module computes it; an expert no calibration token
reached gets none. MLA's absorbed kv_b_proj (a 3-D weight in the graph) gets none.

The statistics of every wanted weight are held until compression reads them: projections that read one input
(gate_proj and up_proj, an attention's q / k / v or its latent projections) share one array of means, and
:func:`statistics_bytes` is what they hold at most (every sequence reaching every expert), checked against the
memory available before the first layer runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from toolchain.checkpoint.reader import EMBEDDING, open_checkpoint
from toolchain.errors import InputError
from toolchain.export import reference as ref
from toolchain.export.decoder import expert_weight_name, linear_weight_name
from toolchain.memory_guard import RETRY, require_memory, size
from toolchain.reference.layered import additive_mask

# one layer's fp32 reference and its calibration inputs and outputs; nothing else runs beside it
MEMORY_FACTOR = 1.5
# the projections of one module that read the same input (their statistics are one array)
_SHARED_INPUT = {"gate_proj": "mlp_input", "up_proj": "mlp_input", "q_proj": "attention_input",
                 "k_proj": "attention_input", "v_proj": "attention_input", "q_a_proj": "attention_input",
                 "kv_a_proj_with_mqa": "attention_input"}


def statistics_bytes(widths: dict[str, int], sequences: int) -> int:
    """At most what the statistics of weights ``widths`` (graph weight name -> its input's width) hold over
    ``sequences``: a float32 mean per sequence and distinct input."""
    inputs = {}
    for name, width in widths.items():
        scope, projection = name.rsplit("/", 2)[0], name.rsplit("/", 2)[1]
        inputs[(scope, _SHARED_INPUT.get(projection, projection))] = width
    return 4 * sequences * sum(inputs.values())


@torch.no_grad()
def linear_statistics(source: Path, sequences: list[list[int]], wanted: dict[str, int],
                      log: Callable[[str], None] = lambda _: None) -> dict:
    """{graph weight name: nncf WCTensorStatistic} for the weights in ``wanted`` (name -> its input's width) whose
    layer has them as nn.Linear modules, on ``sequences`` (token ids; each one sample, unpadded, as the
    whole-model path feeds them to NNCF). InputError, before any layer runs, where the statistics and a layer
    would not fit in the memory available."""
    from nncf.common.tensor_statistics.statistics import WCTensorStatistic
    from nncf.tensor import Tensor

    if not sequences:
        raise InputError("data-aware compression needs calibration text: no sequence of 2 tokens or more")
    too_large = ref.layer_too_large(source, MEMORY_FACTOR,
                                    "data-aware compression in bounded memory (awq, scale estimation)")
    if too_large:
        raise InputError(f"{too_large}; use the data-free scheme")
    held = statistics_bytes(wanted, len(sequences))
    require_memory(held + int(MEMORY_FACTOR * ref.largest_layer(source)[1]),
                   f"awq / scale estimation's calibration statistics ({size(held)} at most: {len(sequences)} "
                   f"sequences x the inputs of {len(wanted)} INT4 weights) beside one decoder layer",
                   f"use the data-free scheme, or {RETRY}")
    config = ref.reference_config(source)
    means: dict[str, list[np.ndarray]] = {}
    shapes: dict[str, list[tuple[int, ...]]] = {}
    last: list = [None, None]  # the last input recorded and its mean: the next projection of the same input shares it

    def record(name: str, _module, args) -> None:
        x = args[0]
        if x is not last[0]:
            last[:] = [x, x.reshape(-1, x.shape[-1]).mean(0).numpy()]
        means.setdefault(name, []).append(last[1])
        shapes.setdefault(name, []).append(tuple(x.shape))

    def record_experts(layer: int, experts, args) -> None:
        x, chosen = args[0], args[1]  # [tokens, hidden], [tokens, top k]: the MoE block's call
        for e in torch.unique(chosen).tolist():
            names = [expert_weight_name(layer, e, p) for p in ("gate_proj", "up_proj", "down_proj")]
            if not wanted.keys() & set(names):
                continue
            rows = x[(chosen == e).any(-1)]
            gate, up = torch.nn.functional.linear(rows, experts.gate_up_proj[e]).chunk(2, dim=-1)
            for name, inputs in zip(names, (rows, rows, experts.act_fn(gate) * up)):
                if name in wanted:
                    record(name, None, (inputs,))

    with open_checkpoint(source) as reader:
        table = reader.tensor(EMBEDDING, reader.natural_dtype(EMBEDDING))
        hidden = [table[torch.tensor([ids])].float() for ids in sequences]
        del table
        rotary = ref.rotary_embedding(config)
        positions = [torch.arange(len(ids))[None] for ids in sequences]
        ropes = [rotary(h, p) for h, p in zip(hidden, positions)]
        masks = [additive_mask(np.ones((1, len(ids)), np.int64), len(ids)) for ids in sequences]
        for i in range(config.num_hidden_layers):
            layer = ref.decoder_layer(config, reader, i)
            dense = not hasattr(layer.mlp, "experts")
            hooks = [module.register_forward_pre_hook(partial(record, name))
                     for path, module in layer.named_modules() if isinstance(module, torch.nn.Linear)
                     if (name := linear_weight_name(i, path, dense)) in wanted]
            if not dense:
                hooks.append(layer.get_submodule("mlp.experts").register_forward_pre_hook(partial(record_experts, i)))
            for k in range(len(hidden)):
                out = layer(hidden[k], attention_mask=masks[k], position_ids=positions[k],
                            position_embeddings=ropes[k], use_cache=False)
                hidden[k] = out[0] if isinstance(out, tuple) else out
            for hook in hooks:
                hook.remove()
            del layer
            log(f"calibration statistics: layer {i + 1}/{config.num_hidden_layers}, {len(means)} weights so far")
    return {name: WCTensorStatistic(mean_values=[Tensor(m) for m in values], shape_values=shapes[name])
            for name, values in means.items()}
