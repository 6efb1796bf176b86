"""fold-constants: onnxscript's constant folder (``onnxscript.optimizer.fold_constants``, with node-level shape
inference), counted.

A Cast to float32 of a bf16 initializer is never folded, whatever the size limits: it is how an export stores its
large weights (passes.graph.stored_weight), and folding it would write them back as float32, twice the bytes.
onnxscript's defaults would decline it anyway above 8192 elements (its input_size_limit; only Transpose is folded
past the limits), but smaller ones and larger limits would fold it."""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer

from passes.base import CountedResult
from passes.graph import stored_weight
from passes.registry import register


@register("fold-constants", description="Evaluate nodes whose inputs are all constant (onnxscript's folder).")
class FoldConstants(ir.passes.InPlacePass):
    """Counts ``nodes_replaced``: nodes of the input the folder replaced by a constant or a simpler node (e.g. a
    Reshape to the input's own static shape by Identity), and ``inputs_rewired``. Constant nodes it leaves unused
    are for ``remove-unused``. The size limits default to onnxscript's."""

    def __init__(self, input_size_limit: int | None = None, output_size_limit: int | None = None) -> None:
        super().__init__()
        self.limits = {key: value for key, value in (("input_size_limit", input_size_limit),
                                                      ("output_size_limit", output_size_limit)) if value is not None}

    def call(self, model: ir.Model) -> CountedResult:
        inputs_before = {node: tuple(node.inputs) for node in ir.traversal.RecursiveGraphIterator(model.graph)}
        result = onnxscript.optimizer.fold_constants(model, onnx_shape_inference=True, should_fold=_keep_widening,
                                                     **self.limits)
        after = set(ir.traversal.RecursiveGraphIterator(model.graph))
        rewired = sum(  # inputs forwarded past nodes that stay (e.g. Relu(Identity(x)) -> Relu(x)), not replaced ones
            new is not old and old is not None and (source := old.producer()) is not None and source.graph is not None
            for node in after
            if node in inputs_before
            for new, old in zip(node.inputs, inputs_before[node])
        )
        replaced = sum(node not in after for node in inputs_before)
        return CountedResult(model, result.modified, {"nodes_replaced": replaced, "inputs_rewired": rewired})


def _keep_widening(node: ir.Node) -> bool | None:
    """False (never fold) for the Cast that widens a bf16-stored weight; None (the folder's rules) otherwise."""
    return False if node.outputs and stored_weight(node.outputs[0]) is not None else None
