"""DeepSeek's multi-token-prediction (MTP) layer as a torch module made of transformers' own DeepSeek-V3 (or V3.2)
modules, and where its weights are in a checkpoint.

transformers does not implement the MTP layer; vLLM's ``deepseek_mtp.py`` (``DeepSeekMultiTokenPredictorLayer``)
and SGLang's ``deepseek_nextn.py`` do, and this is their wiring: position i of the MTP layer reads the main model's
hidden state at i **after its final norm** (the output of vLLM's ``DeepseekV2Model.forward``, which the speculative
proposer passes on) and the embedding of token i+1, and predicts token i+2::

    x = eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))      # embedding first, then the hidden state
    y = decoder_layer(x)                                           # a full MLA + MoE layer with its own KV cache
    logits = shared_head.head(shared_head.norm(y))

The layer attends over its own cache, one entry per position (RoPE at i), as the main model's layers do. ``y`` is
also returned: a second draft feeds it back as the hidden state (vLLM's recursive use of one MTP layer).
DeepSeek-V3.2's MTP layer is a V3.2 decoder layer: its attention has the lightning indexer, whose keys are a third
cache of the layer (transformers' DynamicIndexedLayer). DeepSeek-V4's MTP block reads the main model's
hyper-connection streams and is wired otherwise: deepseek_v4_mtp_reference.py. Each family says which it has
(Architecture.mtp_wiring; toolchain/export/mtp_block.py chooses by it).

Checkpoint names (DeepSeek-V3's hub layout, toolchain/checkpoint/fp8.py): the layer at index ``num_hidden_layers``
+ k holds a decoder layer's tensors plus ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm`` and
optionally copies of the embedding (``embed_tokens``) and head (``shared_head.head``); without the copies the main
model's are used (they are shared, DeepSeek-V3 technical report section 2.2). config.json's
``num_nextn_predict_layers`` counts MTP layers; a checkpoint that does not declare it (the embedded
deepseek-v3-tiny, whose config is kept byte-identical for its artifacts) is read for layers holding ``eh_proj``.
"""

from __future__ import annotations

import copy
import importlib

import numpy as np
import torch
from torch import nn

from toolchain.export.architectures import ARCHITECTURES
from toolchain.export.layer_tensors import exact, read_tensor
from toolchain.export.reference import cache_argument

EH_PROJ, V4_E_PROJ = "eh_proj.weight", "e_proj.weight"
OWN_EMBEDDING, OWN_HEAD = "embed_tokens.weight", "shared_head.head.weight"


def exports_mtp(model_type: str) -> bool:
    """Whether dstc exports this architecture's MTP layer (its module says: Architecture.exports_mtp)."""
    return model_type in ARCHITECTURES and ARCHITECTURES[model_type].exports_mtp


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}."


def mtp_layer_indices(names: list[str], config: dict) -> list[int]:
    """The indices of the checkpoint's MTP layers (module doc; DeepSeek-V4's blocks hold ``e_proj`` instead:
    deepseek_v4_mtp_reference.py) among tensor ``names``."""
    first = config["num_hidden_layers"]
    declared = config.get("num_nextn_predict_layers")
    found = sorted({int(n.split(".")[2]) for n in names
                    if n.startswith("model.layers.") and n.endswith(("." + EH_PROJ, "." + V4_E_PROJ))
                    and int(n.split(".")[2]) >= first})
    if declared is None:
        return found
    return [i for i in range(first, first + declared) if i in found]


def _transformers_modules(model_type: str):
    """(decoder layer class, RMSNorm class) of the family's transformers modules (Architecture.mtp_layer_classes)."""
    names = ARCHITECTURES[model_type].mtp_layer_classes if model_type in ARCHITECTURES else None
    if names is None:
        raise ValueError(f"{model_type} has no MTP layer made of its decoder layer")
    module = importlib.import_module(names[0])
    return getattr(module, names[1]), getattr(module, names[2])


def layer_config(config, index: int):
    """``config`` reaching MTP layer ``index``: num_hidden_layers = index + 1, and the per-layer type lists that
    V3.2's config has (layer_types, mlp_layer_types) grown by the family's rule (an MoE layer from
    first_k_dense_replace on; V3.2's one attention kind), so that the layer's module and the exporter's MoE rule
    (Architecture.moe_layers) see its index."""
    grown = copy.copy(config)
    grown.num_hidden_layers = index + 1
    for name, kind in (("mlp_layer_types", "sparse" if index >= config.first_k_dense_replace else "dense"),
                       ("layer_types", "indexed_attention")):
        types = getattr(config, name, None)
        if types:
            setattr(grown, name, [*types, *[kind] * (index + 1 - len(types))][:index + 1])
    return grown


class SharedHead(nn.Module):
    """The layer's head: its norm (and, in a checkpoint that stores one, its copy of the main model's head)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm


class MtpLayer(nn.Module):
    """One MTP layer; its parameter names are the checkpoint's under ``model.layers.N.`` (the decoder layer's own
    tensors at the top: ``self_attn``, ``mlp``, the two layer norms)."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        decoder_layer, rms_norm = _transformers_modules(config.model_type)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = layer_config(config, index)  # its modules' (their attention implementation)
        # index >= first_k_dense_replace: an MoE layer, as DeepSeek-V3's is
        self.block = decoder_layer(self.config, index)
        # the layer's own cache has one layer (V3.2's indexer keeps its keys in it too)
        self.block.self_attn.layer_idx = 0
        if hasattr(self.block.self_attn, "indexer"):
            self.block.self_attn.indexer.layer_idx = 0
        self.enorm = rms_norm(hidden, eps=eps)
        self.hnorm = rms_norm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(rms_norm(hidden, eps=eps))

    def checkpoint_names(self, index: int) -> dict[str, str]:
        """state_dict name -> checkpoint name (the block's tensors without ``block.``)."""
        return {name: layer_prefix(index) + name.removeprefix("block.") for name in self.state_dict()}


class MtpModel(nn.Module):
    """The MTP layer with the embedding, head and rotary embedding it uses (the main model's, shared, unless the
    checkpoint stores its own copies). ``forward(hidden [B, S, H], next_ids [B, S], attention_mask [B, T],
    position_ids [B, S], cache)`` -> (logits [B, S, V], output hidden [B, S, H])."""

    def __init__(self, config, index: int, embed_tokens: nn.Module, lm_head: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.config, self.index = config, index
        self.layer = MtpLayer(config, index)
        self.embed_tokens, self.lm_head, self.rotary_emb = embed_tokens, lm_head, rotary

    def new_cache(self):
        from transformers import DynamicCache

        # one layer of the MTP layer's kind: DynamicIndexedLayer for V3.2 (its config's layer_types say so)
        cache_config = layer_config(self.config, 0)
        return DynamicCache(config=cache_config)

    def forward(self, hidden, next_ids, attention_mask=None, position_ids=None, cache=None):
        from transformers.masking_utils import create_causal_mask

        layer = self.layer
        x = layer.eh_proj(torch.cat([layer.enorm(self.embed_tokens(next_ids)), layer.hnorm(hidden)], dim=-1))
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + x.shape[1])[None]
        # V3.2's indexer reads the mask: made even where SDPA could skip it (as DeepseekV32Model does)
        skip = {"allow_is_causal_skip": False} if hasattr(layer.block.self_attn, "indexer") else {}
        mask = create_causal_mask(config=layer.config, inputs_embeds=x, attention_mask=attention_mask,
                                  position_ids=position_ids, **{cache_argument(): cache}, **skip)
        y = layer.block(x, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None,
                        position_embeddings=self.rotary_emb(x, position_ids), **{cache_argument(): cache})
        return self.lm_head(layer.shared_head.norm(y)), y


def load_layer_mtp(model, reader, index: int) -> MtpModel:
    """The MTP layer ``index`` of the checkpoint ``reader`` opened with its MTP layers (open_checkpoint(path,
    mtp=True)), over ``model``'s (the main transformers model's) embedding, head and rotary embedding, in float32:
    the decoder layer and its own tensors, the main model's embedding and head unless the checkpoint stores
    copies."""
    config = model.config
    prefix = layer_prefix(index)
    embed, head = model.model.embed_tokens, model.lm_head
    if reader.has(prefix + OWN_EMBEDDING):
        embed = nn.Embedding.from_pretrained(exact(reader, prefix + OWN_EMBEDDING), freeze=True)
    if reader.has(prefix + OWN_HEAD):
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head.weight.data = exact(reader, prefix + OWN_HEAD)
    mtp = MtpModel(config, index, embed, head, model.model.rotary_emb)
    state = {}
    for name, target in mtp.layer.checkpoint_names(index).items():
        state[name] = read_tensor(reader, target, mtp.layer.state_dict()[name])
    mtp.layer.load_state_dict(state)
    return mtp.eval()


class LayerMtp:
    """The "layer" wiring (mtp_block.MtpBlock): one decoder layer of the family (Architecture.mtp_layer_classes)
    over the main model's final-normed hidden state, as DeepSeek-V3's and V3.2's MTP layers are."""

    def load(self, model, reader, index: int) -> MtpModel:
        return load_layer_mtp(model, reader, index)

    def new(self, model, index: int) -> MtpModel:
        return MtpModel(model.config, index, model.model.embed_tokens, model.lm_head, model.model.rotary_emb)

    def main_outputs(self, model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = model.model(**inputs).last_hidden_state
        return hidden, hidden

    def main_hidden(self, model, ids: np.ndarray, mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model.model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                               position_ids=torch.from_numpy(position_ids)).last_hidden_state.numpy()

    def hub_tensors(self, model, mtp: MtpModel) -> dict[str, torch.Tensor]:
        return hub_tensors(mtp)


def hub_tensors(mtp: MtpModel) -> dict[str, torch.Tensor]:
    """The layer's tensors under their checkpoint names, fused experts split per expert as the hub stores them."""
    out = {}
    state = mtp.layer.state_dict()
    for name, target in mtp.layer.checkpoint_names(mtp.index).items():
        t = state[name].detach().contiguous()
        prefix, _, leaf = target.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and prefix.endswith(".experts") and t.dim() == 3:
            for e in range(t.shape[0]):
                if leaf == "gate_up_proj":
                    gate, up = t[e].chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[target] = t
    return out
