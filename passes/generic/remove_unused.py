"""remove-unused: onnx_ir's dead-code elimination for nodes, initializers, functions and opset imports."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedFunctionsPass, RemoveUnusedNodesPass, RemoveUnusedOpsetsPass

from passes.base import CountedResult
from passes.graph import count_nodes
from passes.registry import register


@register("remove-unused", description="Remove nodes, initializers, functions and opset imports nothing uses.")
class RemoveUnused(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> CountedResult:
        nodes, inits = count_nodes(model), len(model.graph.initializers)
        functions, opsets = len(model.functions), len(model.opset_imports)
        modified = False
        for pass_ in (RemoveUnusedNodesPass(), RemoveUnusedFunctionsPass(), RemoveUnusedOpsetsPass()):
            modified |= pass_(model).modified
        counts = {
            "nodes_removed": nodes - count_nodes(model),
            "initializers_removed": inits - len(model.graph.initializers),
            "functions_removed": functions - len(model.functions),
            "opsets_removed": opsets - len(model.opset_imports),
        }
        return CountedResult(model, modified, counts)
