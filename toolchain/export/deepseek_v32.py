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
k = min(index_topk, T) picks the chosen tokens, positions [B, 1, S, k] (IndexedInputs.chosen). The attention
gathers them (deepseek.py's latent_context / per_head_context hooks): each query's k rows of the latent [B, T, rank]
and rotary key [B, T, rope] caches, read from the past and the step's entries apart (chosen_rows; the indexer
scores the two apart too, so each grown cache feeds its present output only and an appending runner copies no
cache per step), to [B, S, k, *], scores are [B, S, H, k], the
softmax runs over k with the mask's values at the chosen positions (GatherElements), and the context is the
probabilities times the gathered latent: attention reads and multiplies k cached tokens per query, not T (the
indexer alone still scores all T, with its 64 heads of 128 against MLA's 128 of 576). transformers' eager path
masks the unchosen tokens with finfo.min instead, which gives them zero weight: the same sum, in another order.
A disallowed token that TopK picks (when fewer than k are allowed) stays masked, so what attention sees is the
allowed tokens among the chosen, as in transformers. The per-head layout gathers per head (GatherND batch_dims 2,
[B, H, S, k, nope + rope] and [B, H, S, k, v]), which is H times wider per query: it does so for up to
GATHERED_QUERIES queries (a decode step, a speculative verify) and keeps the mask narrowed to the chosen tokens
over the dense scores for a prompt (an If on the query length). The latent layout always gathers: per query its
gathered rows are k x (rank + rope) floats (4.7 MB at V3.2's widths), and its scores [H, k], where the dense
form's were [H, T] (and its product did H x T x (rank + rope) work instead of H x k x (rank + rope)); an If would
also keep compress's prefill-int8 pass (ORT INT4 prompts) from wrapping the decoder, which it does only for a
span without subgraphs.

Ties: ONNX's TopK prefers the lower position between equal scores, torch.topk's CPU kernel leaves their order
unspecified. Only bit-equal index scores at the k-th place can make the chosen tokens differ; among allowed
tokens that is the case where relu zeroes every head's score for two tokens (disallowed tokens' choice never
matters). Both cache layouts (deepseek.py) carry the indexer unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from toolchain.errors import UnsupportedModelError
from toolchain.export import blocks
from toolchain.export.decoder import LayerInputs
from toolchain.export.deepseek_v3 import DeepseekV3Architecture
from toolchain.export.graph import GraphBuilder
from toolchain.export.moe_layer import config_value

# The per-head layout gathers [H, k, nope + rope + v] floats per query (at V3.2's widths 128 x 2048 x 320: 335 MB),
# where the dense path's scores are [H, T] per query: beyond a decode step or a speculative verify the dense masked
# path is kept (an If on the query length).
GATHERED_QUERIES = 4
INDEX_KEY = "index_key"  # the indexer's cache: past_key_values.N.index_key / present.N.index_key


class DeepseekV32Architecture(DeepseekV3Architecture):
    model_types: tuple[str, ...] = ("deepseek_v32",)
    rotations_per_layer = 4  # MLA's q and k, the indexer's q and k
    exports_mtp = True  # its MTP layer is a V3.2 layer, indexer and all (toolchain/export/mtp.py)
    mtp_layer_classes: tuple[str, str, str] | None = (
        "transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32DecoderLayer", "DeepseekV32RMSNorm")
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
            # the latent layout reads its caches' past and new entries apart (chosen_rows), for a runner that
            # appends; the per-head layout reads the grown caches (OpenVINO's stateful per-head IR disagreed with
            # PyTorch, 0.74 of the logit range, when its indexer scored the two apart)
            chosen, keys = top_k_positions(g, attn.indexer, h, q_a, inputs, apart=self.kv_cache == "latent")
        inputs.present[INDEX_KEY] = keys
        return IndexedInputs(**vars(inputs), chosen=chosen)

    def latent_context(self, g: GraphBuilder, attn, q_lat, q_rot, key, value, inputs: LayerInputs, new):
        assert isinstance(inputs, IndexedInputs)
        del key, value  # the grown caches feed the present outputs only: the chosen rows are read apart
        new_key, new_value = new
        latent, k_rot = chosen_rows(g, g.op("Squeeze", inputs.chosen, g.const([1])),
                                    [(inputs.past_value, new_value), (inputs.past_key, new_key)])
        per_query = [0, 2, 1, 3]  # [B, H, S, d] <-> [B, S, H, d]
        nope_scores = g.op("MatMul", g.op("Transpose", q_lat, perm=per_query),
                           g.op("Transpose", latent, perm=[0, 1, 3, 2]))
        rope_scores = g.op("MatMul", g.op("Transpose", q_rot, perm=per_query),
                           g.op("Transpose", k_rot, perm=[0, 1, 3, 2]))
        scores = g.op("Mul", g.op("Add", nope_scores, rope_scores), g.const(attn.scaling, np.float32))  # [B, S, H, k]
        mask = g.op("Transpose", chosen_mask(g, inputs), perm=per_query)  # [B, S, 1, k]
        probs = g.op("Softmax", g.op("Add", scores, mask), axis=-1)
        return g.op("Transpose", g.op("MatMul", probs, latent), perm=per_query)  # [B, H, S, rank]

    def per_head_context(self, g: GraphBuilder, attn, q, key, value, inputs: LayerInputs):
        assert isinstance(inputs, IndexedInputs)
        queries = g.op("Squeeze", g.op("Shape", q, start=2, end=3))
        gather = g.op("LessOrEqual", queries, g.const(GATHERED_QUERIES))
        dense = lambda: blocks.sdpa(g, q, key, value, narrowed_mask(g, inputs), attn.scaling,  # noqa: E731
                                    attn.num_heads)
        return g.op("If", gather, then_branch=g.subgraph("gathered", lambda: gathered_per_head(g, attn, q, key, value,
                                                                                                  inputs)),
                    else_branch=g.subgraph("dense", dense))


@dataclass
class IndexedInputs(LayerInputs):
    chosen: ir.Value | None = None  # [B, 1, S, k] int64: the cached positions each query attends to, best first


def gathered_per_head(g: GraphBuilder, attn, q, key, value, inputs: IndexedInputs) -> ir.Value:
    """The per-head layout's attention over the chosen cached keys and values only, [B, S, H * v]: q [B, H, S, d],
    key and value [B, H, T, *] gathered to [B, H, S, k, *]."""
    positions = g.op("Expand", g.op("Unsqueeze", inputs.chosen, g.const([-1])),
                     g.const([1, attn.num_heads, 1, 1, 1]))  # [B, H, S, k, 1]
    keys = g.op("GatherND", key, positions, batch_dims=2)
    values = g.op("GatherND", value, positions, batch_dims=2)
    one_row = g.const([3])  # each query a [1, d] row against its own k keys
    scores = g.op("MatMul", g.op("Unsqueeze", q, one_row), g.op("Transpose", keys, perm=[0, 1, 2, 4, 3]))
    scores = g.op("Mul", scores, g.const(attn.scaling, np.float32))  # [B, H, S, 1, k]
    probs = g.op("Softmax", g.op("Add", scores, g.op("Unsqueeze", chosen_mask(g, inputs), one_row)), axis=-1)
    out = g.op("Squeeze", g.op("MatMul", probs, values), one_row)  # [B, H, S, v]
    return g.op("Reshape", g.op("Transpose", out, perm=[0, 2, 1, 3]), g.const([0, 0, -1]))


def chosen_rows(g: GraphBuilder, positions: ir.Value, caches: list[tuple[ir.Value, ir.Value]]) -> list[ir.Value]:
    """Each cache's chosen rows per query, [B, S, k, d]: positions [B, S, k] into the past [B, 1, P, d] followed by
    this step's entries [B, 1, S, d], read from the two apart (a position p < P is past row p, else new row p - P),
    not from their concatenation, so that the grown cache feeds its present output only and a runner that appends
    the new entries itself drops the copy (toolchain/runtime/appending_cache.py). No If (compress's prefill-int8
    pass wraps only a span without subgraphs): the new rows are gathered at every chosen position, clamped into
    range, and the past rows, found by NonZero (none when the past is empty, which GatherND could not index), are
    scattered over them."""
    past_len = g.op("Shape", caches[0][0], start=2, end=3)  # [1]
    in_past = g.op("Transpose", g.op("NonZero", g.op("Less", positions, past_len)), perm=[1, 0])  # [N, 3]: b, s, j
    batch = g.op("Slice", in_past, g.const([0]), g.const([1]), g.const([1]))  # [N, 1]
    rows = g.op("Concat", batch, g.op("Unsqueeze", g.op("GatherND", positions, in_past), g.const([1])), axis=1)
    from_new = g.op("Unsqueeze", g.op("Max", g.op("Sub", positions, past_len), g.const(0)), g.const([-1]))
    out = []
    for past, new in caches:
        dense = g.op("GatherND", g.op("Squeeze", new, g.const([1])), from_new, batch_dims=1)  # [B, S, k, d]
        out.append(g.op("ScatterND", dense, in_past, g.op("GatherND", g.op("Squeeze", past, g.const([1])), rows)))
    return out


def chosen_mask(g: GraphBuilder, inputs: IndexedInputs) -> ir.Value:
    """The additive mask's values at the chosen positions, [B, 1, S, k]: a disallowed token that TopK picks (fewer
    than k allowed) stays masked."""
    return g.op("GatherElements", inputs.mask, inputs.chosen, axis=-1)


def narrowed_mask(g: GraphBuilder, inputs: IndexedInputs) -> ir.Value:
    """The additive mask [B, 1, S, T] kept at the chosen positions and the float32 minimum elsewhere."""
    zeros = g.op("ConstantOfShape", g.op("Shape", inputs.mask), value=ir.tensor(np.zeros(1, np.float32)))
    ones = g.op("ConstantOfShape", g.op("Shape", inputs.chosen), value=ir.tensor(np.ones(1, np.float32)))
    picked = g.op("Cast", g.op("ScatterElements", zeros, inputs.chosen, ones, axis=-1), to=ir.DataType.BOOL)
    return g.op("Where", picked, inputs.mask, g.const(blocks.MASK_MIN, np.float32))


def top_k_positions(g: GraphBuilder, indexer, h, q_a, inputs: LayerInputs, apart: bool):
    """(the positions [B, 1, S, k] of the k = min(index_topk, T) tokens each query scores highest, the indexer's
    keys [B, 1, T, D] grown by this step's). h [B, S, hidden]: the normed hidden state; q_a [B, S, q_lora_rank].
    ``apart``: the past keys and this step's are scored apart, so that the grown keys feed the present output only."""
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
    keys = g.op("Concat", inputs.past[INDEX_KEY], k, axis=2)  # [B, 1, T, D]: the present output only
    q = g.op("Transpose", q, perm=[0, 2, 1, 3])  # [B, S, H, D]
    weights = g.op("Unsqueeze", g.op("Mul", blocks.linear(g, h, indexer.weights_proj, "weights_proj"),
                                     g.const(heads ** -0.5, np.float32)), g.const([2]))  # [B, S, 1, H]

    def index_of(cached):  # [B, 1, t, D] -> [B, S, 1, t]
        # [B, S, H, D] @ [B, 1, D, t]: the scores query-major, so that no [.., t] tensor is transposed (a decode step
        # at 32k spent 23 ms per layer on ONNX Runtime transposing [B, H, S, T] scores)
        scores = g.op("MatMul", q, g.op("Transpose", cached, perm=[0, 1, 3, 2]))
        scores = g.op("Relu", g.op("Mul", scores, g.const(indexer.softmax_scale, np.float32)))
        return g.op("MatMul", weights, scores)  # [B, S, 1, H] @ [B, S, H, t]: the heads' sum, as transformers'

    # the past keys and this step's scored apart, each token's score as from the grown keys (the same products), so
    # that the grown keys feed the present output only (chosen_rows)
    index = (g.op("Concat", index_of(inputs.past[INDEX_KEY]), index_of(k), axis=-1) if apart
             else index_of(keys))  # [B, S, 1, T]
    index = g.op("Add", g.op("Transpose", index, perm=[0, 2, 1, 3]), inputs.mask)  # [B, 1, S, T]
    total = g.op("Shape", index, start=-1)
    k_top = g.op("Min", g.const([indexer.index_topk]), total)
    _, chosen = g.op("TopK", index, k_top, axis=-1, outputs=2)
    return chosen, keys
