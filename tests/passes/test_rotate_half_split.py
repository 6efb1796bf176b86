"""rotate-half-split: rotate_half's halves by Split(sizes, axis=3), so OpenVINO's RoPE fusion fires."""

from __future__ import annotations

import onnx_ir as ir
import openvino as ov
import pytest
from passes_helpers import check_pass, op_counts, to_bytes
from rope_helpers import feeds, rope_model

from passes.fusions.rotate_half_split import RotateHalfSplit


def openvino_ropes(model) -> int:
    """RoPE layers in OpenVINO's CPU runtime graph of ``model``."""
    core = ov.Core()
    compiled = core.compile_model(core.read_model(to_bytes(model), b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    ops = compiled.get_runtime_model().get_ops()
    return sum(op.get_rt_info()["layerType"].astype(str) == "RoPE" for op in ops)


def test_split_into_halves_gets_sizes_and_a_positive_axis():
    model = rope_model(rotations=("q", "k"), tables_from_inputs=True)
    assert openvino_ropes(model) == 0  # OpenVINO does not recognise Split(num_outputs=2, axis=-1)
    stats = check_pass(model, "rotate-half-split", feeds=feeds(model))
    assert stats.counts == {"rotate_half_split": 2} and stats.nodes_before == stats.nodes_after
    for split in (n for n in model.graph if n.op_type == "Split"):
        assert split.attributes.get_int("axis") == 3 and split.inputs[1].const_value.numpy().tolist() == [4, 4]
    assert openvino_ropes(model) == 2


def test_positions_tables_stay_standard_ops():
    model = rope_model()
    assert check_pass(model, "rotate-half-split", feeds=feeds(model)).counts == {"rotate_half_split": 1}
    assert all(n.domain == "" for n in model.graph) and "Split" in op_counts(model)


@pytest.mark.parametrize("halves", ["split_sizes", "slices"])
def test_forms_openvino_already_matches_are_left_alone(halves):
    model = rope_model(halves=halves, tables_from_inputs=True)
    assert check_pass(model, "rotate-half-split", feeds=feeds(model)).counts == {}
    assert openvino_ropes(model) == 1


def test_halves_not_on_the_last_axis_are_a_near_miss():
    model = rope_model(tables_from_inputs=True)
    next(n for n in model.graph if n.op_type == "Split").attributes["axis"] = ir.AttrInt64("axis", 2)
    assert RotateHalfSplit()(model).counts == {}
    assert [str(m) for m in RotateHalfSplit().near_misses(model)] == [
        "rotate_half_split at Add 'q_out': the Split is not on the last axis"]


def test_no_rewrite_of_a_concat_that_is_not_rotate_half():
    model = rope_model(neg_first=False, tables_from_inputs=True)
    assert check_pass(model, "rotate-half-split", feeds=feeds(model)).counts == {}
    assert RotateHalfSplit().near_misses(model) == []
