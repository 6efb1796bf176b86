"""toolchain/interface/: the one reader of a graph's KV cache and of the exporter's metadata, on the graphs the
exporter writes (ONNX, and the stateless OpenVINO IR converted from it), against the architecture that wrote them."""

from __future__ import annotations

import json

import pytest

from toolchain.interface.graph import (
    HEAD_LAYOUT,
    KV_CACHE,
    MOE_LAYERS,
    cache_spec,
    graph_cache_spec,
    graph_inputs,
    graph_metadata,
    present_of,
)


def test_cache_spec_reads_heads_and_head_dim_of_the_cache_inputs_in_order():
    inputs = [("input_ids", [0, 0]), ("past_key_values.1.value", [0, 1, 0, 32]), ("attention_mask", [0, 0]),
              ("past_key_values.0.key", ["batch", 4, "past", 16])]
    assert list(cache_spec(inputs).items()) == [("past_key_values.1.value", (1, 32)), ("past_key_values.0.key", (4, 16))]
    assert cache_spec([("input_ids", None)]) == {}
    with pytest.raises(ValueError, match="past_key_values.0.key has no shape"):
        cache_spec([("past_key_values.0.key", None)])


def test_present_of_names_the_output_that_returns_the_cache_grown():
    assert present_of("past_key_values.12.value") == "present.12.value"


@pytest.fixture(scope="module")
def exported(tiny_checkpoints, tmp_path_factory):
    """Exports without parity (the graphs are what is read here): a latent MLA cache and a GQA cache."""
    from toolchain.stages.alone import export

    root = tmp_path_factory.mktemp("interface")
    return {name: (root / name, export(str(tiny_checkpoints[name]), root / name, parity=()))
            for name in ("deepseek_v3", "qwen2")}


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2"])
def test_the_readers_agree_with_the_architecture_on_onnx_and_on_the_ir(exported, name, tmp_path):
    import openvino as ov

    from toolchain.export.reference import reference_config
    from toolchain.export.architectures import architecture_for

    out, report = exported[name]
    config = reference_config(report["source"]["path"])
    arch = architecture_for(config.model_type)
    heads, key_dim, value_dim = arch.cache_dims(config)
    layers = config.num_hidden_layers
    expected = {f"past_key_values.{i}.{kind}": (heads, dim) for i in range(layers)
                for kind, dim in (("key", key_dim), ("value", value_dim))}
    onnx_path = out / "model.onnx"
    ir_path = tmp_path / "openvino_model.xml"
    ov.save_model(ov.convert_model(str(onnx_path)), ir_path)
    for path in (onnx_path, ir_path):
        assert graph_cache_spec(path) == expected
        metadata = graph_metadata(path)
        assert metadata[KV_CACHE] == report["graph"]["kv_cache"] == arch.kv_cache
        assert json.loads(metadata[MOE_LAYERS]) == arch.moe_layers(config)
        assert json.loads(metadata[HEAD_LAYOUT]) == {k: list(v) for k, v in arch.head_layout(config).items()}
    assert [name for name, _ in graph_inputs(onnx_path)] == report["graph"]["inputs"]
    assert (exported["deepseek_v3"][1]["graph"]["kv_cache"], exported["qwen2"][1]["graph"]["kv_cache"]) == \
        ("latent", "per-head")
