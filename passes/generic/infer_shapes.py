"""infer-shapes: record ONNX shape inference results on the graph's values (rank-dependent passes need them)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from passes.base import CountedResult
from passes.registry import register


@register("infer-shapes", description="Annotate values with ONNX shape inference results (no graph change).")
class InferShapes(ir.passes.InPlacePass):
    def call(self, model: ir.Model) -> CountedResult:
        before = _annotations(model)
        ShapeInferencePass()(model)  # logs and leaves the model as is when inference fails
        after = _annotations(model)
        updated = sum(1 for key, annotation in after.items() if before.get(key) != annotation)
        return CountedResult(model, bool(updated), {"values_annotated": updated})


def _annotations(model: ir.Model) -> dict[int, tuple]:
    values = {}
    for graph in model.graphs():
        for value in (*graph.inputs, *graph.initializers.values()):
            values[id(value)] = (value.dtype, value.shape)
        for node in graph:
            for value in node.outputs:
                values[id(value)] = (value.dtype, value.shape)
    return values
