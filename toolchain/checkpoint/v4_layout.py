"""DeepSeek-V4's hub layout (deepseek-ai/DeepSeek-V4-Flash), written from a transformers model skeleton.

The names, dtypes and shapes are those of the shipped ``model.safetensors.index.json`` and shard headers:

- ``embed.weight``, ``head.weight``, ``norm.weight`` (bf16), ``hc_head_{fn,base,scale}`` (float32);
- per layer: ``attn.{wq_a,wq_b,wkv,wo_a,wo_b}`` in e4m3 with ``float8_e8m0fnu`` ``.scale`` blocks of 128 x 128,
  ``attn.attn_sink`` (float32), ``attn.{q_norm,kv_norm}.weight`` (bf16); on compressed layers ``attn.compressor.
  {ape (float32), norm, wgate, wkv}`` (bf16: V4 ships its compressor and indexer projections unquantized); on
  CSA layers also ``attn.indexer.compressor.*`` as the compressor's, ``attn.indexer.weights_proj`` (bf16) and
  ``attn.indexer.wq_b`` (e4m3); ``ffn.gate.weight`` (bf16) with ``ffn.gate.tid2eid`` (int64 [vocab, top-k], hash
  layers) or ``ffn.gate.bias`` (float32); ``ffn.experts.E.{w1,w2,w3}`` in FP4 (toolchain/checkpoint/fp4.py),
  ``ffn.shared_experts.{w1,w2,w3}`` in e4m3; ``{attn,ffn}_norm.weight`` (bf16); ``hc_{attn,ffn}_{fn,base,scale}``
  (float32);
- ``mtp.N.``: a multi-token-prediction block (a layer's tensors, ``e_proj``/``h_proj`` in e4m3, ``enorm``,
  ``hnorm``, ``norm`` and its own ``hc_head_*``; sliding-window attention, score routing), which transformers
  does not load; dstc's MTP exporter reads it (hub_names.py names it, deepseek_v4_mtp_reference.py runs it).

Every name is checked against the skeleton through transformers' own conversion mapping (hub_names.py): each
parameter of the model is written exactly once, so a transformers release that renames V4's modules fails here
rather than in a reader.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from toolchain.checkpoint import fp4
from toolchain.checkpoint.fp8 import FP8, Group, quantize_fp8
from toolchain.checkpoint.hub_names import model_module_names

QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128]}
SCALE = ".scale"
# a tensor's stored form: e4m3 + e8m0 blocks, packed e2m1 + e8m0 per 32, or plain
FP8_KIND, FP4_KIND, BF16_KIND, F32_KIND, I64_KIND = "fp8", "fp4", "bf16", "f32", "i64"
_PLAIN = {BF16_KIND: torch.bfloat16, F32_KIND: torch.float32, I64_KIND: torch.int64}
_COMPRESSOR = {"ape": F32_KIND, "norm.weight": BF16_KIND, "wgate.weight": BF16_KIND, "wkv.weight": BF16_KIND}
_HYPER = [f"hc_{part}_{leaf}" for part in ("attn", "ffn") for leaf in ("fn", "base", "scale")]

# draw(module name, shape, dtype) -> random values in dtype (toolchain/models/shape_faithful.py)
Draw = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class HubTensor:
    """One tensor of the hub layout: its name, how it is stored, the transformers parameter it fills (a routed
    expert's: part of the fused gate_up_proj or down_proj) and the shape of its values."""

    name: str
    kind: str
    module: str
    shape: tuple[int, ...]


def layer_tensors(prefix: str, attention: str, mlp: str, experts: int) -> dict[str, str]:
    """hub name -> kind of one decoder layer's tensors (module docstring)."""
    out = {f"{prefix}attn.attn_sink": F32_KIND, f"{prefix}attn.q_norm.weight": BF16_KIND,
           f"{prefix}attn.kv_norm.weight": BF16_KIND}
    out |= {f"{prefix}attn.{w}.weight": FP8_KIND for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
    if attention != "sliding_attention":
        out |= {f"{prefix}attn.compressor.{leaf}": kind for leaf, kind in _COMPRESSOR.items()}
    if attention == "compressed_sparse_attention":
        out |= {f"{prefix}attn.indexer.compressor.{leaf}": kind for leaf, kind in _COMPRESSOR.items()}
        out |= {f"{prefix}attn.indexer.weights_proj.weight": BF16_KIND, f"{prefix}attn.indexer.wq_b.weight": FP8_KIND}
    out[f"{prefix}ffn.gate.weight"] = BF16_KIND
    if mlp == "hash_moe":  # a hash layer's table replaces the router's bias
        out[f"{prefix}ffn.gate.tid2eid"] = I64_KIND
    else:
        out[f"{prefix}ffn.gate.bias"] = F32_KIND
    out |= {f"{prefix}ffn.experts.{e}.{w}.weight": FP4_KIND for e in range(experts) for w in ("w1", "w2", "w3")}
    out |= {f"{prefix}ffn.shared_experts.{w}.weight": FP8_KIND for w in ("w1", "w2", "w3")}
    out |= {f"{prefix}attn_norm.weight": BF16_KIND, f"{prefix}ffn_norm.weight": BF16_KIND}
    return out | {prefix + leaf: F32_KIND for leaf in _HYPER}


def hub_tensors(model) -> list[HubTensor]:
    """The hub layout's tensors of transformers DeepSeek-V4 ``model`` (a meta-device skeleton will do), each
    with its parameter; a ValueError if they and the model's parameters are not one to one."""
    config = model.config
    kinds = {"embed.weight": BF16_KIND}
    for i, (attention, mlp) in enumerate(zip(config.layer_types, config.mlp_layer_types, strict=True)):
        kinds |= layer_tensors(f"layers.{i}.", attention, mlp, config.n_routed_experts)
    kinds |= {"norm.weight": BF16_KIND, "head.weight": BF16_KIND}
    kinds |= {f"hc_head_{leaf}": F32_KIND for leaf in ("fn", "base", "scale")}
    modules = model_module_names(model, list(kinds))
    parameters = model.state_dict()  # parameters and persistent buffers (the hash table)
    out, filled = [], set()
    for name, kind in kinds.items():
        module, shape = _parameter(modules[name], parameters)
        if shape is None:
            raise ValueError(f"DeepSeek-V4's hub tensor {name} is {modules[name]}, which transformers' model does "
                             f"not have")
        filled.add(module)
        out.append(HubTensor(name, kind, module, shape))
    missing = sorted(set(parameters) - filled)
    if missing:
        raise ValueError(f"transformers' DeepSeek-V4 has parameters the hub layout does not hold: {missing[:5]}")
    return out


def mtp_tensors(model, blocks: int) -> list[HubTensor]:
    """``blocks`` MTP blocks (module docstring), shaped as the model's last layer with sliding-window attention
    and score routing; transformers has no parameters for them (``module`` is empty)."""
    config, hidden = model.config, model.config.hidden_size
    last = hub_tensors(model)
    last_prefix = f"layers.{config.num_hidden_layers - 1}."
    out = []
    for n in range(blocks):
        prefix = f"mtp.{n}."
        for t in last:
            # the block's attention is the sliding window alone (V4-Flash's compress_ratios end in 0)
            if t.name.startswith(last_prefix) and not t.name.startswith((last_prefix + "attn.compressor.",
                                                                         last_prefix + "attn.indexer.")):
                name = prefix + t.name[len(last_prefix):]
                shape = t.shape
                if name.endswith(".gate.tid2eid"):  # the shipped MTP block routes by score, not by hash
                    name, shape = name.replace(".tid2eid", ".bias"), (config.n_routed_experts,)
                out.append(HubTensor(name, F32_KIND if name.endswith(".gate.bias") else t.kind, "", shape))
        out += [HubTensor(prefix + "e_proj.weight", FP8_KIND, "", (hidden, hidden)),
                HubTensor(prefix + "h_proj.weight", FP8_KIND, "", (hidden, hidden))]
        out += [HubTensor(prefix + f"{norm}.weight", BF16_KIND, "", (hidden,)) for norm in ("enorm", "hnorm", "norm")]
        out += [HubTensor(prefix + "hc_head_fn", F32_KIND, "", (config.hc_mult, config.hc_mult * hidden)),
                HubTensor(prefix + "hc_head_base", F32_KIND, "", (config.hc_mult,)),
                HubTensor(prefix + "hc_head_scale", F32_KIND, "", (1,))]
    return out


def groups(tensors: list[HubTensor], draw: Draw, experts: int) -> list[Group]:
    """Each hub tensor as the shard writer's group: values drawn by ``draw`` (in bf16 for what the hub quantizes,
    quantized here), written with their scales. ``experts``: how many a hash table's entries choose from."""
    out = []
    for t in tensors:
        if t.kind in (FP8_KIND, FP4_KIND):
            rows, cols = t.shape
            if t.kind == FP8_KIND:
                grid = (math.ceil(rows / 128), math.ceil(cols / 128))
                specs = [(t.name, FP8, t.shape), (_scale_name(t.name), fp4.E8M0, grid)]
            else:
                specs = [(t.name, torch.int8, (rows, cols // 2)), (_scale_name(t.name), fp4.E8M0, (rows, cols // 32))]
            out.append(Group(specs, _quantized(t, draw)))
        else:
            out.append(Group([(t.name, _PLAIN[t.kind], t.shape)], _plain(t, draw, experts)))
    return out


def _plain(t: HubTensor, draw: Draw, experts: int) -> Callable[[], list[torch.Tensor]]:
    def make() -> list[torch.Tensor]:
        if t.kind == I64_KIND:
            return [_hash_table(t.shape, experts, draw)]
        return [draw(t.module or t.name, t.shape, _PLAIN[t.kind])]
    return make


def _quantized(t: HubTensor, draw: Draw) -> Callable[[], list[torch.Tensor]]:
    def make() -> list[torch.Tensor]:
        values = draw(t.module or t.name, t.shape, torch.bfloat16)
        if t.kind == FP4_KIND:
            return list(fp4.quantize_fp4(values))
        q, scale = quantize_fp8(values, scale_fmt="ue8m0")
        return [q, scale.to(fp4.E8M0)]
    return make


def _hash_table(shape: tuple[int, ...], experts: int, draw: Draw) -> torch.Tensor:
    """[vocab, top-k] distinct expert ids per token, of ``experts`` (a random order per row)."""
    vocab, k = shape
    table = torch.empty(shape, dtype=torch.int64)
    for start in range(0, vocab, 4096):
        scores = draw("tid2eid", (min(4096, vocab - start), experts), torch.float32)
        table[start:start + scores.shape[0]] = scores.argsort(dim=1)[:, :k]
    return table


def _scale_name(weight: str) -> str:
    return weight.removesuffix(".weight") + SCALE


def _parameter(module: str, parameters: dict) -> tuple[str, tuple[int, ...] | None]:
    """(the model's parameter that holds ``module``, the shape of ``module``'s values; None if there is none): a
    per-expert name (``...experts.E.gate_proj.weight``) is part of the fused gate_up_proj [E, 2I, H] (gate rows
    first) or down_proj [E, H, I]."""
    head, _, rest = module.partition(".experts.")
    parts = rest.split(".")
    if not rest or len(parts) != 3 or not parts[0].isdigit():
        whole = parameters.get(module)
        return module, None if whole is None else tuple(whole.shape)
    fused = f"{head}.experts.{'down_proj' if parts[1] == 'down_proj' else 'gate_up_proj'}"
    whole = parameters.get(fused)
    if whole is None:
        return fused, None
    _, rows, cols = whole.shape
    return fused, (rows, cols) if parts[1] == "down_proj" else (rows // 2, cols)
