"""fuse-rms-norm: RMSNorm -> ONNX Runtime's SimplifiedLayerNormalization.

    scale * x / Sqrt(ReduceMean(x^2, [-1]) + eps)            (dstc's export, transformers' order)
    scale * (x * Reciprocal(Sqrt(ReduceMean(x^2, [-1]) + eps)))

become ``SimplifiedLayerNormalization(x, scale, axis=-1, epsilon=eps, stash_type=1)``. ORT registers that op
in the *default* ONNX domain (version 1), not in com.microsoft; ``passes.contrib_ops`` gives ``onnx`` its schema.
x^2 may be written Pow(x, 2) or Mul(x, x); the Mul with the scale may have either operand order.

onnxscript's RmsNormFusion covers only the Reciprocal form with Pow; these rules add the Div form (what
transformers and dstc write) and check what the fused op needs: a float input, a scalar epsilon, a reduction
over the last axis only with keepdims=1, and a 1-D scale of the normalised width.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from passes.fusions._common import axis_is_last, dims, int_list, scalar
from passes.graph import constant_array
from passes.registry import register
from passes.rewrite import RewriteRulesPass

FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


class _RmsNorm(RewriteRuleClassBase):
    def __init__(self, name: str, *, reciprocal: bool, square_by_mul: bool) -> None:
        super().__init__(name)
        self.reciprocal = reciprocal
        self.square_by_mul = square_by_mul

    def pattern(self, op, x, two, axes, epsilon, scale):
        square = op.Mul(x, x) if self.square_by_mul else op.Pow(x, two)
        mean = op.ReduceMean(square, axes, _allow_other_attributes=True, _outputs=["mean"])
        rms = op.Sqrt(op.Add(mean, epsilon))
        normalized = op.Mul(x, op.Reciprocal(rms)) if self.reciprocal else op.Div(x, rms)
        return op.Mul(scale, normalized)

    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, x, axes, epsilon, scale, mean, two=None, **_) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        if x.dtype not in FLOATS:
            return result.fail(f"input dtype {x.dtype} is not a float type (unknown: run infer-shapes first)")
        if not self.square_by_mul and scalar(two) != 2:
            return result.fail("the square is Pow with an exponent other than the constant 2")
        reduce = mean.producer()
        x_dims = dims(x)
        rank = len(x_dims) if x_dims is not None else None
        axis_list = int_list(axes)
        if axis_list is None or len(axis_list) != 1 or not axis_is_last(axis_list[0], rank):
            return result.fail(f"ReduceMean axes {axis_list} are not the last axis alone")
        if reduce.attributes.get_int("keepdims", 1) != 1 or reduce.attributes.get_int("noop_with_empty_axes", 0):
            return result.fail("ReduceMean does not keep the reduced axis")
        if not isinstance(scalar(epsilon), float):
            return result.fail("epsilon is not a constant float scalar")
        width = x_dims[-1] if x_dims else None
        scale_array = constant_array(scale)
        scale_dims = list(scale_array.shape) if scale_array is not None else dims(scale)
        if scale_dims is None or len(scale_dims) != 1:
            return result.fail(f"scale has shape {scale_dims}, the fused op needs a 1-D scale")
        if isinstance(width, int) and scale_dims[0] != width:
            return result.fail(f"scale has {scale_dims[0]} elements, the normalised width is {width}")
        if scale.dtype not in FLOATS:
            return result.fail(f"scale dtype {scale.dtype} is not a float type")
        return result

    def rewrite(self, op, x, epsilon, scale, **_):
        return op.SimplifiedLayerNormalization(
            x, scale, axis=-1, epsilon=float(np.float32(scalar(epsilon))), stash_type=1
        )


@register("fuse-rms-norm", targets=("onnxruntime",),
          description="RMSNorm (x / Sqrt(ReduceMean(x^2) + eps) * w) -> ORT SimplifiedLayerNormalization.")
class FuseRmsNorm(RewriteRulesPass):
    """Counts: ``rms_norm`` (Div form), ``rms_norm_reciprocal``, and ``*_mul_square`` variants (x*x for x^2)."""

    def __init__(self) -> None:
        super().__init__(
            [
                _RmsNorm("rms_norm", reciprocal=False, square_by_mul=False),
                _RmsNorm("rms_norm_reciprocal", reciprocal=True, square_by_mul=False),
                _RmsNorm("rms_norm_mul_square", reciprocal=False, square_by_mul=True),
                _RmsNorm("rms_norm_reciprocal_mul_square", reciprocal=True, square_by_mul=True),
            ],
            commute=True,
        )
