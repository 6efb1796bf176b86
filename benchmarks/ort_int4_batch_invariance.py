"""Why greedy tokens of an ONNX Runtime INT4 artifact depend on the batch they were decoded in (issue #39, item 5).

Three checks, bit for bit, on the artifact's own graph and weights (ONNX Runtime's CPU provider):

1. the whole decode step: row 0's logits alone and beside other rows (B = 2..16), and the same for a one-row step
   of 4 positions;
2. its first MatMulNBits node alone (accuracy_level as built, then 0): row 0 of the output for M rows against M = 1
   and against M = 2;
3. its first QMoE node alone: row 0's output when each of its experts gets one token (the other rows routed
   elsewhere), two or more, or some of each.

    .venv/bin/python benchmarks/ort_int4_batch_invariance.py artifacts/deepseek-v3-tiny-onnxruntime-int4

Measured (ORT 1.32, AMD EPYC with AVX2): a MatMulNBits row differs between M = 1 and M >= 2 (1.5e-7 at
accuracy_level 4, 3.6e-7 at 0: not the activations' int8 quantization) and is bit-equal for every M >= 2. So a
dense INT4 model (r1-distill-qwen-tiny) decodes a row bit-equally in every batch of 2 or more rows, differently
alone; a MoE one (deepseek-v3-tiny) does not even then: a QMoE token differs by whether each of its experts got one
token of the batch or more. An fp32 artifact is bit-invariant.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def decode_logits(sess: ort.InferenceSession, batch: int, seq: int, past: int = 12) -> np.ndarray:
    """Row 0's logits of a step of ``batch`` rows: row 0's inputs and past fixed, the other rows' random."""
    rng, fixed = np.random.default_rng(batch), np.random.default_rng(1234)
    sizes = {"batch_size": batch, "sequence_length": seq, "past_sequence_length": past,
             "total_sequence_length": past + seq}
    feeds = {}
    for i in sess.get_inputs():
        shape = [sizes.get(d, d) if isinstance(d, str) else d for d in i.shape]
        if i.name == "attention_mask":
            feeds[i.name] = np.ones(shape, np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(past, past + seq), shape).astype(np.int64)
        elif i.name == "input_ids":
            ids = rng.integers(0, 100, shape)
            ids[0] = fixed.integers(0, 100, shape[1:])
            feeds[i.name] = ids.astype(np.int64)
        else:
            values = rng.standard_normal(shape).astype(np.float32)
            values[0] = fixed.standard_normal(shape[1:]).astype(np.float32)
            feeds[i.name] = values
    return sess.run(["logits"], feeds)[0][0]


def single_node(model: onnx.ModelProto, node: onnx.NodeProto, **attributes) -> tuple[onnx.ModelProto, list[str]]:
    """A model of ``node`` alone (its initializers as they are), its other inputs as the model's inputs."""
    node_copy = onnx.NodeProto()
    node_copy.CopyFrom(node)
    for attribute in node_copy.attribute:
        if attribute.name in attributes:
            attribute.i = attributes[attribute.name]
    initializers = {i.name: i for i in model.graph.initializer}
    inputs = [name for name in node.input if name and name not in initializers]
    graph = helper.make_graph(
        [node_copy], "node", [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
        [initializers[n] for n in node.input if n in initializers])
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version), inputs


def check_model(model: onnx.ModelProto, threads: int) -> None:
    sess = session(model, threads)
    for seq in (1, 4):
        alone = decode_logits(sess, 1, seq)
        rows = {b: decode_logits(sess, b, seq) for b in (2, 3, 4, 8, 16)}
        print(f"decode step, {seq} position(s): max |row 0 beside B-1 rows - alone| by B: "
              + ", ".join(f"{b}: {float(np.abs(row - alone).max()):.2g}" for b, row in rows.items())
              + f"; bit-equal to B = 2's for B = {[b for b, row in rows.items() if np.array_equal(row, rows[2])]}")


def check_matmulnbits(model: onnx.ModelProto, threads: int) -> None:
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    built = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for level in (built["accuracy_level"], 0):
        sub, inputs = single_node(model, node, accuracy_level=level)
        sess = session(sub, threads)
        rng = np.random.default_rng(0)
        row0 = rng.standard_normal((1, built["K"])).astype(np.float32)
        out = {m: sess.run(None, {inputs[0]: np.concatenate(
            [row0, rng.standard_normal((m - 1, built["K"])).astype(np.float32)])})[0][0]
            for m in (1, 2, 3, 4, 8, 16, 64, 256)}
        print(f"MatMulNBits (K {built['K']}, N {built['N']}) accuracy_level {level}: row 0 at M = 1 vs M = 2: "
              f"max diff {float(np.abs(out[1] - out[2]).max()):.2g}; bit-equal to M = 2's for M = "
              f"{[m for m in out if np.array_equal(out[m], out[2])]}")


def check_qmoe(model: onnx.ModelProto, threads: int) -> None:
    node = next((n for n in model.graph.node if n.op_type == "QMoE"), None)
    if node is None:
        print("no QMoE node")
        return
    k = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "k")
    initializers = {i.name: i for i in model.graph.initializer}
    experts = numpy_helper.to_array(initializers[node.input[2]]).shape[0]
    sub, (hidden_name, router_name) = single_node(model, node)
    sess = session(sub, threads)
    hidden = int(numpy_helper.to_array(initializers[node.input[5]]).shape[1])  # down_proj: [experts, hidden, ...]
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((1, hidden)).astype(np.float32)
    r0 = rng.standard_normal((1, experts)).astype(np.float32)
    mine = [int(e) for e in np.argsort(-r0[0])[:k]]
    others = [e for e in range(experts) if e not in mine]

    def routed_to(chosen: list[int]) -> np.ndarray:
        logits = rng.standard_normal(experts).astype(np.float32) - 10
        logits[chosen] = 10 + rng.random(len(chosen))
        return logits

    def row0(rows: list[np.ndarray]) -> np.ndarray:
        x = np.concatenate([x0, rng.standard_normal((len(rows), hidden)).astype(np.float32)])
        r = np.concatenate([r0, np.array(rows, np.float32).reshape(len(rows), experts)])
        return sess.run(None, {hidden_name: x, router_name: r})[0][0]

    alone, two = row0([]), row0([routed_to(mine)])
    cases = {"its experts' only token (5 rows elsewhere)": row0([routed_to(others[:k]) for _ in range(5)]),
             "1 other row on its experts": two,
             "7 other rows on its experts": row0([routed_to(mine) for _ in range(7)]),
             "1 other row on half of them": row0([routed_to(mine[:k // 2] + others[:k - k // 2])])}
    print(f"QMoE ({experts} experts, top {k}), row 0 as")
    for name, out in cases.items():
        print(f"  {name:45s} bit-equal to alone: {np.array_equal(out, alone)!s:5s} to 1 other on its experts: "
              f"{np.array_equal(out, two)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = onnx.load(str(args.artifact / "model.onnx"))
    check_model(model, args.threads)
    if any(n.op_type == "MatMulNBits" for n in model.graph.node):
        check_matmulnbits(model, args.threads)
    check_qmoe(model, args.threads)


if __name__ == "__main__":
    main()
