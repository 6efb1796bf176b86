"""Logits only for the positions a caller needs: a ``logits_to_keep`` input added to a graph when dstc's runner
loads it (the artifact on disk is unchanged).

A prefill of 128 tokens otherwise computes the lm_head for all 128 positions ([1, 128, 151936] for
R1-Distill-Qwen: more arithmetic than the rest of a small model's prefill) although generation reads the last one;
openvino_genai slices the same way inside its pipeline (its "slice before MatMul" transformation). The hidden state
entering the lm_head (the final norm's output, found from the ``logits`` output back through the lm_head's
MatMul, and the Reshape to 2-D of a tied lm_head's Gemm) is replaced, for every reader, by its last
``logits_to_keep`` positions; 0 keeps them all, which is what accuracy measurements ask for. The runner feeds
the input at every call.
"""

from __future__ import annotations

import numpy as np

INPUT = "logits_to_keep"
_MATMULS = ("MatMul", "MatMulNBits", "Gemm")


def _lm_head_input_onnx(graph) -> str:
    producers = {out: node for node in graph.node for out in node.output}
    name = "logits"
    while name in producers:
        node = producers[name]
        if node.op_type in _MATMULS:
            data = node.input[0]
            flat = producers.get(data)
            return flat.input[0] if flat is not None and flat.op_type == "Reshape" else data
        name = node.input[0]
    raise ValueError("no MatMul found computing the logits")


def onnx_with_logits_to_keep(model) -> None:
    """Add the input to an onnx ModelProto (in place)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    hidden = _lm_head_input_onnx(graph)
    kept = f"{hidden}/{INPUT}"
    for node in graph.node:
        node.input[:] = [kept if name == hidden else name for name in node.input]
    graph.input.append(helper.make_tensor_value_info(INPUT, onnx.TensorProto.INT64, []))
    consts = {f"{INPUT}/zero": [0], f"{INPUT}/end": [np.iinfo(np.int64).max], f"{INPUT}/axis": [1],
              f"{INPUT}/shape": [1]}
    for name, value in consts.items():
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
    nodes = [
        helper.make_node("Reshape", [INPUT, f"{INPUT}/shape"], [f"{INPUT}/k"]),
        helper.make_node("Neg", [f"{INPUT}/k"], [f"{INPUT}/neg"]),
        helper.make_node("Greater", [f"{INPUT}/k", f"{INPUT}/zero"], [f"{INPUT}/some"]),
        helper.make_node("Where", [f"{INPUT}/some", f"{INPUT}/neg", f"{INPUT}/zero"], [f"{INPUT}/start"]),
        helper.make_node("Slice", [hidden, f"{INPUT}/start", f"{INPUT}/end", f"{INPUT}/axis"], [kept]),
    ]
    position = next(i for i, node in enumerate(graph.node) if kept in node.input)
    for offset, node in enumerate(nodes):
        node.name = f"{INPUT}/{node.op_type}"
        graph.node.insert(position + offset, node)


def openvino_with_logits_to_keep(model) -> None:
    """Add the input to an ov.Model (in place) as a Parameter."""
    import openvino as ov
    from openvino import opset13 as ops

    result = next(r for r in model.get_results() if "logits" in r.input_value(0).get_names())
    value = result.input_value(0)
    while value.get_node().get_type_name() not in ("MatMul", "FullyConnected"):
        value = value.get_node().input_value(0)
    hidden = value.get_node().input_value(0)
    if hidden.get_node().get_type_name() == "Reshape":  # a tied lm_head's Gemm reads it flattened to 2-D
        hidden = hidden.get_node().input_value(0)
    # before the Slice below becomes one; a graph output of the hidden state itself (the MTP layer's input, added
    # with model.add_outputs) keeps every position, as the ONNX graph's does
    readers = [r for r in hidden.get_target_inputs() if r.get_node().get_type_name() != "Result"]
    keep = ops.parameter(ov.PartialShape([]), ov.Type.i64, name=INPUT)
    keep.output(0).get_tensor().set_names({INPUT})
    k = ops.reshape(keep, ops.constant(np.array([1], np.int64)), False)
    zero = ops.constant(np.array([0], np.int64))
    start = ops.select(ops.greater(k, zero), ops.negative(k), zero)
    sliced = ops.slice(hidden, start, ops.constant(np.array([np.iinfo(np.int64).max], np.int64)),
                       ops.constant(np.array([1], np.int64)), ops.constant(np.array([1], np.int64)))
    for reader in readers:
        reader.replace_source_output(sliced.output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()
