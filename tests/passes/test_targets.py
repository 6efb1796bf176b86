"""passes.targets: the per-runtime pipelines and their default expectations."""

from __future__ import annotations

import pytest
from attention_helpers import attention_model

from passes import PassError, get_pass
from passes.targets import GENERIC, PIPELINES, default_expectations, expectations_for, model_info, pipeline


@pytest.mark.parametrize("target", sorted(PIPELINES))
def test_pipelines_use_registered_passes_for_their_target(target):
    for name in pipeline(target):
        targets = get_pass(name).targets
        assert target in targets or "any" in targets, f"{name} is for {targets}"


@pytest.mark.parametrize("target", sorted(PIPELINES))
def test_every_pipeline_starts_with_the_generic_part(target):
    assert pipeline(target)[:len(GENERIC)] == GENERIC
    assert {"fold-constants", "fold-batchnorm", "eliminate-transposes", "cse", "remove-unused"} <= set(GENERIC)


def test_openvino_pipeline_keeps_standard_ops_only():
    assert all(get_pass(name).targets in (("any",), ("openvino",)) for name in pipeline("openvino"))


def test_unknown_target():
    with pytest.raises(PassError, match="unknown target 'tensorrt'"):
        pipeline("tensorrt")


def test_expectations_scale_with_depth_and_attention_kind():
    llama = default_expectations("onnxruntime", "gqa", 3)
    assert llama["fuse-group-query-attention"] == {"min": 3, "max": 3}
    assert llama["fuse-rotary-embedding"]["min"] == 6 and llama["fuse-skip-rms-norm"] == {"min": 6, "max": 6}
    assert "fuse-mla-attention" not in llama
    v3 = default_expectations("onnxruntime", "mla", 5)
    assert v3["fuse-mla-attention"] == {"min": 5, "max": 5, "count": "mla"}
    assert v3["fuse-group-query-attention"] == {"max": 0}  # GQA declines MLA, also with equal K/V head sizes
    assert default_expectations("openvino", "gqa", 2) == {"rotate-half-split": {"min": 4, "max": 4}}
    assert default_expectations("onnxruntime", None, 12) == {}


def test_expectations_for_reads_the_exporters_metadata_and_the_pass_list():
    model = attention_model()
    assert model_info(model) == (None, None) and expectations_for(model, "onnxruntime") == {}
    model.metadata_props.update({"dstc.attention": "gqa", "dstc.num_layers": "2"})
    assert model_info(model) == ("gqa", 2)
    only = expectations_for(model, "onnxruntime", ["infer-shapes", "fuse-group-query-attention"])
    assert only == {"fuse-group-query-attention": {"min": 2, "max": 2}}


def test_moe_layers_fused_into_one_node_are_not_expected_to_show_a_silu():
    """The fused-onnxruntime lowering runs a MoE layer's experts inside com.microsoft.MoE: a family without shared
    experts (qwen3_moe) shows no SiLU there; the other lowerings keep one per layer."""
    model = attention_model()
    model.metadata_props.update({"dstc.attention": "gqa", "dstc.num_layers": "3", "dstc.moe_layers": "[0, 2]",
                                 "dstc.moe_lowering": "fused-onnxruntime"})
    assert expectations_for(model, "onnxruntime")["fuse-silu"] == {"min": 1}
    model.metadata_props["dstc.moe_lowering"] = "fused-openvino"
    assert expectations_for(model, "onnxruntime")["fuse-silu"] == {"min": 3}
