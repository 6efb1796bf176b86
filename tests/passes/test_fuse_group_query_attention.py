"""fuse-group-query-attention: attention over a Concat KV cache -> com.microsoft GroupQueryAttention."""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import attention_feeds, attention_model
from passes_helpers import check_pass, node, op_counts, run_ort

from passes import run_pipeline
from passes.fusions.group_query_attention import FuseGroupQueryAttention

# seqlens_k, total_sequence_length and query_seqlens from the mask's and q's shapes
LENGTH_OPS = {"Shape": 2, "Gather": 3, "Sub": 1, "Expand": 2, "Cast": 3}


def near_misses(model) -> str:
    return " | ".join(str(m) for m in FuseGroupQueryAttention().near_misses(model))


@pytest.mark.parametrize("seq, past", [(3, 4), (5, 0), (1, 6)], ids=["chunk-with-past", "prefill", "decode"])
def test_gqa_attention_becomes_group_query_attention(seq, past):
    model = attention_model(heads=4, kv_heads=2)
    feeds = attention_feeds(model, seq=seq, past=past, padding=min(2, past))
    stats = check_pass(model, "fuse-group-query-attention", feeds=feeds)
    assert stats.counts == {"gqa": 1}
    assert op_counts(model) == {"GroupQueryAttention": 1, **LENGTH_OPS}
    gqa = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert gqa.domain == "com.microsoft"
    attrs = {k: a.value for k, a in gqa.attributes.items()}
    assert attrs == {"num_heads": 4, "kv_num_heads": 2, "scale": pytest.approx(8 ** -0.5)}
    assert [v.name for v in gqa.inputs[:5]] == ["q3", "k3", "v3", "past_key", "past_value"]
    assert gqa.inputs[10].name == "mask"  # attention_bias
    assert [v.name for v in model.graph.outputs] == ["out", "present_key", "present_value"]
    assert [v.producer() for v in model.graph.outputs] == [gqa] * 3


def test_present_is_the_whole_cache():
    """ORT 1.32's GroupQueryAttention, given a past of exactly the past length, returns [B, kv, past + S, D]."""
    model = attention_model(heads=4, kv_heads=2)
    feeds = attention_feeds(model, seq=3, past=4)
    run_pipeline(model, ["fuse-group-query-attention"])
    _, present_key, present_value = run_ort(model, feeds)
    assert present_key.shape == present_value.shape == (2, 2, 7, 8)
    np.testing.assert_array_equal(present_key[:, :, :4], feeds["past_key"])


def test_multi_head_attention_without_repeat_kv():
    model = attention_model(heads=3, kv_heads=3)
    assert check_pass(model, "fuse-group-query-attention", feeds=attention_feeds(model)).counts == {"mha": 1}


def test_four_dimensional_result_is_kept_when_not_merged():
    model = attention_model(merge_output=False)
    assert check_pass(model, "fuse-group-query-attention", feeds=attention_feeds(model)).counts == {"gqa": 1}
    assert op_counts(model)["Transpose"] == 1 and op_counts(model)["Reshape"] == 1  # back to [B, H, S, D]


def test_no_fusion_when_key_and_value_head_sizes_differ():
    model = attention_model(heads=3, kv_heads=3, k_dim=12, v_dim=8)
    assert check_pass(model, "fuse-group-query-attention", feeds=attention_feeds(model)).counts == {}
    reason = "K/V head sizes [8, 12] differ from q's 12 (MLA: fuse-mla-attention)"
    assert f"gqa at MatMul 'o4': {reason}" in near_misses(model)  # the attention, not the merge Reshape


def test_no_fusion_without_a_mask():
    model = attention_model(with_mask=False)
    assert check_pass(model, "fuse-group-query-attention", feeds=attention_feeds(model)).counts == {}
    assert "no additive mask before the Softmax" in near_misses(model)


def test_no_fusion_when_scores_are_read_elsewhere():
    model = attention_model(extra_ops=[node("ReduceMax", ["probs"], ["probs_max"], keepdims=0)])
    assert check_pass(model, "fuse-group-query-attention", feeds=attention_feeds(model)).counts == {}
    assert "Softmax 'probs' of the attention has other uses" in near_misses(model)


def test_no_fusion_for_a_head_size_gqa_does_not_support():
    model = attention_model(heads=4, kv_heads=2, k_dim=12, v_dim=12)
    assert check_pass(model, "fuse-group-query-attention", feeds=attention_feeds(model)).counts == {}
    assert "head size 12 is not a multiple of 8" in near_misses(model)
    stats = run_pipeline(model, ["fuse-group-query-attention", "fuse-mla-attention"])  # the fallback
    assert [s.counts for s in stats] == [{}, {"gqa": 1}]
