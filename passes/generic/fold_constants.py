"""fold-constants: onnxscript's constant folder (with node-level shape inference), counted."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.optimizer._constant_folding import (
    DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
    DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
    FoldConstantsPass,
)

from passes.base import CountedResult
from passes.registry import register


@register("fold-constants", description="Evaluate nodes whose inputs are all constant (onnxscript's folder).")
class FoldConstants(ir.passes.InPlacePass):
    """Counts ``nodes_replaced``: nodes the folder replaced by a constant or a simpler node (e.g. a Reshape to
    the input's own static shape by Identity), and ``inputs_rewired``. Constant nodes it leaves unused are for
    ``remove-unused``."""

    def __init__(
        self,
        input_size_limit: int = DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        output_size_limit: int = DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
    ) -> None:
        super().__init__()
        self.input_size_limit = input_size_limit
        self.output_size_limit = output_size_limit

    def call(self, model: ir.Model) -> CountedResult:
        inputs_before = {node: tuple(node.inputs) for node in ir.traversal.RecursiveGraphIterator(model.graph)}
        folder = _CountingFolder(
            shape_inference=True, input_size_limit=self.input_size_limit, output_size_limit=self.output_size_limit
        )
        result = folder(model)
        rewired = sum(  # inputs forwarded past nodes that stay (e.g. Relu(Identity(x)) -> Relu(x)), not replaced ones
            new is not old and old is not None and old.producer() is not None and old.producer().graph is not None
            for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node in inputs_before
            for new, old in zip(node.inputs, inputs_before[node])
        )
        counts = {"nodes_replaced": folder.replaced, "inputs_rewired": rewired}
        return CountedResult(model, result.modified, counts)


class _CountingFolder(FoldConstantsPass):
    """onnxscript's folder reports only ``modified``; count its node replacements."""

    replaced = 0

    def replace_node(self, node, replacement, root) -> None:
        super().replace_node(node, replacement, root)
        self.replaced += 1
