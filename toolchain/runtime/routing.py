"""Where each MoE layer's routing decision lives in a compiled graph, to request it as an extra output.

The value is the router's TopK indices (a hash router's: the Gather of its constant table at the token ids), int64
[tokens, top_k], as the graph's MoE lowering (its metadata's
``dstc.moe_lowering``, toolchain/export/moe.py) consumes them: the sparse dispatch compares them with each expert
id (``Equal``); the fused lowerings scatter them into [tokens, experts] (``ScatterElements``,
``ScatterElementsUpdate`` in OpenVINO) that feeds the experts, com.microsoft's MoE / QMoE or, in the tiled block, a
Transpose to [experts, tokens]. They are found by that structure rather than by name, so they survive ORT's
offline optimisation, OpenVINO's conversion and any graph pass that renames nodes: those TopK (and table Gather)
nodes, in graph order, are the MoE layers in order. (The group selection of DeepSeek-V3 and of V2's group-limited
routing is a TopK too, but its indices are scattered into a group mask that feeds an Unsqueeze.)
"""

from __future__ import annotations

import json
from pathlib import Path

from toolchain.interface.graph import MOE_LAYERS
from toolchain.runtime.artifact import Artifact


def moe_layers(metadata: dict[str, str], config: dict) -> list[int]:
    """Indices of the MoE layers, as the exporter recorded them in the graph's metadata."""
    if MOE_LAYERS in metadata:
        return json.loads(metadata[MOE_LAYERS])
    # an artifact exported before the record: its architecture module's rule on its config.json (the exporter,
    # torch and onnx_ir, loads only here)
    from toolchain.export.architectures import architecture_for

    return architecture_for(config.get("model_type")).moe_layers(config)


def router_outputs(artifact: Artifact) -> dict[int, str]:
    """MoE layer -> name of the value holding its selected expert indices in this artifact's graph; {} for a
    dense model."""
    layers = moe_layers(artifact.metadata, artifact.config)
    if not layers:
        return {}
    names = router_values(artifact.graph, artifact.moe_lowering)
    if len(names) != len(layers):
        raise ValueError(f"{artifact.graph}: found {len(names)} router outputs feeding an expert dispatch, "
                         f"expected one per MoE layer ({len(layers)})")
    return dict(zip(layers, names))


# What consumes a router's indices, by lowering: the dispatch's Equal, or what the scattered choice feeds
# (com.microsoft's MoE / QMoE, the tiled block's Transpose).
EXPERT_CONSUMERS: dict[str | None, tuple[str | None, tuple[str, ...]]] = {
    "dispatch": ("Equal", ()), "fused-onnxruntime": (None, ("MoE", "QMoE")), "fused-openvino": (None, ("Transpose",)),
    # a graph exported before the lowering was recorded: any of them, as every lowering was searched for then
    None: ("Equal", ("MoE", "QMoE", "Transpose"))}


def router_values(path: Path, lowering: str | None) -> list[str]:
    """The router TopK indices that feed the experts of the graph at ``path`` (ONNX, or an OpenVINO IR .xml), in
    graph order, for its MoE ``lowering`` (None: not recorded)."""
    consumers = EXPERT_CONSUMERS[lowering]
    return (_openvino_dispatch_indices if path.suffix == ".xml" else _onnx_dispatch_indices)(path, consumers)


def _onnx_dispatch_indices(path: Path, consumers: tuple[str | None, tuple[str, ...]]) -> list[str]:
    import onnx

    direct, of_scatter = consumers
    graph = onnx.load(str(path), load_external_data=False).graph
    # an If's else-branch in its place: prefill-int8's span of the decoder as it was (passes/quantize/
    # prefill_int8.py; runners ask for its values as extra outputs, toolchain/runtime/engines.py)
    nodes = [inner for node in graph.node for inner in
             next((a.g.node for a in node.attribute if node.op_type == "If" and a.name == "else_branch"), [node])]
    consumed_by: dict[str, set[str]] = {}
    for node in nodes:
        for name in node.input:
            consumed_by.setdefault(name, set()).add(node.op_type)
    scattered = {node.input[1] for node in nodes if node.op_type == "ScatterElements"
                 and consumed_by.get(node.output[0], set()) & set(of_scatter)}
    tables = {t.name for t in graph.initializer}

    def feeds_experts(name: str) -> bool:
        return direct in consumed_by.get(name, set()) or name in scattered

    return [out for node in nodes for out in
            ([node.output[1]] if node.op_type == "TopK" and len(node.output) > 1 else
             [node.output[0]] if node.op_type == "Gather" and node.input[0] in tables else []) if feeds_experts(out)]


def _openvino_dispatch_indices(path: Path, consumers: tuple[str | None, tuple[str, ...]]) -> list[str]:
    import openvino as ov

    direct, of_scatter = consumers

    def feeds_experts(op) -> bool:
        kind = op.get_type_name()
        return kind == direct or (kind == "ScatterElementsUpdate" and any(
            t.get_node().get_type_name() in of_scatter for t in op.output(0).get_target_inputs()))

    def indices(op):
        kind = op.get_type_name()
        if kind == "TopK":
            return op.output(1)
        if kind == "Gather" and op.input_value(0).get_node().get_type_name() == "Constant":  # a hash router's table
            return op.output(0)
        return None

    model = ov.Core().read_model(str(path))
    return [out.get_any_name() for out in map(indices, model.get_ordered_ops())
            if out is not None and any(feeds_experts(t.get_node()) for t in out.get_target_inputs())]
