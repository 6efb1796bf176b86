"""The shipped scheme (issue #24): a checkpoint's FP8 / FP4 weights kept as their stored codes and scales, exactly
what the dequantized graph computes; FP4 refused for ONNX Runtime before any stage runs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
import yaml
from conftest import COMMON, MLA, V4, run_cli
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV4Config

from passes.quantize._weights import dequantize_linear
from toolchain.checkpoint.reader import open_checkpoint
from toolchain.export.graph import load_graph
from toolchain.interface.graph import SOURCE
from toolchain.models.shape_faithful import write_random_checkpoint
from toolchain.recipe import CompressSection
from toolchain.stages.alone import compress, export

# 200 = 128 + 72: partial FP8 blocks, which the graph's blocks split (gcd(200, 128) = 8 rows per scale)
V3 = DeepseekV3Config(**{**COMMON, "hidden_size": 200, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 256}, **{**MLA, "moe_intermediate_size": 128},
                      q_lora_rank=128, n_routed_experts=4, n_group=2, topk_group=1, rope_interleave=True)
SHIPPED = CompressSection(scheme="shipped")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """name -> (checkpoint, export): V3 FP8 with float32 and with power-of-two scales, V4 (FP8 attention, FP4
    experts)."""
    root = tmp_path_factory.mktemp("shipped")
    out = {}
    for name, config, fp8, scale_fmt in (("v3", V3, True, "float"), ("v3-ue8m0", V3, True, "ue8m0"),
                                         ("v4", DeepseekV4Config(**V4), False, "float")):
        checkpoint = write_random_checkpoint(config, root / name, fp8=fp8, scale_fmt=scale_fmt)
        export(str(checkpoint), root / f"{name}-export", parity=())
        out[name] = checkpoint, root / f"{name}-export"
    return out


@pytest.mark.parametrize("name", [pytest.param("v4", marks=pytest.mark.slow), "v3-ue8m0"])  # v4: 20 s
def test_power_of_two_scales_are_exact_on_openvino(exports, tmp_path, name):
    _, exported = exports[name]
    report = compress(exported, tmp_path / "out", SHIPPED, target="openvino")
    assert report["model"]["top1_agreement"] == 1.0
    assert report["model"]["kl_max"] < 1e-9
    shipped = [w for w in report["per_weight"] if w["planned"] == "shipped"]
    assert shipped and all(w["weight_error"] == 0.0 for w in shipped)
    labels = report["details"]["shipped"]
    if name == "v4":  # the 8 experts x 3 of each of 4 layers in FP4; attention and shared experts in FP8
        assert labels["fp4-e2m1-b1x32-e8m0"] == 4 * 8 * 3
        assert {w["precision"] for w in shipped} == {"fp4-e2m1", "fp8-e4m3"}
    xml = (tmp_path / "out" / "openvino_model.xml").read_text()
    assert ('element_type="f4e2m1"' in xml) == (name == "v4") and 'element_type="f8e4m3"' in xml


def test_float_scales_compute_the_float32_dequantization_on_onnxruntime(exports, tmp_path):
    """V3's float32 scales: each weight is q x s in float32, the checkpoint's own dequantization (the export
    rounds it to bf16, so the report's error against the export is that rounding)."""
    checkpoint, exported = exports["v3"]
    report = compress(exported, tmp_path / "out", SHIPPED, target="onnxruntime")
    assert report["details"]["onnxruntime_kernels"]["DequantizeLinear"] == report["details"]["shipped"][
        "fp8-e4m3-b128x128-f32"]
    sources = {name: json.loads(v.const_value.metadata_props[SOURCE])
               for name, v in load_graph(exported / "model.onnx").graph.initializers.items()
               if SOURCE in v.const_value.metadata_props}
    model = load_graph(tmp_path / "out" / "model.onnx")
    checked = 0
    with open_checkpoint(checkpoint) as reader:
        for node in model.graph:
            if node.op_type != "DequantizeLinear":
                continue
            source = sources[node.name.removesuffix("/DequantizeLinear")]
            expected = reader.tensor(source["tensor"], torch.float32).numpy()
            expected = expected[source["rows"]] if source["rows"] else expected
            np.testing.assert_array_equal(dequantize_linear(node), expected.T)
            checked += 1
    assert checked == report["details"]["shipped"]["fp8-e4m3-b128x128-f32"] > 20
    assert 0 < max(w["weight_error"] for w in report["per_weight"]) < 2**-8  # bf16's rounding of the export


def test_a_scale_that_does_not_fit_its_weight_is_one_line(exports, tmp_path, monkeypatch, capsys):
    checkpoint, exported = exports["v3-ue8m0"]
    damaged = tmp_path / "ck"
    shutil.copytree(checkpoint, damaged)
    shard = next(damaged.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(n for n in tensors if n.endswith("_scale_inv"))
    tensors[name] = torch.ones((7, 7), dtype=tensors[name].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    report = json.loads((exported / "export.json").read_text())
    report["source"]["path"] = str(damaged)
    copy = tmp_path / "export"
    shutil.copytree(exported, copy)
    (copy / "export.json").write_text(json.dumps(report))
    code, _, err = run_cli(monkeypatch, capsys, "compress", copy, "-o", tmp_path / "out", "--scheme", "shipped",
                           "--backend", "openvino", "--no-cache")
    assert code == 2 and err.count("\n") == 1 and "[7, 7]" in err and not (tmp_path / "out").exists()


def test_onnxruntime_refuses_fp4_before_any_stage(exports, tmp_path, monkeypatch, capsys):
    checkpoint, _ = exports["v4"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "v4", "model": str(checkpoint), "compress": {"scheme": "shipped"},
                                      "compile": {"backend": "onnxruntime"}}))
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "art")
    assert code == 2 and err.count("\n") == 1 and "float4e2m1" in err
    assert not (tmp_path / "art").exists()


def test_the_shipped_onnx_graph_names_its_formats(exports, tmp_path):
    _, exported = exports["v3-ue8m0"]
    compress(exported, tmp_path / "out", SHIPPED, target="onnxruntime")
    model = onnx.load(tmp_path / "out" / "model.onnx")
    codes = [t for t in model.graph.initializer if t.name.endswith("/shipped_codes")]
    assert codes and {t.data_type for t in codes} == {onnx.TensorProto.FLOAT8E4M3FN}
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 21


@pytest.mark.parametrize("name,target", [("v3-ue8m0", "onnxruntime"),
                                         pytest.param("v4", "openvino", marks=pytest.mark.slow)])
def test_streamed_shipped_writes_the_whole_model_paths_graph(exports, tmp_path, name, target):
    """An export too large for the whole-model path (streaming: always here) keeps its codes one weight at a time:
    the same DequantizeLinear weights as the whole-model path, each measured against the export's weight as it
    is written (FP4 / FP8 with power-of-two scales: exactly), the run on calibration text left unmeasured."""
    _, exported = exports[name]
    streamed = compress(exported, tmp_path / "streamed", SHIPPED.model_copy(update={"streaming": "always"}),
                        target=target)
    whole = compress(exported, tmp_path / "whole", SHIPPED, target="onnxruntime" if name == "v3-ue8m0" else target)
    assert streamed["streaming"] and streamed["model"]["kl_mean"] is None
    assert streamed["details"]["shipped"] == whole["details"]["shipped"]
    rows = {r["weight"]: r for r in streamed["per_weight"]}
    for row in whole["per_weight"]:
        mine = rows[row["weight"]]
        assert mine["planned"] == row["planned"] and mine["precision"].startswith(row["precision"]), row["weight"]
        if row["planned"] == "shipped":
            assert mine["weight_error"] == 0.0 and mine["bits_per_weight"] == pytest.approx(row["bits_per_weight"])
    streamed_graph = onnx.load(tmp_path / "streamed" / "model.onnx")
    codes = {t.name: t for t in streamed_graph.graph.initializer if t.name.endswith("/shipped_codes")}
    assert len(codes) == sum(whole["details"]["shipped"].values())
    if target == "onnxruntime":  # the very tensors the whole-model path writes
        reference = {t.name: t for t in onnx.load(tmp_path / "whole" / "model.onnx").graph.initializer}
        for tensor_name, tensor in codes.items():
            assert onnx.numpy_helper.to_array(tensor).tobytes() == \
                onnx.numpy_helper.to_array(reference[tensor_name]).tobytes()
