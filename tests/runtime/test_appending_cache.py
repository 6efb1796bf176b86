"""toolchain/runtime/appending_cache.py: which graphs' present outputs become their new entries (prefill-int8's If
included), and the slotted buffers' feeds, masks and growth."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from toolchain.runtime.appending_cache import AppendingCache, appending_onnx

PAST, PRESENT = "past_key_values.0.key", "present.0.key"


def graph(read_grown: bool, branches: bool) -> onnx.ModelProto:
    """present.0.key = Concat(past, 2 * x) on the sequence axis, in both branches of an If on ``cond`` (as
    prefill-int8 wraps a decoder) or in the main graph; ``read_grown``: a logits output reads the grown cache too."""
    def grown(prefix: str, nodes: list, out: str) -> None:
        nodes.append(helper.make_node("Mul", ["x", "two"], [f"{prefix}new"]))
        nodes.append(helper.make_node("Concat", [PAST, f"{prefix}new"], [out], axis=2))

    tensor = lambda name, dims: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)  # noqa: E731
    nodes = [helper.make_node("Constant", [], ["two"], value=helper.make_tensor("", TensorProto.FLOAT, [], [2.0]))]
    if branches:
        bodies = []
        for prefix in ("then/", "else/"):
            inner: list = []
            grown(prefix, inner, f"{prefix}grown")
            bodies.append(helper.make_graph(inner, prefix, [], [tensor(f"{prefix}grown", None)]))
        nodes.append(helper.make_node("If", ["cond"], [PRESENT], then_branch=bodies[0], else_branch=bodies[1]))
    else:
        grown("", nodes, PRESENT)
    outputs = [tensor(PRESENT, ["b", 1, "t", 2])]
    if read_grown:
        nodes.append(helper.make_node("ReduceSum", [PRESENT], ["logits"], keepdims=0))
        outputs.append(tensor("logits", None))
    inputs = [tensor(PAST, ["b", 1, "p", 2]), tensor("x", ["b", 1, "s", 2]),
              helper.make_tensor_value_info("cond", TensorProto.BOOL, [])]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("branches", [False, True])
def test_a_present_concat_read_by_nothing_else_becomes_the_new_entries(branches):
    import onnxruntime as ort

    model = graph(read_grown=False, branches=branches)
    assert appending_onnx(model)
    assert not [n for n in model.graph.node if n.op_type == "Concat"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    past, x = np.ones((2, 1, 5, 2), np.float32), np.arange(12, dtype=np.float32).reshape(2, 1, 3, 2)
    (present,) = session.run([PRESENT], {PAST: past, "x": x, "cond": np.array(True)})
    np.testing.assert_array_equal(present, 2 * x)


@pytest.mark.parametrize("branches", [False, True])
def test_a_grown_cache_the_graph_reads_keeps_the_contract(branches):
    model = graph(read_grown=True, branches=branches)
    before = model.SerializeToString()
    assert not appending_onnx(model)
    assert model.SerializeToString() == before


def test_the_slots_feed_whole_with_the_free_ones_masked_and_grow_by_room_steps():
    cache = AppendingCache()
    empty = np.zeros((2, 1, 0, 3), np.float32)
    assert cache.past("k", empty) is empty and cache.graph_mask(np.ones((2, 4), np.int64)).shape == (2, 4)
    prompt = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 1, 4, 3)
    cache.append({"k": prompt})
    past = cache.past("k", empty)
    assert cache.held == 4 and past.shape == (2, 1, AppendingCache.ROOM_STEP, 3)
    np.testing.assert_array_equal(past[:, :, :4], prompt)
    assert not past[:, :, 4:].any()  # zeroed: a masked slot is finite
    mask = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)  # 4 held columns and the step's
    graph_mask = cache.graph_mask(mask)
    assert graph_mask.shape == (2, AppendingCache.ROOM_STEP + 1)
    np.testing.assert_array_equal(graph_mask[:, :4], mask[:, :4])
    assert not graph_mask[:, 4:-1].any() and graph_mask[:, -1].all()
    cache.append({"k": np.full((2, 1, 1, 3), 7, np.float32)})
    assert cache.past("k", empty) is past and (past[:, :, 4] == 7).all()  # written in place: no copy
    cache.trim(3)
    assert cache.held == 3 and cache.graph_mask(mask[:, 1:]).shape == (2, AppendingCache.ROOM_STEP + 1)
    with pytest.raises(ValueError, match="cannot keep 4"):
        cache.trim(4)
    cache.append({"k": np.ones((2, 1, AppendingCache.ROOM_STEP, 3), np.float32)})  # past the room: grown
    grown = cache.past("k", empty)
    assert grown.shape[2] == 2 * AppendingCache.ROOM_STEP and cache.held == AppendingCache.ROOM_STEP + 3
    np.testing.assert_array_equal(grown[:, :, :3], prompt[:, :, :3])
