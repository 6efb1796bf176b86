"""The optimize stage end to end: export a tiny checkpoint, rewrite it for ONNX Runtime or OpenVINO, check parity
with PyTorch on that runtime, and the fusions per layer (ORT's fused ops in the graph, OpenVINO's in its
compiled runtime graph). The default run covers a GQA and an MLA architecture, the latter with either KV cache; -m
slow runs every one."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from toolchain.errors import InputError
from toolchain.errors import OptimizeError
from toolchain.stages.alone import export, optimize

GQA = ("llama", "qwen2")
ALL = ("llama", "qwen2", "deepseek_v2", "deepseek_v2_group_limited", "deepseek_v3", "deepseek_v3_plain_rope")


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    made = {}

    def get(name, mla_cache=None):
        key = name if mla_cache is None else f"{name}-{mla_cache}"
        if key not in made:
            export(str(tiny_checkpoints[name]), root / key, parity=(), mla_cache=mla_cache)
            made[key] = root / key
        return made[key]

    return get


def check(report: dict, arch: str, target: str, checkpoint, kv_cache: str) -> None:
    layers = AutoConfig.from_pretrained(checkpoint).num_hidden_layers
    counts, ops = report["counts"], report["output"]["op_types"]
    parity = report["parity"][target]
    assert parity["passed"] and parity["tokens_identical"], parity
    assert report["output"]["nodes"] < report["input"]["nodes"] or target == "openvino"
    if target == "onnxruntime":
        if arch in GQA:
            assert counts["fuse-group-query-attention"] == {"gqa": layers}
            assert ops["com.microsoft.GroupQueryAttention"] == layers
        elif kv_cache == "latent":
            # scores over the latent cache are two products no attention op takes: the Softmax stays, one a layer
            assert "fuse-mla-attention" not in counts and "Attention" not in ops
            assert report["output"]["opsets"][""] == 18
            assert ops["Softmax"] == layers + (layers - 1 if arch.startswith("deepseek_v2") else 0)
        else:
            assert counts["fuse-mla-attention"] == {"mla": layers} and ops["Attention"] == layers
            assert report["output"]["opsets"][""] == 23
            assert "Softmax" not in ops or arch.startswith("deepseek_v2")  # V2 routes with a softmax
        assert ops["com.microsoft.RotaryEmbedding"] == 2 * layers
        assert ops["com.microsoft.SkipSimplifiedLayerNormalization"] == 2 * layers
    else:
        assert all(not op.startswith("com.microsoft") for op in ops)
        assert counts["rotate-half-split"] == {"rotate_half_split": 2 * layers}
        fused = report["openvino_fusions"]
        # OpenVINO's SDPA fusion matches softmax(q K^T) V; the latent form's scores are a sum of two products
        assert fused["stateful"]["ScaledDotProductAttention"] == (0 if kv_cache == "latent" else layers)
        assert fused["stateful"]["RoPE"] == fused["stateless"]["RoPE"] == 2 * layers
        assert fused["stateful"]["RMS"] >= 2 * layers + 1


def run(exports, tiny_checkpoints, tmp_path, arch, target, new_tokens, mla_cache=None):
    out = tmp_path / f"{arch}-{target}"
    report = optimize(exports(arch, mla_cache), out, target, new_tokens=new_tokens)
    assert json.loads((out / "passes.json").read_text()) == report
    assert (out / "model.onnx").is_file() and (out / "export.json").is_file()
    kv_cache = json.loads((out / "export.json").read_text())["graph"]["kv_cache"]
    assert kv_cache == (mla_cache or ("per-head" if arch in GQA else "latent"))
    check(report, arch, target, tiny_checkpoints[arch], kv_cache)
    stats = report["passes"]
    assert [s["name"] for s in stats] == report["pipeline"]
    assert all(a["nodes_after"] == b["nodes_before"] for a, b in zip(stats, stats[1:]))


@pytest.mark.parametrize("arch, target, mla_cache", [
    ("llama", "onnxruntime", None), ("deepseek_v3", "onnxruntime", None),
    # fuse-mla-attention (ONNX Attention, opset 23) takes only the per-head cache
    ("deepseek_v3", "onnxruntime", "per-head"), ("qwen2", "openvino", None)])
def test_optimize(exports, tiny_checkpoints, tmp_path, arch, target, mla_cache):
    run(exports, tiny_checkpoints, tmp_path, arch, target, new_tokens=4, mla_cache=mla_cache)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("arch, mla_cache", [(a, None) for a in ALL] + [(a, "per-head") for a in ALL if a not in GQA])
def test_optimize_every_architecture(exports, tiny_checkpoints, tmp_path, arch, target, mla_cache):
    run(exports, tiny_checkpoints, tmp_path, arch, target, new_tokens=16, mla_cache=mla_cache)


def test_given_passes_and_expectations(exports, tmp_path):
    report = optimize(exports("llama"), tmp_path / "out", "onnxruntime", ["infer-shapes", "fuse-rms-norm"],
                      parity=False)
    assert report["pipeline"] == ["infer-shapes", "fuse-rms-norm"] and "parity" not in report
    assert report["expectations"] == {"fuse-rms-norm": {"min": 7}}
    assert report["counts"]["fuse-rms-norm"] == {"rms_norm": 7}


def test_missed_expectation_names_the_pass_and_its_near_miss(exports, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OptimizeError) as info:  # without infer-shapes the norm's dtype is unknown
        optimize(exports("llama"), out, "onnxruntime", ["fuse-rms-norm"], parity=False)
    assert info.value.pass_name == "fuse-rms-norm" and info.value.exit_code == 4
    assert "run infer-shapes first" in info.value.near_miss
    assert not out.exists()


@pytest.mark.parametrize("target, passes, message", [
    ("tensorrt", None, "unknown target 'tensorrt'"),
    ("openvino", ["fuse-rms-norm"], "pass 'fuse-rms-norm' is for onnxruntime, not for target 'openvino'"),
    ("onnxruntime", ["fuse-everything"], "unknown pass 'fuse-everything'"),
])
def test_bad_requests_are_input_errors(exports, tmp_path, target, passes, message):
    with pytest.raises(InputError, match=message):
        optimize(exports("llama"), tmp_path / "out", target, passes, parity=False)
    assert not (tmp_path / "out").exists()


def test_not_an_export(tmp_path):
    with pytest.raises(InputError, match="not a directory"):
        optimize(tmp_path / "missing", tmp_path / "out", "onnxruntime")
