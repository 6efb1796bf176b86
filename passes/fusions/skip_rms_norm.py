"""fuse-skip-rms-norm: residual Add + SimplifiedLayerNormalization -> ORT SkipSimplifiedLayerNormalization.

    s = Add(a, b); y = SimplifiedLayerNormalization(s, gamma)
    -> y, _, _, s = com.microsoft.SkipSimplifiedLayerNormalization(a, b, gamma)

The fused op also returns the sum (output 3, ``input_skip_bias_sum``), which replaces every other use of ``s``
(the residual stream continues from it). Runs after ``fuse-rms-norm``. The patterns are onnxscript's
SkipRmsNormFusion (without and with a bias Add). Its check wants input and skip to carry the *same* symbolic
dims, which ONNX shape inference rarely gives: it invents a fresh symbol for a sequence axis after every
broadcast (the attention mask's Add), so the residual stream's two operands end up [batch, sequence_length, D]
and [batch, unk__7, D]. This check asks instead for what makes the Add element-wise without broadcasting as
far as shapes can tell: both operands of rank 3 (or 2) with the last axis D of gamma, and no axis that is 1 on
one side and not on the other. Should a dynamic axis still turn out to broadcast at run time, ORT rejects the
skip shape rather than computing something else.
"""

from __future__ import annotations

from typing import TypeGuard

from onnxscript.rewriter import MatchResult
from onnxscript.rewriter.ort_fusions.skip_normalization import SkipRmsNormFusion

from passes.fusions._common import dims
from passes.graph import constant_array
from passes.registry import register
from passes.rewrite import RewriteRulesPass


def _rows_of(shape: list[int | str | None] | None, width: int) -> TypeGuard[list[int | str | None]]:
    """Whether ``shape`` is [B, S, width] or [tokens, width]."""
    return shape is not None and len(shape) in (2, 3) and shape[-1] == width


class _SkipRmsNorm(SkipRmsNormFusion):
    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, input, skip, gamma, bias, simplified_layer_norm, **_) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        gamma_array = constant_array(gamma)
        gamma_dims = list(gamma_array.shape) if gamma_array is not None else dims(gamma)
        if gamma_dims is None or len(gamma_dims) != 1 or not isinstance(gamma_dims[0], int):
            return result.fail(f"gamma has shape {gamma_dims}, not a static 1-D [D]")
        width = gamma_dims[0]
        input_dims, skip_dims = dims(input), dims(skip)
        if not _rows_of(input_dims, width):
            return result.fail(f"input has shape {input_dims}, expected [B, S, {width}] or [tokens, {width}]")
        if not _rows_of(skip_dims, width):
            return result.fail(f"skip has shape {skip_dims}, expected [B, S, {width}] or [tokens, {width}]")
        if len(input_dims) != len(skip_dims):
            return result.fail(f"input {input_dims} and skip {skip_dims} differ in rank")
        for a, b in zip(input_dims, skip_dims):
            if (a == 1) != (b == 1) or (isinstance(a, int) and isinstance(b, int) and a != b):
                return result.fail(f"the Add broadcasts input {input_dims} with skip {skip_dims}")
        if self._has_bias:
            bias_dims = dims(bias)
            if bias_dims != [width]:
                return result.fail(f"bias has shape {bias_dims}, expected [{width}]")
        if simplified_layer_norm.producer().attributes.get_int("stash_type", 1) != 1:
            return result.fail("SimplifiedLayerNormalization has a stash_type other than float")
        if simplified_layer_norm.producer().attributes.get_int("axis", -1) not in (-1, len(input_dims) - 1):
            return result.fail("SimplifiedLayerNormalization does not normalise the last axis")
        return result


@register("fuse-skip-rms-norm", targets=("onnxruntime",),
          description="Residual Add + SimplifiedLayerNormalization -> ORT SkipSimplifiedLayerNormalization.")
class FuseSkipRmsNorm(RewriteRulesPass):
    """Counts: ``skip_rms_norm``, ``skip_rms_norm_bias`` (bias Add after the sum), ``skip_rms_norm_pre_bias``."""

    def __init__(self) -> None:
        super().__init__(
            [
                _SkipRmsNorm("skip_rms_norm_pre_bias", has_bias=True, bias_pre_add=True),
                _SkipRmsNorm("skip_rms_norm_bias", has_bias=True, bias_pre_add=False),
                _SkipRmsNorm("skip_rms_norm", has_bias=False),
            ]
        )
