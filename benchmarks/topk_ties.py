"""How torch.topk, ONNX Runtime's TopK and OpenVINO's TopK choose among tied scores at the k-th place (README
"DeepSeek-V3.2 sparse attention": V3.2's indexer scores a key exactly 0 when relu zeroes every head's score).

Rows of 17-199 scores, 0 to k-1 of them 1.0 and the rest exactly 0.0, so the k-th place falls among the zeros; per
runtime, how many rows' chosen positions are the lowest tied ones (ONNX's rule) and the highest. OpenVINO runs the
ONNX TopK as its frontend converts it (opset-11 TopK, stable=false) and with stable=true set after conversion.

    .venv/bin/python benchmarks/topk_ties.py [--rows 1000] [--k 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _onnx_top_k() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=-1, largest=1, sorted=1)], "top_k",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None]),
         helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("indices", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def choosers(proto: bytes) -> dict:
    """runtime -> (scores [1, T], k) -> chosen positions."""
    import onnxruntime as ort
    import openvino as ov
    import torch

    torch.set_num_threads(1)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    compiled = {}
    for stable in (False, True):
        model = ov.Core().read_model(proto, b"")
        for op in model.get_ops():
            if op.get_type_name() == "TopK" and stable:
                op.set_attribute("stable", True)
        compiled[stable] = ov.Core().compile_model(model, "CPU")

    def openvino(stable: bool):
        return lambda x, k: compiled[stable]({"x": x, "k": np.array([k])})[compiled[stable].output(1)][0]

    return {
        "torch": lambda x, k: torch.from_numpy(x).topk(k, dim=-1).indices[0].numpy(),
        "onnxruntime": lambda x, k: session.run(None, {"x": x, "k": np.array([k])})[1][0],
        "openvino (stable=false, as converted)": openvino(False),
        "openvino (stable=true)": openvino(True),
    }


def measure(rows: int, k: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    runs = choosers(_onnx_top_k())
    counts = {name: {"lowest": 0, "highest": 0, "rows": rows} for name in runs}
    for _ in range(rows):
        total = int(rng.integers(k + 1, 200))
        x = np.zeros((1, total), np.float32)
        ones = rng.permutation(total)[: int(rng.integers(0, k))]
        x[0, ones] = 1.0
        zeros = np.flatnonzero(x[0] == 0)
        wanted = k - len(ones)
        lowest, highest = set(ones) | set(zeros[:wanted]), set(ones) | set(zeros[len(zeros) - wanted:])
        for name, choose in runs.items():
            chosen = set(choose(x, k).tolist())
            counts[name]["lowest"] += chosen == lowest
            counts[name]["highest"] += chosen == highest
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    counts = measure(args.rows, args.k)
    for name, c in counts.items():
        print(f"{name}: lowest tied positions {c['lowest']}/{c['rows']}, highest {c['highest']}/{c['rows']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(counts, f, indent=2)


if __name__ == "__main__":
    main()
