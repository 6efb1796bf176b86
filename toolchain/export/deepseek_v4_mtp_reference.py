"""DeepSeek-V4's multi-token-prediction (MTP) block as a torch module made of transformers' own DeepSeek-V4 modules,
and where its weights are in a checkpoint.

transformers does not load V4's ``mtp.N.`` blocks (``_keys_to_ignore_on_load_unexpected``). Their wiring, as
DeepSeek's own inference code (``inference/model.py`` ``MTPBlock``, quoted in mlx-lm's and llama.cpp's V4 MTP
ports) and vLLM's ``vllm/model_executor/models/deepseek_v4_mtp.py`` (``DeepSeekV4MultiTokenPredictorLayer``) have
it: position i of the block reads the main model's hyper-connection streams at i **before hc_head** (the last
layer's output [B, S, hc_mult, D], which vLLM's target stashes flat as [T, hc_mult * D]) and the embedding of token
i+1, and predicts token i+2::

    x = e_proj(enorm(embed(t[i+1])))[:, :, None, :] + h_proj(hnorm(h[i]))    # [B, S, hc_mult, D]
    y = block(x)                     # a full V4 decoder layer over the streams (its hyper-connections, attention, MoE)
    logits = head(norm(hc_head(y)))  # the block's own hc_head_{fn,base,scale} and norm, the main model's head

``hnorm`` and ``h_proj`` act on each stream (over D); the embedding's projection is added to every stream.
``y``, the block's output streams before its hc_head, is also returned: a further draft feeds it back in place of
the main model's streams (vLLM returns it flat for ``num_speculative_tokens > 1``; dstc's V3 MTP chains alike).

The block is a V4 layer at index ``num_hidden_layers`` + N: V4-Flash's config.json gives it ``compress_ratios``'
last entry, 0, so its attention is the sliding window alone (no compressor, no indexer; mlx-lm builds it with ratio
0), and as an index past ``num_hash_layers`` it routes by score (``ffn.gate.bias``, transformers'
e_score_correction_bias), not by hash. Its cache is one sliding layer's K=V entries. The embedding and head are the
main model's (V4 ships no copies); vLLM zeroes the embedding at position 0, which DeepSeek's code does not, and
neither does this module (as dstc's V3 MTP layer).

Checkpoint names: toolchain/checkpoint/reader.py opened with ``mtp=True`` lists block N's tensors under
``model.layers.{num_hidden_layers + N}.``: its layer's by transformers' names for a layer, its own ones as
toolchain/checkpoint/v4_layout.py's MTP_MODULES names them (``e_proj.weight``, ``shared_head.norm.weight``,
``hc_head.hc_fn``, ...): the state_dict names of :class:`V4MtpLayer`, the decoder layer's without ``block.``.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from toolchain.checkpoint.hub_names import model_module_names, mtp_module_name
from toolchain.checkpoint.v4_layout import mtp_tensors
from toolchain.errors import InputError
from toolchain.export.layer_tensors import read_tensor

SLIDING, SCORED = "sliding_attention", "moe"


def layer_config(config, index: int):
    """``config`` reaching MTP layer ``index``: num_hidden_layers = index + 1 with the per-layer type lists grown by
    sliding-window attention and score-routed MoE layers (module doc)."""
    grown = copy.copy(config)
    grown.num_hidden_layers = index + 1
    grown.layer_types = [*config.layer_types, *[SLIDING] * (index + 1 - len(config.layer_types))][:index + 1]
    grown.mlp_layer_types = [*config.mlp_layer_types,
                             *[SCORED] * (index + 1 - len(config.mlp_layer_types))][:index + 1]
    return grown


def cache_config(config):
    """A one-layer config of the MTP layer's kind, for its own DynamicCache (a sliding window layer)."""
    one = copy.copy(config)
    one.num_hidden_layers, one.layer_types, one.mlp_layer_types = 1, [SLIDING], [SCORED]
    return one


class SharedHead(nn.Module):
    """The block's own norm before the main model's head."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm


class V4MtpLayer(nn.Module):
    """One MTP block; its state_dict names are the checkpoint's under ``model.layers.N.`` (module doc)."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = layer_config(config, index)
        self.block = v4.DeepseekV4DecoderLayer(self.config, index)
        self.block.self_attn.layer_idx = 0  # the layer's own cache has one layer
        self.enorm = v4.DeepseekV4RMSNorm(hidden, eps=eps)
        self.hnorm = v4.DeepseekV4RMSNorm(hidden, eps=eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.hc_head = v4.DeepseekV4HyperHead(config).to(torch.float32)
        self.shared_head = SharedHead(v4.DeepseekV4RMSNorm(hidden, eps=eps))

    def checkpoint_names(self, index: int) -> dict[str, str]:
        """state_dict name -> checkpoint name (the block's tensors without ``block.``)."""
        return {name: f"model.layers.{index}." + name.removeprefix("block.") for name in self.state_dict()}

    def streams_in(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input streams [B, S, hc, D] from the next tokens' embeddings [B, S, D] and the main model's
        streams [B, S, hc, D]."""
        return self.e_proj(self.enorm(embedded)).unsqueeze(-2) + self.h_proj(self.hnorm(hidden))


class V4MtpModel(nn.Module):
    """The MTP block with the main model's embedding, head and rotary embedding. ``forward(hidden [B, S, hc, D],
    next_ids [B, S], attention_mask [B, T], position_ids [B, S], cache)`` -> (logits [B, S, V], output streams
    [B, S, hc, D])."""

    def __init__(self, config, index: int, embed_tokens: nn.Module, lm_head: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.config, self.index = config, index
        self.layer = V4MtpLayer(config, index)
        self.embed_tokens, self.lm_head, self.rotary_emb = embed_tokens, lm_head, rotary

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=cache_config(self.config))

    def forward(self, hidden, next_ids, attention_mask=None, position_ids=None, cache=None):
        from transformers.masking_utils import create_sliding_window_causal_mask

        layer = self.layer
        embedded = self.embed_tokens(next_ids)
        x = layer.streams_in(embedded, hidden)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + x.shape[1])[None]
        mask = create_sliding_window_causal_mask(config=layer.config, inputs_embeds=embedded,
                                                 attention_mask=attention_mask, cache=cache,
                                                 position_ids=position_ids)
        rope = {kind: self.rotary_emb(embedded, position_ids=position_ids, layer_type=kind)
                for kind in ("main", "compress")}
        y = layer.block(x, position_embeddings=rope, position_ids=position_ids, attention_mask=mask, cache=cache)
        return self.lm_head(layer.shared_head.norm(layer.hc_head(y))), y


def main_outputs(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-normed hidden state [B, S, D], streams before hc_head [B, S, hc, D]: what the MTP block reads) of
    the main V4 model for ``inputs`` of its forward."""
    captured = []
    handle = model.model.hc_head.register_forward_hook(lambda _m, args, _out: captured.append(args[0]))
    try:
        out = model.model(**inputs)
    finally:
        handle.remove()
    return out.last_hidden_state, captured[0]


def main_streams(model, **inputs) -> torch.Tensor:
    return main_outputs(model, **inputs)[1]


def hub_tensors(model, mtp: V4MtpModel) -> dict[str, torch.Tensor]:
    """The block's tensors under V4's hub names (``mtp.N.``, toolchain/checkpoint/v4_layout.py's mtp_tensors of
    ``model``, the main transformers model), unquantized, routed experts per expert: each found by the name the
    reader gives it (hub_names.py), so that the reader reads back exactly these values."""
    layers, block = model.config.num_hidden_layers, mtp.index - model.config.num_hidden_layers
    state = mtp.layer.state_dict()
    prefix = f"model.layers.{mtp.index}."
    out = {}
    for t in mtp_tensors(model, block + 1):
        if not t.name.startswith(f"mtp.{block}."):
            continue
        module = mtp_module_name(t.name, layers)
        if module is None:  # a layer tensor: named as the layer at its index would be
            alias = f"layers.{mtp.index}." + t.name.split(".", 2)[2]
            module = "model." + model_module_names(model, [alias])[alias].removeprefix("model.")
        name = module.removeprefix(prefix)
        local = name if name in state else "block." + name
        out[t.name] = _expert_part(state, local) if local not in state else state[local].detach().contiguous()
    return out


class StreamsMtp:
    """The "streams" wiring (mtp_block.MtpBlock), DeepSeek-V4's MTP block: over the main model's hyper-connection
    streams before hc_head, which its reference computes for each row alone (Architecture.reference_row_by_row)."""

    def load(self, model, reader, index: int) -> V4MtpModel:
        return load_v4_mtp(model, reader, index)

    def new(self, model, index: int) -> V4MtpModel:
        return V4MtpModel(model.config, index, model.model.embed_tokens, model.lm_head, model.model.rotary_emb)

    def main_outputs(self, model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        return main_outputs(model, **inputs)

    def main_hidden(self, model, ids: np.ndarray, mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        out = np.zeros((*ids.shape, model.config.hc_mult, model.config.hidden_size), np.float32)
        for row, (row_ids, row_mask) in enumerate(zip(ids, mask)):
            real = row_mask.astype(bool)
            with torch.no_grad():
                out[row, real] = main_streams(model, input_ids=torch.from_numpy(row_ids[real][None]))[0].numpy()
        return out

    def hub_tensors(self, model, mtp: V4MtpModel) -> dict[str, torch.Tensor]:
        return hub_tensors(model, mtp)


def _expert_part(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A per-expert weight (``block.mlp.experts.E.{gate,up,down}_proj.weight``) of transformers' fused experts."""
    head, expert, proj, _ = name.rsplit(".", 3)
    if proj == "down_proj":
        return state[f"{head}.down_proj"][int(expert)].contiguous()
    gate_up = state[f"{head}.gate_up_proj"][int(expert)]
    half = gate_up.shape[0] // 2
    return (gate_up[:half] if proj == "gate_proj" else gate_up[half:]).contiguous()


def load_v4_mtp(model, reader, index: int) -> V4MtpModel:
    """MTP block ``index`` of the checkpoint ``reader`` opened with mtp=True, over ``model``'s (the main
    transformers model's) embedding, head and rotary embedding, in float32."""
    prefix = f"model.layers.{index}."
    unexpected = [n for n in reader.names() if n.startswith(prefix + "self_attn.compressor.")]
    if unexpected:
        raise InputError(f"the MTP block at layer {index} has a compressor ({unexpected[0]}); dstc exports V4's "
                         f"sliding-window MTP block (compress ratio 0)")
    mtp = V4MtpModel(model.config, index, model.model.embed_tokens, model.lm_head, model.model.rotary_emb)
    like = mtp.layer.state_dict()
    names = mtp.layer.checkpoint_names(index)
    state = {name: read_tensor(reader, target, like[name]) for name, target in names.items()}
    mtp.layer.load_state_dict(state)
    return mtp.eval()
