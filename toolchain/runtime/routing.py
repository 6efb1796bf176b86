"""Where each MoE layer's routing decision lives in a compiled graph, to request it as an extra output.

The value is the router's TopK indices that the sparse expert dispatch compares with each expert id (``Equal``;
toolchain/export/blocks.py ``moe_dispatch``): int64 [tokens, top_k]. It is found by that structure rather than by
name, so it survives ORT's offline optimisation, OpenVINO's conversion and any graph pass that renames nodes:
the TopK nodes whose indices feed an Equal, in graph order, are the MoE layers in order. (DeepSeek-V3's group
selection is a TopK too, but its indices feed a ScatterElements.)
"""

from __future__ import annotations

from pathlib import Path

from toolchain.compile.onnxruntime_artifact import MODEL as ONNX_MODEL
from toolchain.compile.openvino_ir import MODEL_XML
from toolchain.runtime.artifact import Artifact

MOE_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def moe_layers(config: dict) -> list[int]:
    """Indices of the MoE layers, by transformers' rule for DeepSeek-V2/V3 (every layer from
    first_k_dense_replace on)."""
    if config.get("model_type") not in MOE_MODEL_TYPES or not config.get("n_routed_experts"):
        return []
    return list(range(config.get("first_k_dense_replace", 0), config["num_hidden_layers"]))


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


def _onnx_dispatch_indices(path: Path) -> list[str]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    compared = {name for node in graph.node if node.op_type == "Equal" for name in node.input}
    return [node.output[1] for node in graph.node
            if node.op_type == "TopK" and len(node.output) > 1 and node.output[1] in compared]


def _openvino_dispatch_indices(path: Path) -> list[str]:
    import openvino as ov

    model = ov.Core().read_model(str(path))
    return [op.output(1).get_any_name() for op in model.get_ordered_ops() if op.get_type_name() == "TopK"
            and any(t.get_node().get_type_name() == "Equal" for t in op.output(1).get_target_inputs())]
