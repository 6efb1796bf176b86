"""fuse-silu: x * Sigmoid(x) -> com.microsoft QuickGelu(x, alpha=1.0).

What fused form ONNX Runtime 1.32 has for the SiLU-gated MLP ``down(silu(gate(x)) * up(x))``, on CPU in fp32:

* ``com.microsoft.SwiGLU`` (silu(gate) * up, optionally from one [.., 2*inter] projection) has no CPU kernel in
  1.32: a session with it fails with NOT_IMPLEMENTED. The ONNX SwiGLU op needs opset 28.
* ``MatMulNBitsMlp`` fuses the two projections and the activation only for 4-bit weights (weight compression's
  business, not an fp32 graph's), ``MoE``/``QMoE`` need the experts as stacked 3-D weights, not dstc's sparse
  per-expert dispatch.
* ``QuickGelu`` computes x * Sigmoid(alpha * x); with alpha = 1 it is SiLU, in one kernel instead of two and
  without materialising the sigmoid. ORT's own level-2 optimiser (QuickGeluFusion) makes the same rewrite when
  a session loads the graph, so with default session options this pass changes nothing measurable; it makes
  the fused form part of the artifact, so the graph runs fused also with ORT_ENABLE_BASIC or with an execution
  provider whose optimiser does not fuse it, and session creation has less to do.

So the gate activation becomes QuickGelu (the gate/up Mul stays a Mul), and only where the Sigmoid has no
other consumer: if it had, the Sigmoid would be computed anyway and the rewrite would only duplicate work.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from passes.fusions._common import MS_DOMAIN
from passes.registry import register
from passes.rewrite import RewriteRulesPass


class _Silu(RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.Mul(x, op.Sigmoid(x))

    # onnxscript calls check(context, **bindings), a signature its base declares as check(op, *args, **kwargs)
    def check(self, context, x, **_) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        if x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE):
            return result.fail(f"input dtype {x.dtype} is not a float type (unknown: run infer-shapes first)")
        return result

    def rewrite(self, op, x, **_):
        return op.QuickGelu(x, alpha=1.0, _domain=MS_DOMAIN)


@register("fuse-silu", targets=("onnxruntime",), description="x * Sigmoid(x) -> ORT QuickGelu(alpha=1), i.e. SiLU.")
class FuseSilu(RewriteRulesPass):
    """Counts: ``silu`` (QuickGelu nodes created)."""

    def __init__(self) -> None:
        super().__init__([_Silu("silu")], commute=True)
