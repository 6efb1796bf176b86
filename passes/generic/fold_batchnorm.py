"""fold-batchnorm: fold inference-mode BatchNormalization into the Conv/ConvTranspose/Gemm/MatMul before it.

BN(y) = s * (y - mean) + beta with s = gamma / sqrt(var + eps), applied per channel along axis 1 of ``y``. It
folds into a linear op exactly when axis 1 of the op's output is the axis its constant weight produces:

* Conv / ConvTranspose: output [N, C, ...], channels from the weight's output-channel axis -> always.
* Gemm: output [M, N], axis 1 = columns of B (rows when transB=1) -> always.
* MatMul(x, W) with W constant [K, C]: the weight produces the *last* output axis, so only a rank-2 output
  [N, C] qualifies; for a rank-3 output [N, C, L] BN normalises C, which comes from ``x``, not from W.
* MatMul(W, x) with W constant [C, K] and x [N, K, L]: the weight produces axis -2, so only a rank-3 output
  [N, C, L] qualifies (a 1x1 Conv1d written as MatMul).

An optional constant bias Add between MatMul and BN folds too. Weights, biases and BN parameters must be
constant, and the intermediate value must have no other consumer (the matcher's removability check).
Conv/ConvTranspose/Gemm are onnxscript's rules (its ``rules.common`` exports them only as built rules, so they
are written here with the public rewriter API, their arithmetic unchanged) with the checks they lack
(inference mode, dtypes); onnxscript has no MatMul rule, hence ours.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from passes.graph import Names, constant_array, initializer_data, known_rank, present, produced
from passes.registry import register
from passes.rewrite import RewriteRulesPass


def _check_inference_batchnorm(bn: ir.Node, weight_dtype: ir.DataType | None) -> MatchResult:
    result = MatchResult()
    if bn.attributes.get_int("training_mode", 0):
        return result.fail("BatchNormalization is in training mode (normalises with batch statistics)")
    if len(bn.outputs) > 1:
        return result.fail("BatchNormalization has training outputs (running mean/var)")
    if bn.attributes.get_int("spatial", 1) != 1:
        return result.fail("BatchNormalization is per-activation (spatial=0)")
    for param in bn.inputs[1:]:
        if param is None or param.dtype != weight_dtype:
            return result.fail(f"BatchNormalization parameters are not all of the weight's dtype {weight_dtype}")
    return result


class _BatchNormInto(RewriteRuleClassBase):
    """BatchNormalization(op_type(x, W[, B])) -> op_type(x, W * s, (beta_gemm * B - mean) * s + beta), as
    onnxscript's FuseBatchNormInto{Conv,ConvTranspose,Gemm}, with s = gamma / sqrt(var + eps) along the axis of
    W that makes the output channels."""

    def __init__(self, name: str, op_type: str) -> None:
        super().__init__(name)
        self.op_type = op_type

    def pattern(self, op, x):
        inbound = getattr(op, self.op_type)(x, _allow_other_inputs=True, _outputs=["inbound_out"])
        return op.BatchNormalization(inbound, _allow_other_inputs=True, _outputs=["batchnorm_out"])

    def check(self, context, x, inbound_out: ir.Value, batchnorm_out: ir.Value) -> MatchResult:
        result = MatchResult()
        inbound, bn = produced(inbound_out), produced(batchnorm_out)
        parameters = [inbound.inputs[1], *bn.inputs[1:], *inbound.inputs[2:3]]
        for value in parameters:
            if value is None or not value.is_initializer() or value.const_value is None:
                return result.fail(f"{value.name if value is not None else 'an input'} is not a constant initializer.")
            if value.is_graph_input():
                return result.fail(f"{value.name} is a graph input.")
        weight = present(inbound.inputs[1])  # constant, as checked above, and so is the bias if there is one
        for value in map(present, inbound.inputs[1:3]):  # the fused weight and bias take their names
            for user, _ in value.uses():
                if user not in (inbound, bn):
                    return result.fail(f"Initializer '{value.name}' is used by another node '{user.name}' "
                                       "outside the matched pattern.")
        if self.op_type == "ConvTranspose":
            in_channels = initializer_data(weight).shape[0]
            group = inbound.attributes.get_int("group", 1)
            if in_channels % group:
                return result.fail(f"ConvTranspose in_channels ({in_channels}) is not divisible by group ({group}).")
        return _check_inference_batchnorm(bn, weight.dtype)

    def _scaled(self, weights: np.ndarray, scale: np.ndarray, inbound: ir.Node) -> np.ndarray:
        if self.op_type == "ConvTranspose":  # W [in, out / group, *kernel]: scale the out channels of each group
            group = inbound.attributes.get_int("group", 1)
            in_channels, out_per_group, kernel = weights.shape[0], weights.shape[1], weights.shape[2:]
            w = weights.reshape(group, in_channels // group, out_per_group, *kernel)
            s = scale.reshape((group, out_per_group) + (1,) * len(kernel))[:, None, ...]
            return (w * s).reshape(weights.shape)
        axis = 1 if self.op_type == "Gemm" and not inbound.attributes.get_int("transB", 0) else 0
        return weights * np.reshape(scale, [-1 if i == axis else 1 for i in range(weights.ndim)])

    def rewrite(self, op, x: ir.Value, inbound_out: ir.Value, batchnorm_out: ir.Value):
        bn, inbound = produced(batchnorm_out), produced(inbound_out)
        gamma, beta, mean, var = (initializer_data(value) for value in bn.inputs[1:])
        scale = gamma / np.sqrt(var + bn.attributes.get_float("epsilon", 1e-5))
        weight = present(inbound.inputs[1])
        weights = initializer_data(weight)
        attributes = dict(inbound.attributes)
        gemm_beta = attributes.pop("beta").as_float() if "beta" in attributes else 1.0  # folded into the bias
        if len(inbound.inputs) > 2:
            bias_value = present(inbound.inputs[2])
            bias, bias_name = initializer_data(bias_value), bias_value.name
        else:
            bias, bias_name = np.zeros_like(mean), f"{weight.name}_bias"
        fused_weights = ir.tensor(self._scaled(weights, scale, inbound))
        fused_bias = ir.tensor((gemm_beta * bias - mean) * scale + beta)
        return op.op(self.op_type, x, op.initializer(fused_weights, name=weight.name),
                     op.initializer(fused_bias, name=bias_name), **attributes)


class _MatMulBatchNorm(RewriteRuleClassBase):
    """Shared check/rewrite for BN(MatMul) and BN(Add(MatMul, bias)): plans the folded tensors in ``check``."""

    def _plan(self, context, matmul: ir.Node, bias: ir.Value | None, bn: ir.Node) -> MatchResult:
        result = MatchResult()
        a, b = matmul.inputs
        rank = known_rank(matmul.outputs[0])
        rank_a, rank_b = known_rank(a), known_rank(b)
        if rank is None and rank_a is not None and rank_b is not None and min(rank_a, rank_b) >= 2:
            rank = max(rank_a, rank_b)  # batch dimensions broadcast
        if rank is None or rank < 2:
            return result.fail("rank of the MatMul output is unknown or < 2 (run infer-shapes first)")
        w_right, w_left = constant_array(b), constant_array(a)
        if w_right is not None and w_right.ndim == 2 and rank == 2:
            weight_value, weight, channel_axis = present(b), w_right, 1
        elif w_left is not None and w_left.ndim == 2 and rank == 3:
            weight_value, weight, channel_axis = present(a), w_left, 0
        elif w_right is not None and w_right.ndim == 2:
            return result.fail(
                f"BatchNormalization normalises axis 1 of the rank-{rank} MatMul output but the weight "
                f"produces its last axis; folding is exact only for rank 2"
            )
        elif w_left is not None and w_left.ndim == 2:
            return result.fail(
                f"BatchNormalization normalises axis 1 of the rank-{rank} MatMul output but the left weight "
                f"produces axis {rank - 2}; folding is exact only for rank 3"
            )
        else:
            return result.fail("MatMul has no constant 2-D weight")
        if len(weight_value.uses()) > 1:
            return result.fail(f"weight {weight_value.name!r} is shared with other nodes")
        check = _check_inference_batchnorm(bn, weight_value.dtype)
        if not check:
            return check
        params = [constant_array(v) for v in bn.inputs[1:5]]
        channels = weight.shape[channel_axis]
        vectors = [p for p in params if p is not None and p.shape == (channels,)]
        if len(vectors) != len(params):
            return result.fail(f"BatchNormalization parameters are not constant vectors of {channels} channels")
        bias_array = np.zeros((), weight.dtype)
        if bias is not None:
            constant = constant_array(bias)
            if constant is None or constant.ndim > rank or bias.dtype != weight_value.dtype:
                return result.fail("the Add between MatMul and BatchNormalization has no constant bias")
            bias_array = constant
        graph = context.graph_or_function
        if not isinstance(graph, ir.Graph):
            return result.fail("folding inside a function is not supported (no initializers there)")

        gamma, beta, mean, var = vectors
        scale = gamma / np.sqrt(var + np.asarray(bn.attributes.get_float("epsilon", 1e-5), var.dtype))
        channel_shape = (1, channels) + (1,) * (rank - 2)  # BN's axis 1 in the output
        fused_bias = (bias_array.reshape((1,) * (rank - bias_array.ndim) + bias_array.shape)
                      - mean.reshape(channel_shape)) * scale.reshape(channel_shape) + beta.reshape(channel_shape)
        while fused_bias.ndim > 1 and fused_bias.shape[0] == 1:
            fused_bias = fused_bias[0]
        weight_scale = scale[None, :] if channel_axis == 1 else scale[:, None]
        names = Names(graph)
        self._fused = (
            channel_axis,
            ir.tensor((weight * weight_scale).astype(weight.dtype), name=names.fresh(f"{weight_value.name}_bn")),
            ir.tensor(fused_bias.astype(weight.dtype), name=names.fresh(f"{weight_value.name}_bn_bias")),
        )
        return result

    def rewrite(self, op, a, b, **_):
        channel_axis, weight, bias = self._fused
        weight_value = op.initializer(weight)
        product = op.MatMul(a, weight_value) if channel_axis == 1 else op.MatMul(weight_value, b)
        return op.Add(product, op.initializer(bias))


class MatMulBatchNorm(_MatMulBatchNorm):
    def pattern(self, op, a, b):
        return op.BatchNormalization(
            op.MatMul(a, b, _outputs=["matmul_out"]), _allow_other_inputs=True, _outputs=["bn_out"]
        )

    def check(self, context, a, b, matmul_out: ir.Value, bn_out: ir.Value) -> MatchResult:
        return self._plan(context, produced(matmul_out), None, produced(bn_out))


class MatMulAddBatchNorm(_MatMulBatchNorm):
    def pattern(self, op, a, b, bias):
        return op.BatchNormalization(
            op.Add(op.MatMul(a, b, _outputs=["matmul_out"]), bias), _allow_other_inputs=True, _outputs=["bn_out"]
        )

    def check(self, context, a, b, bias, matmul_out: ir.Value, bn_out: ir.Value) -> MatchResult:
        return self._plan(context, produced(matmul_out), bias, produced(bn_out))


@register("fold-batchnorm", description="Fold inference BatchNormalization into a preceding Conv/Gemm/MatMul.")
class FoldBatchNorm(RewriteRulesPass):
    """Counts: ``conv``, ``conv_transpose``, ``gemm``, ``matmul``, ``matmul_add`` (BNs folded)."""

    def __init__(self) -> None:
        super().__init__(
            [
                _BatchNormInto("conv", "Conv"),
                _BatchNormInto("conv_transpose", "ConvTranspose"),
                _BatchNormInto("gemm", "Gemm"),
                MatMulAddBatchNorm("matmul_add"),
                MatMulBatchNorm("matmul"),
            ],
            commute=True,
        )
