"""Where each MoE layer's routing decision lives in a compiled graph, to request it as an extra output.

The value is the router's TopK indices, int64 [tokens, top_k], as each MoE lowering consumes them
(toolchain/export/moe.py): the sparse dispatch compares them with each expert id (``Equal``); the fused lowerings
scatter them into [tokens, experts] (``ScatterElements``, ``ScatterElementsUpdate`` in OpenVINO) that feeds the
experts, com.microsoft's MoE / QMoE or, in the tiled block, a Transpose to [experts, tokens]. They are found by
that structure rather than by name, so they survive ORT's offline optimisation, OpenVINO's conversion and any
graph pass that renames nodes: those TopK nodes, in graph order, are the MoE layers in order. (The group selection
of DeepSeek-V3 and of V2's group-limited routing is a TopK too, but its indices are scattered into a group mask
that feeds an Unsqueeze.)
"""

from __future__ import annotations

from pathlib import Path

from toolchain.interface.files import MODEL_XML, ONNX_MODEL
from toolchain.runtime.artifact import Artifact


def moe_layers(config: dict) -> list[int]:
    """Indices of the MoE layers of the artifact's config.json, by its architecture module's rule."""
    # the exporter (torch, onnx_ir) loads only where routing is asked
    from toolchain.export.architectures import architecture_for

    return architecture_for(config.get("model_type")).moe_layers(config)


def router_outputs(artifact: Artifact) -> dict[int, str]:
    """MoE layer -> name of the value holding its selected expert indices in this artifact's graph; {} for a
    dense model."""
    layers = moe_layers(artifact.config)
    if not layers:
        return {}
    if artifact.backend == "openvino":
        names = _openvino_dispatch_indices(artifact.path / MODEL_XML)
    else:
        names = _onnx_dispatch_indices(artifact.path / ONNX_MODEL)
    if len(names) != len(layers):
        raise ValueError(f"{artifact.path}: found {len(names)} router TopK outputs feeding an expert dispatch, "
                         f"expected one per MoE layer ({len(layers)})")
    return dict(zip(layers, names))


# What consumes a router's scattered choice, by lowering: com.microsoft's MoE / QMoE, or the tiled block's Transpose.
EXPERT_CONSUMERS = ("MoE", "QMoE", "Transpose")


def _onnx_dispatch_indices(path: Path) -> list[str]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    consumers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    scattered = {node.input[1] for node in graph.node if node.op_type == "ScatterElements"
                 and consumers.get(node.output[0], set()) & set(EXPERT_CONSUMERS)}
    return [node.output[1] for node in graph.node if node.op_type == "TopK" and len(node.output) > 1
            and ("Equal" in consumers.get(node.output[1], set()) or node.output[1] in scattered)]


def _openvino_dispatch_indices(path: Path) -> list[str]:
    import openvino as ov

    def feeds_experts(op) -> bool:
        kind = op.get_type_name()
        return kind == "Equal" or (kind == "ScatterElementsUpdate" and any(
            t.get_node().get_type_name() in EXPERT_CONSUMERS for t in op.output(0).get_target_inputs()))

    model = ov.Core().read_model(str(path))
    return [op.output(1).get_any_name() for op in model.get_ordered_ops() if op.get_type_name() == "TopK"
            and any(feeds_experts(t.get_node()) for t in op.output(1).get_target_inputs())]
