"""Shared helpers for tests/passes/: build small ONNX models, run them with ONNX Runtime, and run a
pass with the checks every pass test wants (numerics before/after, validity, idempotence)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper, numpy_helper

from passes import PassStats, create_pass, run_pass, validate_model

node = helper.make_node


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, Sequence[int] | tuple[Sequence[int], np.dtype]],
    outputs: Sequence[str],
    initializers: Mapping[str, np.ndarray] | None = None,
    *,
    opset: int = 18,
    infer_shapes: bool = True,
) -> ir.Model:
    """An ir.Model from onnx.helper nodes; ``inputs`` maps names to a shape (float32) or (shape, dtype).

    With ``infer_shapes`` every value (outputs included) gets its type and shape from ONNX shape inference.
    """
    graph_inputs = []
    for name, spec in inputs.items():
        shape, dtype = spec if isinstance(spec, tuple) else (spec, np.float32)
        elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        graph_inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
    graph = helper.make_graph(
        list(nodes),
        "test",
        graph_inputs,
        [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(array), name) for name, array in (initializers or {}).items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    if infer_shapes:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    return ir.serde.deserialize_model(proto)


def op_counts(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph)


def to_bytes(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def run_ort(model: ir.Model | bytes, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run with ORT's own graph optimisations off, so the model is executed as written."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model if isinstance(model, bytes) else to_bytes(model)
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return session.run(None, dict(feeds))


def random_feeds(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.inputs:
        if value.is_initializer():
            continue
        shape = [d if isinstance(d, int) else 2 for d in value.shape]
        feeds[value.name] = rng.standard_normal(shape).astype(value.dtype.numpy())
    return feeds


def rand(*shape: int, seed: int = 0, positive: bool = False) -> np.ndarray:
    array = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return np.abs(array) + 0.5 if positive else array


def check_pass(
    model: ir.Model, name: str, *, atol: float = 1e-5, feeds: Mapping[str, np.ndarray] | None = None
) -> PassStats:
    """Run pass ``name`` on ``model`` in place and return its stats, after checking that the model still
    validates, computes the same outputs under ORT (``feeds``, random inputs by default), and that a second run
    changes nothing."""
    feeds = random_feeds(model) if feeds is None else feeds
    before_bytes = to_bytes(model)
    expected = run_ort(before_bytes, feeds)
    stats = run_pass(name, create_pass(name), model)
    validate_model(model)
    for want, got in zip(expected, run_ort(model, feeds), strict=True):
        assert want.shape == got.shape
        np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)
    again = run_pass(name, create_pass(name), model)
    assert (again.modified, again.counts) == (False, {}), f"second run of {name} changed the model: {again}"
    if not stats.modified:
        assert to_bytes(model) == before_bytes, f"{name} reported no change but changed the model"
    return stats
