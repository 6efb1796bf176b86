"""cse: onnx_ir's common-subexpression elimination, counted."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import CommonSubexpressionEliminationPass

from passes.base import CountedResult
from passes.graph import count_nodes
from passes.registry import register


@register("cse", description="Merge nodes with the same op, inputs and attributes (common subexpressions).")
class CommonSubexpressions(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> CountedResult:
        before = count_nodes(model)
        result = CommonSubexpressionEliminationPass()(model)
        return CountedResult(model, result.modified, {"nodes_merged": max(before - count_nodes(model), 0)})
