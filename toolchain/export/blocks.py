"""Building blocks shared by the per-architecture graph builders.

Each block mirrors the arithmetic of the transformers module it replaces (same operation order, fp32), so
that the exported graph matches PyTorch to rounding. Weights are read from the loaded transformers modules.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from toolchain.export.graph import GraphBuilder
from toolchain.export.weights import HFModule, LazyArray, to_numpy

Array = np.ndarray | LazyArray

# Additive mask value for disallowed positions: transformers' eager attention uses the dtype minimum; a fully
# masked row (a left-padding query position) then softmaxes to uniform weights instead of NaN.
MASK_MIN = float(np.finfo(np.float32).min)


def linear(g: GraphBuilder, x: ir.Value, module: torch.nn.Linear, name: str, rows: np.ndarray | None = None):
    """x @ W.T (+ b). ``rows`` optionally reorders the output features (used to de-interleave RoPE dims)."""
    weight = g.params.array(module.weight)
    bias = None if module.bias is None else g.params.array(module.bias)
    if rows is not None:
        weight = weight[rows]
        bias = None if bias is None else bias[rows]
    return matmul_weight(g, x, weight, name, bias)


def matmul_weight(g: GraphBuilder, x: ir.Value, weight: Array, name: str, bias: Array | None = None):
    """x @ weight.T for a [out, in] weight, stored transposed as MatMul's constant right operand."""
    with g.scope(name):
        y = g.op("MatMul", x, g.weight("weight", weight.T))
        if bias is not None:
            y = g.op("Add", y, g.weight("bias", bias))
    return y


def tied_lm_head(g: GraphBuilder, x: ir.Value, table: ir.Value, vocab: int) -> ir.Value:
    """x @ table.T with the [vocab, hidden] embedding table itself (tied embeddings), so the table is stored once.

    Gemm(transB=1) on x flattened to 2-D reads the table as it is: ORT's Gemm runs transB at MatMul's speed with
    no transposed copy (a MatMul of Transpose(table) is constant-folded into one, in ORT's session and in the
    artifact its offline optimisation saves), OpenVINO turns it into a FullyConnected on the [out, in] weight
    it stores anyway, and NNCF and the quantize passes take the table's per-row scales as the Gemm's per
    output channel ones.
    """
    assert table.shape is not None  # an initializer's shape is its tensor's
    with g.scope("lm_head"):
        flat = g.op("Reshape", x, g.const([-1, table.shape[1]]))
        logits = g.op("Gemm", flat, table, transB=1)
        lead = g.op("Slice", g.op("Shape", x), g.const([0]), g.const([-1]))
        return g.op("Reshape", logits, g.op("Concat", lead, g.const([vocab]), axis=0))


def rms_norm(g: GraphBuilder, x: ir.Value, module: HFModule, name: str) -> ir.Value:
    """weight * x / sqrt(mean(x^2) + eps), the order transformers' RMSNorm computes in."""
    with g.scope(name):
        var = g.op("ReduceMean", g.op("Pow", x, g.const(2.0, np.float32)), g.const([-1]), keepdims=1)
        denom = g.op("Sqrt", g.op("Add", var, g.const(module.variance_epsilon, np.float32)))
        return g.op("Mul", g.weight("weight", g.params.array(module.weight)), g.op("Div", x, denom))


def layer_norm(g: GraphBuilder, x: ir.Value, module: torch.nn.LayerNorm, name: str) -> ir.Value:
    """torch's LayerNorm over the last axis (biased variance, eps inside the root): ONNX LayerNormalization."""
    with g.scope(name):
        bias = None if module.bias is None else g.weight("bias", g.params.array(module.bias))
        return g.op("LayerNormalization", x, g.weight("weight", g.params.array(module.weight)), bias, axis=-1,
                    epsilon=float(module.eps))


def rope_tables(g: GraphBuilder, position_ids: ir.Value, rotary: HFModule):
    """cos and sin, [batch, 1, seq, rope_dim], from a transformers rotary module's inv_freq and scaling.

    Taking inv_freq and attention_scaling from the loaded module covers every static RoPE variant
    (default, llama3, yarn) without re-deriving their formulas.
    """
    inv_freq = to_numpy(rotary.inv_freq)  # a real buffer: the rotary module is rebuilt from the config
    scaling = float(rotary.attention_scaling)
    with g.scope("rope"):
        pos = g.op("Unsqueeze", g.op("Cast", position_ids, to=ir.DataType.FLOAT), g.const([-1]))
        freqs = g.op("Mul", pos, g.weight("inv_freq", inv_freq))
        emb = g.op("Concat", freqs, freqs, axis=-1)
        cos, sin = g.op("Cos", emb), g.op("Sin", emb)
        if scaling != 1.0:
            cos = g.op("Mul", cos, g.const(scaling, np.float32))
            sin = g.op("Mul", sin, g.const(scaling, np.float32))
        return g.op("Unsqueeze", cos, g.const([1])), g.op("Unsqueeze", sin, g.const([1]))


def apply_rope(g: GraphBuilder, x: ir.Value, cos: ir.Value, sin: ir.Value) -> ir.Value:
    """x * cos + rotate_half(x) * sin, for x of shape [batch, heads, seq, rope_dim]."""
    x1, x2 = g.op("Split", x, axis=-1, num_outputs=2, outputs=2)
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def deinterleave_rows(dim: int) -> np.ndarray:
    """Permutation taking RoPE dims stored as interleaved pairs (x0, x1), (x2, x3) ... to halves
    [x0 x2 ... | x1 x3 ...].

    Applied to the projection weights' output rows at export time, it turns DeepSeek's interleaved/complex RoPE
    into the rotate-half form with the same values, with no reshuffling op left in the graph.
    """
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def attention_mask(g: GraphBuilder, input_ids: ir.Value, mask_2d: ir.Value) -> ir.Value:
    """Additive mask [batch, 1, seq, total]: causal over absolute positions, and padding from attention_mask.

    Query i of this step sits at absolute index past + i with past = total - seq, as in transformers' cache
    positions; key j is allowed when j <= past + i and attention_mask[b, j] == 1.
    """
    with g.scope("mask"):
        total = g.op("Gather", g.op("Shape", mask_2d), g.const(1), axis=0)
        seq = g.op("Gather", g.op("Shape", input_ids), g.const(1), axis=0)
        past = g.op("Sub", total, seq)
        key_idx = g.op("Range", g.const(0), total, g.const(1))
        query_idx = g.op("Unsqueeze", g.op("Range", past, total, g.const(1)), g.const([1]))
        causal = g.op("LessOrEqual", key_idx, query_idx)
        padding = g.op("Unsqueeze", g.op("Cast", mask_2d, to=ir.DataType.BOOL), g.const([1, 2]))
        allowed = g.op("And", causal, padding)
        return g.op("Where", allowed, g.const(0.0, np.float32), g.const(MASK_MIN, np.float32))


def heads(g: GraphBuilder, x: ir.Value, num_heads: int, head_dim: int) -> ir.Value:
    """[batch, seq, heads*dim] -> [batch, heads, seq, dim]."""
    return g.op("Transpose", g.op("Reshape", x, g.const([0, 0, num_heads, head_dim])), perm=[0, 2, 1, 3])


def sdpa(g: GraphBuilder, q, k, v, mask, scale: float, num_heads: int, n_rep: int = 1, dims=(0, 0)) -> ir.Value:
    """softmax(q k^T * scale + mask) v, merged back to [batch, seq, heads*v_dim].

    With n_rep > 1 (GQA) each of the num_heads/n_rep k/v heads is repeated n_rep times; dims = (k_dim, v_dim).
    """
    with g.scope("sdpa"):
        if n_rep > 1:
            k, v = (_repeat_kv(g, t, n_rep, num_heads, d) for t, d in zip((k, v), dims))
        scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(scale, np.float32))
        probs = g.op("Softmax", g.op("Add", scores, mask), axis=-1)
        out = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])
        return g.op("Reshape", out, g.const([0, 0, -1]))


def _repeat_kv(g: GraphBuilder, x: ir.Value, n_rep: int, num_heads: int, dim: int) -> ir.Value:
    """[b, kv, t, d] -> [b, kv*n_rep, t, d] with each kv head repeated n_rep times in place (transformers'
    repeat_kv)."""
    expanded = g.op("Expand", g.op("Unsqueeze", x, g.const([2])), g.const([1, 1, n_rep, 1, 1]))
    return g.op("Reshape", expanded, g.const([0, num_heads, -1, dim]))


def gated_mlp(g: GraphBuilder, x: ir.Value, gate: Array, up: Array, down: Array,
              biases: tuple | None = None, limit: float | None = None) -> ir.Value:
    """down(silu(gate(x)) * up(x)) for [out, in] weight matrices. ``limit``: DeepSeek-V4's clipped SwiGLU
    (swiglu_limit), gate(x) clamped from above and up(x) to [-limit, limit]."""
    gb, ub, db = biases or (None, None, None)
    g_out = matmul_weight(g, x, gate, "gate_proj", gb)
    if limit is not None:
        g_out = g.op("Min", g_out, g.const(limit, np.float32))
    act = g.op("Mul", g_out, g.op("Sigmoid", g_out))
    up_out = matmul_weight(g, x, up, "up_proj", ub)
    if limit is not None:
        up_out = g.op("Clip", up_out, g.const(-limit, np.float32), g.const(limit, np.float32))
    return matmul_weight(g, g.op("Mul", act, up_out), down, "down_proj", db)


DENSE_MLP = "dense"  # the scope of a dense (non-MoE) MLP's projections inside a layer's "mlp"


def mlp_module(g: GraphBuilder, x: ir.Value, module: HFModule, name: str, limit: float | None = None) -> ir.Value:
    """A transformers gate/up/down MLP module (silu, which the architecture check guarantees); ``limit`` as
    gated_mlp's."""
    parts = [module.gate_proj, module.up_proj, module.down_proj]
    biases = tuple(None if p.bias is None else g.params.array(p.bias) for p in parts)
    with g.scope(name):
        gate, up, down = (g.params.array(p.weight) for p in parts)
        return gated_mlp(g, x, gate, up, down, biases=biases, limit=limit)
