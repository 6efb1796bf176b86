"""DeepSeek-V3.2: V3's MLA and MoE plus DeepSeek Sparse Attention, a lightning indexer per layer that lets each
query attend to the ``index_topk`` cached tokens it scores highest.

The indexer (transformers' DeepseekV32Indexer, mirrored op for op in fp32): queries wq_b(q_a) from the query's
normed latent, ``index_n_heads`` heads of ``index_head_dim``; one key per token, LayerNorm(wk(h)); both rotated
on their first qk_rope_head_dim values by half-split RoPE (the MLA part rotates interleaved pairs). Its keys are a
third per-layer cache, ``past_key_values.N.index_key`` [batch, 1, past, index_head_dim] (transformers'
DynamicIndexedLayer.indexer_keys), grown along the sequence with the MLA cache; the stateful OpenVINO IR and the
runtimes pair it with ``present.N.index_key`` by name like the others. Scores:

    index[b, s, t] = sum_h (weights_proj(h)[b, s, h] * heads^-0.5) * relu(q[b, s, h] . k[b, t] * dim^-0.5)

plus the additive causal/padding mask (so a disallowed token scores the float32 minimum), and TopK with
k = min(index_topk, T) picks the chosen tokens. The attention mask keeps its value at the chosen tokens and is
the float32 minimum elsewhere, as transformers' eager path masks them (masked_fill with finfo.min). A disallowed
token that TopK picks (when fewer than k are allowed) stays masked, so what attention sees is the allowed tokens
among the chosen, as in transformers; with T <= index_topk every token is chosen and the mask is unchanged.

Ties: ONNX's TopK prefers the lower position between equal scores, torch.topk's CPU kernel leaves their order
unspecified. Only bit-equal index scores at the k-th place can make the chosen tokens differ; among allowed
tokens that is the case where relu zeroes every head's score for two tokens (disallowed tokens' choice never
matters). Both cache layouts (deepseek.py) carry the indexer unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx_ir as ir

from toolchain.errors import UnsupportedModelError
from toolchain.export import blocks
from toolchain.export.decoder import LayerInputs
from toolchain.export.deepseek_v3 import DeepseekV3Architecture
from toolchain.export.graph import GraphBuilder
from toolchain.export.moe_layer import config_value

INDEX_KEY = "index_key"  # the indexer's cache: past_key_values.N.index_key / present.N.index_key


class DeepseekV32Architecture(DeepseekV3Architecture):
    model_types: tuple[str, ...] = ("deepseek_v32",)
    rotations_per_layer = 4  # MLA's q and k, the indexer's q and k
    exports_mtp = True  # its MTP layer is a V3.2 layer, indexer and all (toolchain/export/mtp.py)
    # V3's FP8 layout with power-of-two scales and the indexer's wq_b and wk in e4m3, always (no bf16 form shipped)
    bf16_unless_asked = False

    def check(self, config) -> None:
        super().check(config)
        if config.q_lora_rank is None:
            raise UnsupportedModelError("deepseek_v32: the indexer reads the query's latent; q_lora_rank is required")
        if config.index_head_dim < config.qk_rope_head_dim:
            raise UnsupportedModelError(f"deepseek_v32: index_head_dim {config.index_head_dim} is below "
                                        f"qk_rope_head_dim {config.qk_rope_head_dim}, which the indexer rotates")
        other = sorted(set(config.layer_types or []) - {"indexed_attention"})
        if other:
            raise UnsupportedModelError(f"deepseek_v32: layer types {other} are not supported (indexed_attention)")

    def rope_interleaved(self, config) -> bool:
        return True  # V3.2's MLA always rotates interleaved pairs (its config has no rope_interleave)

    def extra_caches(self, config) -> dict[str, tuple[int, int]]:
        return {INDEX_KEY: (1, config.index_head_dim)}

    def moe_layers(self, config) -> list[int]:
        """transformers' V3.2 rule: the layers mlp_layer_types calls "sparse"."""
        if not config_value(config, "n_routed_experts"):
            return []
        types = config_value(config, "mlp_layer_types")
        return [i for i, t in enumerate(types) if t == "sparse"] if types else super().moe_layers(config)

    def head_layout(self, config) -> dict[str, tuple[str, int]]:
        return super().head_layout(config) | {"wq_b": ("out", config.index_head_dim)}

    def attention_inputs(self, g: GraphBuilder, attn, h, q_a, inputs: LayerInputs) -> LayerInputs:
        with g.scope("indexer"):
            mask, keys = sparse_mask(g, attn.indexer, h, q_a, inputs)
        inputs.present[INDEX_KEY] = keys
        return replace(inputs, mask=mask)


def sparse_mask(g: GraphBuilder, indexer, h, q_a, inputs: LayerInputs):
    """(the attention mask [B, 1, S, T] narrowed to the indexer's top-k tokens, the indexer's keys [B, 1, T, D]
    grown by this step's). h [B, S, hidden]: the normed hidden state; q_a [B, S, q_lora_rank]."""
    heads, dim, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    split = g.const([rope, dim - rope])

    def rotated(x):  # [B, *, S, dim]: half-split RoPE on the first ``rope`` values
        if dim == rope:
            return blocks.apply_rope(g, x, inputs.cos, inputs.sin)
        x_rot, x_pass = g.op("Split", x, split, axis=-1, outputs=2)
        return g.op("Concat", blocks.apply_rope(g, x_rot, inputs.cos, inputs.sin), x_pass, axis=-1)

    q = rotated(blocks.heads(g, blocks.linear(g, q_a, indexer.wq_b, "wq_b"), heads, dim))  # [B, H, S, D]
    k = blocks.layer_norm(g, blocks.linear(g, h, indexer.wk, "wk"), indexer.k_norm, "k_norm")
    k = rotated(g.op("Unsqueeze", k, g.const([1])))  # [B, 1, S, D]
    keys = g.op("Concat", inputs.past[INDEX_KEY], k, axis=2)  # [B, 1, T, D]
    scores = g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2]))  # [B, H, S, T]
    scores = g.op("Relu", g.op("Mul", scores, g.const(indexer.softmax_scale, np.float32)))
    weights = g.op("Mul", blocks.linear(g, h, indexer.weights_proj, "weights_proj"),
                   g.const(heads ** -0.5, np.float32))  # [B, S, H]
    # [B, S, 1, H] @ [B, S, H, T]: the heads' weighted sum, as transformers' matmul
    index = g.op("MatMul", g.op("Unsqueeze", weights, g.const([2])), g.op("Transpose", scores, perm=[0, 2, 1, 3]))
    index = g.op("Add", g.op("Transpose", index, perm=[0, 2, 1, 3]), inputs.mask)  # [B, 1, S, T]
    total = g.op("Shape", index, start=-1)
    k_top = g.op("Min", g.const([indexer.index_topk]), total)
    _, chosen = g.op("TopK", index, k_top, axis=-1, outputs=2)
    zeros = g.op("ConstantOfShape", g.op("Shape", index), value=ir.tensor(np.zeros(1, np.float32)))
    ones = g.op("ConstantOfShape", g.op("Shape", chosen), value=ir.tensor(np.ones(1, np.float32)))
    picked = g.op("Cast", g.op("ScatterElements", zeros, chosen, ones, axis=-1), to=ir.DataType.BOOL)
    mask = g.op("Where", picked, inputs.mask, g.const(blocks.MASK_MIN, np.float32))
    return mask, keys
