"""fuse-rotary-embedding: x*cos + rotate_half(x)*sin with tables from position_ids -> RotaryEmbedding + caches."""

from __future__ import annotations

import pytest
from passes_helpers import check_pass, op_counts
from rope_helpers import feeds, rope_model

from passes.fusions.rotary_embedding import FuseRotaryEmbedding

CACHE_OPS = {"ReduceMax": 1, "Add": 1, "Range": 1, "Cast": 1, "Unsqueeze": 1, "Mul": 1, "Cos": 1, "Sin": 1}


def near_misses(model) -> str:
    return " | ".join(str(m) for m in FuseRotaryEmbedding().near_misses(model))


@pytest.mark.parametrize("halves", ["split", "split_sizes", "slices"])
def test_rotation_becomes_rotary_embedding(halves):
    model = rope_model(halves=halves)
    stats = check_pass(model, "fuse-rotary-embedding", feeds=feeds(model))
    assert stats.counts == {"rotary_embedding": 1, "cos_sin_caches": 1}
    assert op_counts(model) == {"RotaryEmbedding": 1, **CACHE_OPS}
    rope = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    assert rope.domain == "com.microsoft" and rope.attributes.get_int("interleaved") == 0
    assert rope.inputs[1].name == "position_ids" and rope.outputs[0].name == "q_out"


def test_q_and_k_share_one_pair_of_caches_with_the_attention_scaling():
    model = rope_model(rotations=("q", "k"), scaling=0.75)
    stats = check_pass(model, "fuse-rotary-embedding", feeds=feeds(model))
    assert stats.counts == {"rotary_embedding": 2, "cos_sin_caches": 1}
    cache_ops = {**CACHE_OPS, "Mul": 3}  # angles, and the scaling of cos and of sin
    assert op_counts(model) == {"RotaryEmbedding": 2, **cache_ops}


def test_no_fusion_without_the_position_ids_tables():
    model = rope_model(tables_from_inputs=True)
    assert check_pass(model, "fuse-rotary-embedding", feeds=feeds(model)).counts == {}
    assert "the Cos table is not Unsqueeze(_, [1])" in near_misses(model)


def test_no_fusion_for_the_other_rotation_direction():
    model = rope_model(neg_first=False)  # Concat(x1, -x2): not rotate_half
    assert check_pass(model, "fuse-rotary-embedding", feeds=feeds(model)).counts == {}
    assert "RotaryEmbedding" not in op_counts(model)
