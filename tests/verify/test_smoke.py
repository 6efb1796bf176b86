"""The compile stage's smoke inference at the runtime's deployment defaults, in a child process
(toolchain/verify/smoke.py): recorded in compile.json when it passes; a crash (made here with the child's
DSTC_SMOKE_RAISE hook where the runtime does not crash by itself), a hang or non-finite logits fail the stage
with RuntimeCrashError, one line naming the signal and the prompt, and nothing is renamed into place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, DeepseekV2Config

from toolchain.verify.smoke import DECODE_STEPS, RAISE_ENV
from toolchain.errors import RuntimeCrashError
from toolchain.stages.alone import compile_artifact, export

from conftest import make_checkpoint, tiny_configs

REPO = Path(__file__).resolve().parents[2]
CASES = [[16, 7], [1], [2], [7], [16]]


@pytest.fixture(scope="module")
def llama_export(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "export"
    export(str(tiny_checkpoints["llama"]), out, parity=())
    return out


def openvino_defaults() -> dict:
    """What the CPU plugin applies with no properties on this machine (bf16 and a u8 KV cache on a bf16 CPU), read
    back from a one-op model compiled without any."""
    import openvino as ov
    import openvino.opset13 as opset

    x = opset.parameter([1], ov.Type.f32)
    probe = ov.Core().compile_model(ov.Model([opset.relu(x)], [x], "probe"), "CPU")
    return {name: probe.get_property(name)
            for name in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS")}


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
def test_smoke_runs_at_deployment_defaults_and_is_recorded(llama_export, tmp_path, backend):
    manifest = compile_artifact(llama_export, tmp_path / "out", backend, verify=False)
    smoke = manifest["smoke"]
    assert smoke["passed"] and json.loads((tmp_path / "out" / "compile.json").read_text())["smoke"] == smoke
    assert [case["prompt_lengths"] for case in smoke["cases"]] == CASES
    assert [case["batch"] for case in smoke["cases"]] == [2, 1, 1, 1, 1]
    assert all(case["decode_steps"] == DECODE_STEPS for case in smoke["cases"])
    config = smoke["runtime_config"]
    if backend == "openvino":  # not the verification's f32: the plugin's own choices and the artifact's rt_info
        defaults = openvino_defaults()
        assert config["INFERENCE_PRECISION_HINT"] == defaults["INFERENCE_PRECISION_HINT"].get_type_name()
        assert manifest["openvino"]["runtime_options"] == {"KV_CACHE_PRECISION": "f16"}
        assert config["KV_CACHE_PRECISION"] == "f16"  # recorded, whatever the plugin defaults to on this CPU
        assert smoke["threads"] == config["INFERENCE_NUM_THREADS"] == defaults["INFERENCE_NUM_THREADS"]
    else:
        assert config["intra_op_num_threads"] == os.cpu_count()
        assert config["graph_optimization_level"] == "ORT_ENABLE_ALL"


@pytest.mark.parametrize("backend, raised, length, where", [
    ("openvino", "SIGSEGV", 7, "the prefill of a 7-token prompt (batch 1)"),
    ("onnxruntime", "SIGABRT", 16, "the prefill of prompts of 16 and 7 tokens, left-padded (batch 2)"),
])
def test_a_crash_in_the_child_fails_the_stage_and_leaves_the_previous_artifact(
        llama_export, tmp_path, monkeypatch, backend, raised, length, where):
    out = tmp_path / "out"
    compile_artifact(llama_export, out, backend, verify=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setenv(RAISE_ENV, f"{raised}@{length}")
    with pytest.raises(RuntimeCrashError) as info:
        compile_artifact(llama_export, out, backend)
    error = info.value
    assert (error.exit_code, error.signal, error.where) == (5, raised, where)
    assert f"crashed with {raised} in {where}" in str(error) and "\n" not in str(error)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left beside it


def test_dstc_build_exits_5_with_one_line(tiny_checkpoints, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "smoke", "model": str(tiny_checkpoints["llama"]),
                                      "export": {"parity": []}, "compile": {"backend": "onnxruntime"}}))
    env = {**os.environ, RAISE_ENV: "SIGSEGV@2", "DSTC_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "toolchain", "build", str(recipe), "-o", str(tmp_path / "art")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 5, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "dstc: error: the onnxruntime artifact at the runtime's deployment defaults crashed with SIGSEGV in the "
        "prefill of a 2-token prompt (batch 1) (smoke inference in a child process; the f32 verification does not "
        "run these kernels)")
    assert not (tmp_path / "art").exists()


def test_non_finite_logits_fail_the_stage(tmp_path):
    """A checkpoint whose final norm is NaN: the runtime runs, the logits are not finite."""
    model = AutoModelForCausalLM.from_pretrained(make_checkpoint(tiny_configs()["qwen2"], tmp_path / "ckpt"))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "ckpt")
    export(str(tmp_path / "ckpt"), tmp_path / "export", parity=())
    with pytest.raises(RuntimeCrashError, match=r"failed in the prefill of prompts of 16 and 7 tokens, left-padded "
                                                r"\(batch 2\): FloatingPointError: 3104 of 3104 logits are not finite"):
        compile_artifact(tmp_path / "export", tmp_path / "out", "onnxruntime", verify=False)
    assert not (tmp_path / "out").exists()


def bf16_openvino_2026_4() -> bool:
    import openvino as ov

    return ov.__version__.startswith("2026.4") and \
        openvino_defaults()["INFERENCE_PRECISION_HINT"].get_type_name() == "bf16"


@pytest.mark.skipif(not bf16_openvino_2026_4(), reason="the crash found with OpenVINO 2026.4's CPU plugin at bf16")
def test_deepseek_v2_that_crashes_openvino_at_bf16_is_not_shipped(tmp_path):
    """The issue's case: a 3-head, hidden-96 DeepSeek-V2 segfaults in OpenVINO 2026.4's CPU plugin at its default
    bf16 for steps of up to 16 tokens, and the f32 verification passes it. Measured on the Intel Xeon (AMX): a gated
    MLP of intermediate size 32 (here the shared expert, moe_intermediate_size x n_shared_experts), which the plugin
    fuses into its LLMMLP kernel, crashes at decode step 1 after the left-padded batch; 48 and 64 do not, heads and
    hidden size do not matter. It depends on the CPU's kernels (the AMD EPYC with AVX-512 BF16 runs it): the
    artifact is first run as deployed alone, and where the runtime does not crash here the test is skipped (the
    mechanism is tested with the DSTC_SMOKE_RAISE hook above)."""
    from toolchain.verify.smoke import run_smoke

    config = DeepseekV2Config(vocab_size=97, hidden_size=96, num_hidden_layers=2, num_attention_heads=3,
                              num_key_value_heads=3, intermediate_size=128, max_position_embeddings=256,
                              kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                              q_lora_rank=None, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                              moe_intermediate_size=32, first_k_dense_replace=1, topk_method="greedy", n_group=1,
                              topk_group=1)
    export(str(make_checkpoint(config, tmp_path / "ckpt")), tmp_path / "export", parity=())
    verified = compile_artifact(tmp_path / "export", tmp_path / "f32-only", "openvino", smoke=False)
    assert verified["verification"]["passed"]
    try:
        run_smoke(tmp_path / "f32-only", "openvino")
    except RuntimeCrashError as crash:
        signal, where = crash.signal, crash.where
    else:
        pytest.skip("OpenVINO's CPU plugin does not crash on this model on this CPU")
    with pytest.raises(RuntimeCrashError) as info:
        compile_artifact(tmp_path / "export", tmp_path / "out", "openvino")
    assert (info.value.signal, info.value.where) == (signal, where) and where.startswith(("the prefill of", "decode"))
    assert not (tmp_path / "out").exists()


def test_an_artifact_too_large_to_run_here_is_built_without_running_it(llama_export, tmp_path, monkeypatch):
    """Smoke test and verification run the artifact, about RUN_MEMORY_FACTOR x its weights of RAM: on a machine
    with less, both are skipped and compile.json says why (a 61-layer DeepSeek-V3 is ~350 GB in INT4)."""
    from toolchain.stages import compile as stage

    weights = (llama_export / "model.onnx").stat().st_size
    monkeypatch.setattr(stage, "memory_bytes", lambda: int(stage.RUN_MEMORY_FACTOR * weights) - 1)
    manifest = compile_artifact(llama_export, tmp_path / "out", "onnxruntime")
    reason = manifest["smoke"]["skipped"]
    assert "more than this machine's" in reason and manifest["verification"]["skipped"] == reason
    assert manifest["smoke"]["passed"] and "cases" not in manifest["smoke"] and "smoke_s" not in manifest["timings"]
    monkeypatch.setattr(stage, "memory_bytes", lambda: int(stage.RUN_MEMORY_FACTOR * weights) + 10**6)
    manifest = compile_artifact(llama_export, tmp_path / "out2", "onnxruntime")
    assert "skipped" not in manifest["smoke"] and manifest["smoke"]["cases"]
    assert "skipped" not in manifest["verification"] and manifest["verification"]["passed"]


def test_a_recipe_can_turn_the_smoke_test_off(llama_export, tiny_checkpoints, tmp_path):
    from toolchain.recipe import CompileSection
    from toolchain.stages.choices import plan_compile
    from toolchain.stages.runner import compile_stage

    on, off = (compile_stage(plan_compile(CompileSection(backend="openvino", smoke=s)), tiny_checkpoints["llama"])
               for s in (True, False))
    assert "smoke" not in on.config and off.config["smoke"] is False  # stage ids before the option stay valid
    manifest = off.run(llama_export, tmp_path / "out", lambda _: None)
    assert manifest.get("smoke") is None and manifest["verification"]["passed"]
