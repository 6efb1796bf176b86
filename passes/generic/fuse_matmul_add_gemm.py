"""fuse-matmul-add-gemm: Add(MatMul(A, W), bias) -> Gemm(A, W, bias), also absorbing [1, 0] Transposes of A/W.

onnxscript's four MatMul+Add->Gemm rules (its ``rules.common`` exports them only as built rules, so they are
written here with the public rewriter API) with a stricter check: theirs only asks for rank-2 A and W, while a
dstc Gemm also needs W constant and a bias that broadcasts to [N] (shape [], [1], [N], [1, 1] or [1, N]), so
the fused Gemm computes exactly what the Add did. 3-D (batched) inputs never match. A weight stored in bf16 and
widened by a Cast (passes.graph.stored_weight) is constant too: the Gemm reads the Cast's output.
"""

from __future__ import annotations

from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from passes.graph import constant_array, constant_shape, known_rank
from passes.registry import register
from passes.rewrite import RewriteRulesPass


class _MatMulAddGemm(RewriteRuleClassBase):
    """Add(MatMul(A, W), C) -> Gemm(A, W, C), A and/or W through a [1, 0] Transpose for ``trans_a``/``trans_b``."""

    def __init__(self, name: str, *, trans_a: bool = False, trans_b: bool = False) -> None:
        super().__init__(name)
        self.trans_a, self.trans_b = trans_a, trans_b

    def pattern(self, op, input_a, input_b, input_c):
        a = op.Transpose(input_a, perm=[1, 0]) if self.trans_a else input_a
        b = op.Transpose(input_b, perm=[1, 0]) if self.trans_b else input_b
        return op.Add(op.MatMul(a, b), input_c)

    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, input_a, input_b, input_c, **_) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        rank_a = known_rank(input_a)
        if rank_a != 2:
            return result.fail(f"input A has rank {rank_a if rank_a is not None else 'unknown'}, Gemm needs 2")
        weight = constant_shape(input_b)
        if weight is None or len(weight) != 2:
            return result.fail("the MatMul weight is not a constant 2-D tensor")
        n = weight[0] if self.trans_b else weight[1]
        bias_shape = input_c.shape
        if bias_shape is None and (bias := constant_array(input_c)) is not None:
            bias_shape = bias.shape
        if bias_shape is None or not all(isinstance(d, int) for d in bias_shape):
            return result.fail("the bias shape is unknown")
        dims = list(bias_shape)
        if len(dims) > 2 or (len(dims) == 2 and dims[0] != 1) or (dims and dims[-1] not in (1, n)):
            return result.fail(f"bias of shape {dims} does not broadcast to [{n}]")
        return result

    def rewrite(self, op, input_a, input_b, input_c, **_):
        attributes = {"transA": 1} if self.trans_a else {}
        if self.trans_b:
            attributes["transB"] = 1
        return op.Gemm(input_a, input_b, input_c, **attributes)


@register("fuse-matmul-add-gemm", description="Fuse 2-D MatMul with a constant weight and a bias Add into Gemm.")
class FuseMatMulAddGemm(RewriteRulesPass):
    """Counts: ``gemm`` (plain), ``gemm_trans_a``, ``gemm_trans_b``, ``gemm_trans_ab`` (Gemms created)."""

    def __init__(self) -> None:
        super().__init__(
            [
                _MatMulAddGemm("gemm_trans_ab", trans_a=True, trans_b=True),
                _MatMulAddGemm("gemm_trans_a", trans_a=True),
                _MatMulAddGemm("gemm_trans_b", trans_b=True),
                _MatMulAddGemm("gemm"),
            ],
            commute=True,
        )
