"""bf16 weight storage (export.weights, toolchain/export/weights.py): a bf16 checkpoint's matrices are stored as bf16
initializers widened by a Cast, the same float32 values as a float32 export at half the bytes; passes keep the
Cast, compression reads through it (streamed and whole-model), the artifacts verify on both backends, and a
checkpoint whose values bf16 would round is refused."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import yaml
from onnx import numpy_helper

from toolchain.build import build
from toolchain.errors import InputError
from toolchain.verify.layer_parity import compare_layers
from toolchain.verify.parity import parity_cases
from toolchain.recipe import CompressSection
from toolchain.stages.alone import compress, export, optimize

ARCHS = ("qwen2", "deepseek_v3")


@pytest.fixture(scope="module")
def bf16_checkpoints(tiny_checkpoints, tmp_path_factory):
    """The tiny random checkpoints saved in bf16, as the hub ships dense and MoE models."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.bfloat16)
        model.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="module")
def exports(bf16_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-exports")
    out = {}
    for arch in ARCHS:
        for storage in ("float32", "bfloat16"):
            report = export(str(bf16_checkpoints[arch]), root / f"{arch}-{storage}", weights=storage)
            out[arch, storage] = (root / f"{arch}-{storage}", report)
    return out


def initializers(directory) -> dict[str, onnx.TensorProto]:
    model = onnx.load(str(directory / "model.onnx"))
    return {t.name: t for t in model.graph.initializer}, model


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_storage_holds_the_float32_exports_values_at_half_the_bytes(exports, arch):
    (f32_dir, f32_report), (bf_dir, bf_report) = exports[arch, "float32"], exports[arch, "bfloat16"]
    assert f32_report["graph"]["weights"] == "float32" and bf_report["graph"]["weights"] == "bfloat16"
    for report in (f32_report, bf_report):
        assert all(r["passed"] and r["tokens_identical"] for r in report["parity"].values())
        assert set(report["parity"]) == {"onnxruntime", "openvino"}
    f32, _ = initializers(f32_dir)
    bf, model = initializers(bf_dir)
    stored = {name for name, t in bf.items() if t.data_type == onnx.TensorProto.BFLOAT16}
    assert stored and all(len(bf[name].dims) >= 2 for name in stored)  # matrices only; norms stay float32
    # every matrix the checkpoint holds in bf16: transformers 5.24 saves V3's router in float32
    # (_keep_in_fp32_modules_strict "gate.weight"), which stays float32
    matrices = {name for name, t in f32.items() if len(t.dims) >= 2 and t.data_type == onnx.TensorProto.FLOAT
                and name in bf}
    assert stored == {name for name in matrices if not (arch == "deepseek_v3" and "/router/" in name)}
    casts = {n.input[0]: n for n in model.graph.node if n.op_type == "Cast"}
    for name in stored:
        assert casts[name].attribute[0].i == onnx.TensorProto.FLOAT  # read through its widening Cast only
        widened = numpy_helper.to_array(bf[name]).astype(np.float32)
        assert np.array_equal(widened.view(np.uint32), numpy_helper.to_array(f32[name]).view(np.uint32))
    f32_bytes = sum(t.ByteSize() for n, t in f32.items() if n in stored)
    bf_bytes = sum(t.ByteSize() for n, t in bf.items() if n in stored)
    assert 0.49 < bf_bytes / f32_bytes < 0.51


def test_auto_stays_float32_below_its_threshold_and_bf16_of_float32_values_is_refused(tiny_checkpoints,
                                                                                        bf16_checkpoints, tmp_path):
    from toolchain.export.weights import BF16_AUTO_BYTES

    report = export(str(bf16_checkpoints["qwen2"]), tmp_path / "auto", parity=())
    assert report["source"]["parameters"] * 4 < BF16_AUTO_BYTES
    assert report["graph"]["weights"] == "float32"
    with pytest.raises(InputError) as error:
        export(str(tiny_checkpoints["qwen2"]), tmp_path / "refused", weights="bfloat16", parity=())
    assert "would round" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_passes_keep_the_widening_cast_and_parity(exports, bf16_checkpoints, tmp_path, target):
    bf_dir, _ = exports["qwen2", "bfloat16"]
    report = optimize(bf_dir, tmp_path / "opt", target, source=bf16_checkpoints["qwen2"])
    assert all(r["passed"] for r in report["parity"].values())
    before, _ = initializers(bf_dir)
    after, _ = initializers(tmp_path / "opt")
    stored = {n for n, t in before.items() if t.data_type == onnx.TensorProto.BFLOAT16}
    assert {n for n, t in after.items() if t.data_type == onnx.TensorProto.BFLOAT16} == stored  # none folded


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_model_compression_of_bf16_storage_equals_the_float32_exports(exports, tmp_path, arch):
    """The whole-model path widens the stored weights first: NNCF sees the float32 export's graph."""
    written = {}
    for storage in ("float32", "bfloat16"):
        compress(exports[arch, storage][0], tmp_path / storage,
                 CompressSection(streaming="never", scheme="int4-grouped", group_size=32), target="onnxruntime")
        written[storage] = initializers(tmp_path / storage)[0]
    assert written["float32"].keys() == written["bfloat16"].keys()
    for name, tensor in written["float32"].items():
        assert tensor.SerializeToString() == written["bfloat16"][name].SerializeToString(), name


@pytest.mark.parametrize("scheme", ["int4-grouped", "int8-per-head"])
def test_streamed_compression_reads_through_the_cast(exports, tmp_path, scheme):
    """Streamed from bf16 storage: the tensors the stream writes from the float32 export (the values are equal)."""
    written = {}
    for storage in ("float32", "bfloat16"):
        compress(exports["deepseek_v3", storage][0], tmp_path / storage,
                 CompressSection(streaming="always", scheme=scheme, group_size=32), target="onnxruntime")
        written[storage] = initializers(tmp_path / storage)[0]
    quantized = {n for n, t in written["float32"].items() if t.data_type != onnx.TensorProto.FLOAT}
    assert quantized and quantized == {n for n, t in written["bfloat16"].items()
                                       if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16)}
    for name, tensor in written["float32"].items():  # quantized values, scales, zero points, norms
        if tensor.data_type == written["bfloat16"][name].data_type:
            assert numpy_helper.to_array(tensor).tobytes() == \
                numpy_helper.to_array(written["bfloat16"][name]).tobytes(), name


def test_layer_by_layer_parity_on_bf16_storage(exports, bf16_checkpoints):
    bf_dir, _ = exports["deepseek_v3", "bfloat16"]
    ckpt = bf16_checkpoints["deepseek_v3"]
    result = compare_layers(bf_dir / "model.onnx", ckpt, "onnxruntime", parity_cases(ckpt, 97), 4, 0)
    assert result["passed"] and result["max_relative_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_bf16_stored_int4_build_verifies(bf16_checkpoints, tmp_path, monkeypatch, backend):
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "bf16", "model": str(bf16_checkpoints["deepseek_v3"]),
                                      "export": {"parity": [backend], "weights": "bfloat16"},
                                      "compress": {"scheme": "int4-grouped", "group_size": 32, "streaming": "always"},
                                      "compile": {"backend": backend}}))
    manifest = build(recipe, tmp_path / "art")
    reports = manifest["provenance"]["stage_reports"]
    assert reports["export/export.json"]["graph"]["weights"] == "bfloat16"
    assert reports["compile/compile.json"]["verification"]["passed"]

