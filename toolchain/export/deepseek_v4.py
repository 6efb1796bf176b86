"""DeepSeek-V4 (V4-Flash / Pro): its own decoder skeleton, because manifold-constrained hyper-connections replace
the residual stream with hc_mult streams [B, S, hc_mult, hidden]; and its MoE layers (hash and top-k routers,
sqrt-softplus scores, clipped SwiGLU experts and shared expert).

Per layer, twice (around the attention, then around the MLP): a hyper-connection reads the streams (flattened,
unweighted RMSNorm, one projection) into ``pre`` (collapses the streams into the block's input), ``post``
(spreads the block's output over the streams) and ``comb`` (mixes the streams: Sinkhorn-normalised towards a
doubly stochastic matrix); streams' = post x block(collapse) + comb^T streams. hc_head collapses the streams
before the final norm. The attention is in deepseek_v4_attention.py, which also says what the cache holds.

Its MoE layers are the MoE component's (toolchain/export/moe_layer.py, ``moe``): ``hash_moe`` layers route by the
frozen table tid2eid[input_ids] (routers.HashRouter), ``moe`` layers by the top k of the scores plus
e_score_correction_bias (routers.BiasedTopK, sqrt(softplus) scores); both weigh the chosen experts by their unbiased
scores, normalised and times routed_scaling_factor; experts and shared expert are clipped SwiGLU.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import torch

from toolchain.errors import InputError, UnsupportedModelError
from toolchain.export import blocks, deepseek_v4_attention as v4attn, moe_layer
from toolchain.export.decoder import architecture_metadata, with_kv_cache
from toolchain.export.graph import GraphBuilder, rename_output, tensor_input
from toolchain.export.moe_layer import MoeLayer
from toolchain.export.routers import SCORINGS, BiasedTopK, HashRouter
from toolchain.export.weights import HFModule, Params, to_numpy
from toolchain.interface.graph import (
    ATTENTION_MASK,
    CACHE_LENGTHS,
    COMPRESSED,
    HIDDEN_OUTPUT,
    HIDDEN_STATES,
    INPUT_IDS,
    LOGITS,
    MODEL_TYPE,
    NUM_LAYERS,
    PAST_PREFIX,
    PER_TOKEN,
    POSITION_IDS,
    PRESENT_PREFIX,
)

FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64
V4_CACHES = (PER_TOKEN, COMPRESSED)


def with_v4_cache(arch, layout: str | None):
    """The architecture with DeepSeek-V4's cache in ``layout`` (V4_CACHES; None keeps per-token). Asking it of
    another architecture is an InputError."""
    if layout is None:
        return arch
    if layout not in V4_CACHES:
        raise InputError(f"unknown DeepSeek-V4 cache layout {layout!r}; layouts: {', '.join(V4_CACHES)}")
    if not isinstance(arch, DeepseekV4Architecture):
        raise InputError(f"the V4 cache layout applies to deepseek_v4, not {arch.model_types[0]}: drop v4_cache / "
                         f"--v4-cache")
    return with_kv_cache(arch, layout)


def _get(config, name: str):
    """A config field of a transformers config or of its config.json (a runtime reads the artifact's file)."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


class DeepseekV4Architecture(moe_layer.MoeArchitecture):
    model_types: tuple[str, ...] = ("deepseek_v4",)
    attention_kind = "compressed"  # sliding-window K=V attention with CSA / HCA pooled entries
    # K=V and the compressors' projections per token, or COMPRESSED (window, pooled entries, tail:
    # deepseek_v4_attention.py; with_v4_cache)
    kv_cache = PER_TOKEN
    genai_model_type: str | None = None  # onnxruntime-genai's config describes no hyper-connections
    moe_lowering: str | None = "dispatch"
    lowerings = ("dispatch",)  # no fused form has its clipped SwiGLU experts
    # q, k and the output's inverse rotation; the passes expect nothing of "compressed" attention (passes/targets.py)
    rotations_per_layer = 3
    # transformers 5.24's V4 pools a left-padded row's padding into its compressed entries (its caches count cache
    # slots, not positions: a row's logits depend on its batch-mates' lengths, up to 0.7 of the logits' range on the
    # test suite's tiny V4); its reference runs each row alone, with a cache of its own, as dstc's graph computes it
    reference_row_by_row = True
    exports_mtp = True  # its mtp.N blocks: toolchain/export/deepseek_v4_mtp.py
    mtp_wiring: str | None = "streams"  # over the hyper-connection streams (deepseek_v4_mtp_reference.py)
    mtp_layer_classes: tuple[str, str, str] | None = None

    hub_layout = "v4"  # FP8 attention, FP4 routed experts (toolchain/checkpoint/v4_layout.py)
    bf16_unless_asked = False

    def extra_caches(self, config) -> dict[str, tuple[int, int]]:
        """None recorded: each layer type caches its own tensors (cache_widths), and kv_cache "per-token" already
        tells a runtime that openvino_genai cannot page them."""
        return {}

    def check(self, config) -> None:
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"deepseek_v4: hidden_act {config.hidden_act!r} is not supported")
        if config.scoring_func not in SCORINGS:
            raise UnsupportedModelError(f"deepseek_v4: scoring_func {config.scoring_func!r} is not supported "
                                        f"(supported: {', '.join(SCORINGS)})")
        if config.num_key_value_heads != 1:
            raise UnsupportedModelError("deepseek_v4: the attention shares one K=V head (num_key_value_heads 1)")
        if self.moe_lowering not in self.lowerings:
            raise UnsupportedModelError(f"deepseek_v4: the {self.moe_lowering} MoE lowering is not implemented for "
                                        f"its clipped SwiGLU experts; use dispatch")

    def fix_reference(self, model) -> None:
        pass

    def cache_dims(self, config) -> tuple[int, int, int]:
        """The K=V cache's (heads, key dim, value dim); the compressors' caches are named apart (cache_widths)."""
        return 1, config.head_dim, config.head_dim

    def head_layout(self, config) -> dict[str, tuple[str, int]]:
        return {"q_b_proj": ("out", _get(config, "head_dim"))}

    def moe_layers(self, config) -> list[int]:
        """Every V4 layer's MLP is a mixture of experts (hash-routed or top-k)."""
        return list(range(_get(config, "num_hidden_layers")))

    def moe(self, config, layer: int) -> MoeLayer:
        """Layer ``layer``'s MoE: a hash router in ``hash_moe`` layers, else the biased top-k; sqrt(softplus)
        scores (scoring_func), the weights always renormalised (transformers' V4 routers ignore norm_topk_prob)."""
        router_kind = HashRouter if config.mlp_layer_types[layer] == "hash_moe" else BiasedTopK
        router = router_kind(config.num_experts_per_tok, config.n_routed_experts, scoring=config.scoring_func,
                             normalize=True, scaling=config.routed_scaling_factor)
        return MoeLayer(router, shared_experts="shared_experts", swiglu_limit=config.swiglu_limit)

    def attention(self, g: GraphBuilder, attn, h, inputs):
        raise NotImplementedError("DeepSeek-V4's layers are built by build_graph")

    def mlp(self, g: GraphBuilder, mlp, h):
        raise NotImplementedError("DeepSeek-V4's layers are built by build_graph")

    def build_graph(self, model: HFModule, reader=None, on_layer: Callable[[int, int], None] | None = None,
                    weights: str = "float32", hidden_output: bool = False) -> ir.Model:
        """The whole graph (decoder.build_decoder's contract): the interface's inputs and outputs, with each
        layer's cache tensors named by deepseek_v4_attention.cache_widths. ``hidden_output``: also output the
        streams before hc_head (``hidden_states`` [B, S, hc_mult, hidden], what the MTP block reads:
        toolchain/export/deepseek_v4_mtp.py), recorded in the metadata (HIDDEN_OUTPUT)."""
        config = model.config
        self.check(config)
        g = GraphBuilder(Params(model, reader), weights)
        input_ids = tensor_input(INPUT_IDS, INT64, ["batch_size", "sequence_length"])
        mask_2d = tensor_input(ATTENTION_MASK, INT64, ["batch_size", "total_sequence_length"])
        position_ids = tensor_input(POSITION_IDS, INT64, ["batch_size", "sequence_length"])
        inputs, presents = [input_ids, mask_2d, position_ids], []
        decoder = model.model

        with g.role("embeddings"):
            table = g.weight("embed_tokens.weight", g.params.array(decoder.embed_tokens.weight))
        x = g.op("Gather", table, input_ids, axis=0)
        h = g.op("Expand", g.op("Unsqueeze", x, g.const([2])), g.const([1, 1, config.hc_mult, 1]))  # [B, S, hc, D]
        compressed = self.kv_cache == COMPRESSED
        step = step_inputs(g, model, input_ids, mask_2d, position_ids, compressed)
        lengths: dict[str, tuple[str, int]] = {}
        for i, layer in enumerate(decoder.layers):
            layer_type = config.layer_types[i]
            step.past = cache_inputs(config, layer_type, i, compressed)
            inputs += list(step.past.values())
            with g.scope(f"layers.{i}"):
                h, layer_presents = self.layer(g, config, i, layer, h, step, input_ids)
            rules = v4attn.cache_lengths(config, layer_type) if compressed else {}
            lengths |= {f"{i}.{name}": rule for name, rule in rules.items()}
            presents += [(f"{i}.{name}", value, v4attn.cache_widths(config, layer_type, compressed)[name],
                          _length_dim(rules.get(name), "total_sequence_length"))
                         for name, value in layer_presents.items()]
            if on_layer:
                on_layer(i + 1, len(decoder.layers))
        streams = h

        with g.scope("hc_head"), g.role("hyper_connection"):
            x = hyper_head(g, decoder.hc_head, h)
        x = blocks.rms_norm(g, x, decoder.norm, "norm")
        with g.role("lm_head"):
            logits = blocks.matmul_weight(g, x, g.params.array(model.lm_head.weight), "lm_head")
        outputs = [rename_output(logits, LOGITS, FLOAT, ["batch_size", "sequence_length", config.vocab_size])]
        outputs += [rename_output(value, f"{PRESENT_PREFIX}{name}", FLOAT, ["batch_size", 1, length, width])
                    for name, value, width, length in presents]
        if hidden_output:  # the last output, so the graph's others keep their places
            outputs.append(rename_output(streams, HIDDEN_STATES, FLOAT,
                                         ["batch_size", "sequence_length", config.hc_mult, config.hidden_size]))
        ir_model = g.model(inputs, outputs, doc=f"{config.model_type} exported by dstc")
        ir_model.metadata_props.update({MODEL_TYPE: config.model_type, NUM_LAYERS: str(len(decoder.layers)),
                                        **architecture_metadata(self, config),
                                        **({HIDDEN_OUTPUT: HIDDEN_STATES} if hidden_output else {}),
                                        **({CACHE_LENGTHS: json.dumps(lengths)} if compressed else {})})
        return ir_model

    def layer(self, g: GraphBuilder, config, index: int, layer, h, step: v4attn.StepInputs, input_ids):
        """Decoder layer ``index`` (``layer``, transformers' module; inside its ``layers.N`` scope) over the streams
        h: (the streams after it, its cache outputs by name). ``config``'s per-layer type lists reach ``index``."""
        with g.scope("attn_hc"), g.role("hyper_connection"):
            post, comb, collapsed = hyper_connection(g, layer.attn_hc, h)
        normed = blocks.rms_norm(g, collapsed, layer.input_layernorm, "input_layernorm")
        with g.scope("self_attn"), g.role("attention"):
            out, presents = v4attn.attention(g, layer.self_attn, normed, step)
        h = mix(g, post, comb, out, h)
        with g.scope("ffn_hc"), g.role("hyper_connection"):
            post, comb, collapsed = hyper_connection(g, layer.ffn_hc, h)
        normed = blocks.rms_norm(g, collapsed, layer.post_attention_layernorm, "post_attention_layernorm")
        with g.scope("mlp"), g.role("mlp"):
            out = moe_layer.block(g, self.moe(config, index), self.moe_lowering or "dispatch", layer.mlp, normed,
                                  input_ids)
        return mix(g, post, comb, out, h), presents


def cache_inputs(config, layer_type: str, index: int, compressed: bool = False) -> dict[str, ir.Value]:
    """Layer ``index``'s cache inputs by name (past_key_values.{index}.*); ``compressed``: the compressed layout's."""
    rules = v4attn.cache_lengths(config, layer_type) if compressed else {}
    return {name: tensor_input(f"{PAST_PREFIX}{index}.{name}", FLOAT,
                               ["batch_size", 1, _length_dim(rules.get(name), "past_sequence_length"), width])
            for name, width in v4attn.cache_widths(config, layer_type, compressed).items()}


def _length_dim(rule: tuple[str, int] | None, per_token: str) -> str:
    """The symbolic length of a cache tensor of a length rule (None: one entry per position)."""
    return per_token if rule is None else f"{per_token}_{rule[0]}_{rule[1]}"


def step_inputs(g: GraphBuilder, model: HFModule, input_ids, mask_2d, position_ids,
                compressed: bool = False) -> v4attn.StepInputs:
    """The step's rotaries (main and compress), the sliding-window mask and where each row's tokens start;
    ``compressed``: the mask over the compressed layout's window and the step's new slots, and its row counts."""
    config = model.config
    rotary = model.model.rotary_emb
    if rotary.main_inv_freq.device.type == "meta":  # a skeleton's: rebuilt from the config (no weights in it)
        with torch.device("cpu"):
            rotary = type(rotary)(config=config)
    ropes = {}
    with g.scope("rope"):
        positions = g.op("Cast", position_ids, to=FLOAT)
        for kind in ("main", "compress"):
            rope = v4attn.Rope(None, None, to_numpy(getattr(rotary, f"{kind}_inv_freq")),  # type: ignore[arg-type]
                               float(getattr(rotary, f"{kind}_attention_scaling")))
            cos, sin = v4attn.rope_at(g, positions, rope)
            rope.cos, rope.sin = (g.op("Unsqueeze", t, g.const([1])) for t in (cos, sin))
            ropes[kind] = rope
    with g.scope("mask"):
        total = g.op("Gather", g.op("Shape", mask_2d), g.const(1), axis=0)
        seq = g.op("Gather", g.op("Shape", input_ids), g.const(1), axis=0)
        past = g.op("Sub", total, seq)
        # the keys' slots: every one (per-token), or the window's min(past, sliding_window - 1) and the step's
        first_key = g.op("Sub", past, g.op("Min", past, g.const(config.sliding_window - 1))) if compressed \
            else g.const(0)
        key_idx = g.op("Range", first_key, total, g.const(1))
        query_idx = g.op("Unsqueeze", g.op("Range", past, total, g.const(1)), g.const([1]))
        # transformers' sliding-window mask, over cache slots: the window's last sliding_window keys, causal
        recent = g.op("Greater", key_idx, g.op("Sub", query_idx, g.const(config.sliding_window)))
        allowed = g.op("And", g.op("LessOrEqual", key_idx, query_idx), recent)
        key_mask = g.op("Gather", mask_2d, key_idx, axis=1) if compressed else mask_2d
        allowed = g.op("And", allowed, g.op("Unsqueeze", g.op("Cast", key_mask, to=ir.DataType.BOOL),
                                             g.const([1, 2])))
        mask = g.op("Where", allowed, g.const(0.0, np.float32), g.const(blocks.MASK_MIN, np.float32))
        real = g.op("ReduceSum", mask_2d, g.const([1]), keepdims=1)
        first_slot = g.op("Sub", total, real)
        rows = None
        if compressed:
            new_mask = g.op("Slice", mask_2d, g.op("Unsqueeze", past, g.const([0])), g.const([np.iinfo(np.int64).max]),
                            g.const([1]))
            new_real = g.op("ReduceSum", new_mask, g.const([1]), keepdims=1)
            rows = v4attn.RowCounts(g.op("Sub", real, new_real), real, g.op("Unsqueeze", seq, g.const([0])),
                                    g.op("Unsqueeze", total, g.const([0])))
    return v4attn.StepInputs(ropes, mask, position_ids, first_slot, {}, rows)


def hyper_connection(g: GraphBuilder, hc, h: ir.Value):
    """(post [B, S, n], comb [B, S, n, n], the collapsed block input [B, S, hidden]) of streams h [B, S, n, hidden]
    (transformers' DeepseekV4HyperConnection)."""
    n, eps = hc.hc_mult, hc.hc_eps
    flat = g.op("Reshape", h, g.const([0, 0, -1]))
    normed = v4attn.rms_norm(g, flat, None, hc.input_norm.eps, "input_norm")
    mixes = blocks.matmul_weight(g, normed, g.params.array(hc.fn), "fn")
    pre, post, comb = g.op("Split", mixes, g.const([n, n, n * n]), axis=-1, outputs=3)
    pre_b, post_b, comb_b = g.op("Split", g.weight("base", g.params.array(hc.base)), g.const([n, n, n * n]), axis=0,
                                 outputs=3)
    pre_s, post_s, comb_s = g.op("Split", g.weight("scale", g.params.array(hc.scale)), g.const([1, 1, 1]), axis=0,
                                 outputs=3)
    pre = g.op("Add", g.op("Sigmoid", g.op("Add", g.op("Mul", pre, pre_s), pre_b)), g.const(eps, np.float32))
    post = g.op("Mul", g.op("Sigmoid", g.op("Add", g.op("Mul", post, post_s), post_b)), g.const(2.0, np.float32))
    square = g.const([0, 0, n, n])
    comb = g.op("Add", g.op("Reshape", g.op("Mul", comb, comb_s), square), g.op("Reshape", comb_b, g.const([n, n])))
    comb = g.op("Add", g.op("Softmax", comb, axis=-1), g.const(eps, np.float32))
    comb = _normalise(g, comb, -2, eps)
    with g.scope("sinkhorn"):
        for _ in range(hc.hc_sinkhorn_iters - 1):
            comb = _normalise(g, _normalise(g, comb, -1, eps), -2, eps)
    collapsed = g.op("ReduceSum", g.op("Mul", g.op("Unsqueeze", pre, g.const([-1])), h), g.const([2]), keepdims=0)
    return post, comb, collapsed


def _normalise(g: GraphBuilder, x, axis: int, eps: float):
    return g.op("Div", x, g.op("Add", g.op("ReduceSum", x, g.const([axis]), keepdims=1), g.const(eps, np.float32)))


def mix(g: GraphBuilder, post, comb, out, h):
    """The streams after a block: post x out spread over the streams, plus comb^T h."""
    spread = g.op("Mul", g.op("Unsqueeze", post, g.const([-1])), g.op("Unsqueeze", out, g.const([-2])))
    return g.op("Add", spread, g.op("MatMul", g.op("Transpose", comb, perm=[0, 1, 3, 2]), h))


def hyper_head(g: GraphBuilder, head, h):
    """hc_head: the streams collapsed by their sigmoid weights (transformers' DeepseekV4HyperHead)."""
    normed = v4attn.rms_norm(g, g.op("Reshape", h, g.const([0, 0, -1])), None, head.input_norm.eps, "input_norm")
    mixes = blocks.matmul_weight(g, normed, g.params.array(head.hc_fn), "hc_fn")
    pre = g.op("Add", g.op("Mul", mixes, g.weight("hc_scale", g.params.array(head.hc_scale))),
               g.weight("hc_base", g.params.array(head.hc_base)))
    pre = g.op("Add", g.op("Sigmoid", pre), g.const(head.eps, np.float32))
    return g.op("ReduceSum", g.op("Mul", g.op("Unsqueeze", pre, g.const([-1])), h), g.const([2]), keepdims=0)
