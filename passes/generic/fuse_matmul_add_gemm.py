"""fuse-matmul-add-gemm: Add(MatMul(A, W), bias) -> Gemm(A, W, bias), also absorbing [1, 0] Transposes of A/W.

Reuses onnxscript's four MatMul+Add->Gemm rules with a stricter check: theirs only asks for rank-2 A and W,
while a dstc Gemm also needs W constant and a bias that broadcasts to [N] (shape [], [1], [N], [1, 1] or
[1, N]), so the fused Gemm computes exactly what the Add did. 3-D (batched) inputs never match.
"""

from __future__ import annotations

from onnxscript.rewriter import MatchResult
from onnxscript.rewriter.rules.common._matmul_add_to_gemm import (
    MatMulAddToGemm,
    TransABMatMulAddToGemm,
    TransAMatMulAddToGemm,
    TransBMatMulAddToGemm,
)

from passes.graph import constant_array, known_rank
from passes.registry import register
from passes.rewrite import RewriteRulesPass


class _GemmCompatible:
    """Check for onnxscript's MatMul+Add->Gemm rules: 2-D A, constant 2-D weight, bias broadcastable to [N]."""

    def check(self, context, input_a, input_b, input_c, **_) -> MatchResult:
        result = MatchResult()
        rank_a = known_rank(input_a)
        if rank_a != 2:
            return result.fail(f"input A has rank {rank_a if rank_a is not None else 'unknown'}, Gemm needs 2")
        weight = constant_array(input_b)
        if weight is None or weight.ndim != 2:
            return result.fail("the MatMul weight is not a constant 2-D tensor")
        n = weight.shape[0] if self.trans_b else weight.shape[1]
        bias_shape = input_c.shape
        if bias_shape is None and (bias := constant_array(input_c)) is not None:
            bias_shape = bias.shape
        if bias_shape is None or not all(isinstance(d, int) for d in bias_shape):
            return result.fail("the bias shape is unknown")
        dims = list(bias_shape)
        if len(dims) > 2 or (len(dims) == 2 and dims[0] != 1) or (dims and dims[-1] not in (1, n)):
            return result.fail(f"bias of shape {dims} does not broadcast to [{n}]")
        return result


class GemmFromMatMulAdd(_GemmCompatible, MatMulAddToGemm):
    pass


class GemmFromTransposedAMatMulAdd(_GemmCompatible, TransAMatMulAddToGemm):
    pass


class GemmFromTransposedBMatMulAdd(_GemmCompatible, TransBMatMulAddToGemm):
    pass


class GemmFromTransposedABMatMulAdd(_GemmCompatible, TransABMatMulAddToGemm):
    pass


@register("fuse-matmul-add-gemm", description="Fuse 2-D MatMul with a constant weight and a bias Add into Gemm.")
class FuseMatMulAddGemm(RewriteRulesPass):
    """Counts: ``gemm`` (plain), ``gemm_trans_a``, ``gemm_trans_b``, ``gemm_trans_ab`` (Gemms created)."""

    def __init__(self) -> None:
        super().__init__(
            [
                GemmFromTransposedABMatMulAdd("gemm_trans_ab"),
                GemmFromTransposedAMatMulAdd("gemm_trans_a"),
                GemmFromTransposedBMatMulAdd("gemm_trans_b"),
                GemmFromMatMulAdd("gemm"),
            ],
            commute=True,
        )
