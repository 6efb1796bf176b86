"""MLA latent KV cache (the default; ``export.mla_cache: latent`` / ``dstc export --mla-cache latent``,
toolchain/export/deepseek.py): parity with PyTorch on both backends on checkpoints the embedded models do not
cover (other head sizes, rope scaling, routing), the cache's shapes and bytes, the stages after export (passes,
compression with its 3-D absorbed weights reported per head, compile with the stateful OpenVINO IR, dstc build),
layer-by-layer parity, and what is refused."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
import yaml
from conftest import COMMON, MLA, make_checkpoint, run_cli
from test_export import check_report

from toolchain.errors import InputError
from toolchain.export.architectures import architecture_for
from toolchain.export.deepseek import with_mla_cache
from toolchain.recipe import CompressSection
from toolchain.stages.alone import compile_artifact, compress, export, optimize

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
LINEAR = {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}


def other_configs() -> dict:
    """Random V2/V3 configs with head sizes, rope scaling and routing that neither conftest nor the embedded
    models have."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    return {
        # V2, yarn (its mscale changes the softmax scale), a latent wider than the model, rope 16 > nope 8
        "v2-yarn": DeepseekV2Config(**{**COMMON, "num_attention_heads": 2}, **{
            **MLA, "num_key_value_heads": 2, "kv_lora_rank": 80, "qk_rope_head_dim": 16, "qk_nope_head_dim": 8,
            "v_head_dim": 20}, q_lora_rank=None, n_routed_experts=6, topk_method="group_limited_greedy", n_group=3,
            topk_group=2, routed_scaling_factor=1.25, rope_parameters=YARN),
        # V3, linear rope scaling, 8 heads of odd sizes, 3 of 12 experts in 3 groups, interleaved rope
        "v3-linear": DeepseekV3Config(**{**COMMON, "num_attention_heads": 8}, **{
            **MLA, "num_key_value_heads": 8, "kv_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 12,
            "v_head_dim": 6, "num_experts_per_tok": 3}, q_lora_rank=40, n_routed_experts=12, n_group=3,
            topk_group=2, routed_scaling_factor=2.0, rope_interleave=True, rope_parameters=LINEAR),
        # V3 with yarn as the real checkpoint has it, no first dense layer, norm_topk_prob off
        "v3-yarn": DeepseekV3Config(**COMMON, **{**MLA, "first_k_dense_replace": 0, "kv_lora_rank": 16,
                                                "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16},
                                    q_lora_rank=24, n_routed_experts=8, n_group=2, topk_group=1,
                                    norm_topk_prob=False, rope_interleave=True, rope_parameters=YARN),
    }


ROUTINGS = ("deepseek_v2", "deepseek_v2_group_limited", "deepseek_v3", "deepseek_v3_plain_rope")


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-ckpt")
    out = {name: tiny_checkpoints[name] for name in ROUTINGS}
    out.update({name: make_checkpoint(config, root / name) for name, config in other_configs().items()})
    return out


@pytest.fixture(scope="module")
def latent_exports(checkpoints, tmp_path_factory):
    """Each checkpoint exported with the latent cache, parity checked on both backends (cached)."""
    root = tmp_path_factory.mktemp("latent")
    done = {}

    def get(name: str):
        if name not in done:
            done[name] = root / name, export(str(checkpoints[name]), root / name, mla_cache="latent")
        return done[name]

    return get


def config_of(export_dir) -> dict:
    report = json.loads((export_dir / "export.json").read_text())
    from pathlib import Path

    return json.loads((Path(report["source"]["path"]) / "config.json").read_text())


def cache_inputs(model_path) -> dict[str, list]:
    graph = onnx.load(model_path, load_external_data=False).graph
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input
            if i.name.startswith("past_key_values.")}


@pytest.mark.parametrize("name", [*ROUTINGS, *other_configs()])
def test_latent_cache_matches_pytorch_on_both_backends(latent_exports, name):
    """Prefill + 16 greedy steps of the short, long and left-padded batch-2 cases: the tolerances of the per-head
    form (ORT 1e-4, OpenVINO 1e-3 of the logits' range) and identical tokens."""
    out, report = latent_exports(name)
    check_report(report)
    assert report["graph"]["kv_cache"] == "latent"
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert {p.key: p.value for p in model.metadata_props}["dstc.kv_cache"] == "latent"
    attention_ops = [n.op_type for n in model.graph.node if "/self_attn/" in n.name]
    layers = config_of(out)["num_hidden_layers"]
    # no per-head keys or values anywhere: kv_b_proj is the two absorbed weights, read by batched MatMuls
    names = {t.name for t in model.graph.initializer}
    assert sum(n.endswith("kv_b_proj/k_absorbed") for n in names) == layers
    assert sum(n.endswith("kv_b_proj/v_absorbed") for n in names) == layers
    assert not any(n.endswith("kv_b_proj/weight") for n in names)
    assert attention_ops and "Expand" not in attention_ops  # the per-head form expands the rotary key to every head


@pytest.mark.parametrize("name", ["deepseek_v3", "v2-yarn", "v3-linear"])
def test_cache_holds_the_latent_and_the_rotary_key(latent_exports, name):
    """past_key_values.N.key [B, 1, T, qk_rope_head_dim], .value [B, 1, T, kv_lora_rank]: (rank + rope) x 4 bytes
    per token and layer in fp32, against heads x (nope + rope + v) x 4 for the per-head form."""
    out, _ = latent_exports(name)
    config = config_of(out)
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    inputs = cache_inputs(out / "model.onnx")
    assert len(inputs) == 2 * config["num_hidden_layers"]
    for i in range(config["num_hidden_layers"]):
        assert inputs[f"past_key_values.{i}.key"] == ["batch_size", 1, "past_sequence_length", rope]
        assert inputs[f"past_key_values.{i}.value"] == ["batch_size", 1, "past_sequence_length", rank]
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    elem = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    assert elem["past_key_values.0.key"] == elem["past_key_values.0.value"] == onnx.TensorProto.FLOAT
    bytes_per_token_layer = sum(int(np.prod(inputs[f"past_key_values.0.{k}"][3:])) for k in ("key", "value")) * 4
    assert bytes_per_token_layer == (rank + rope) * 4
    # what the architecture reports for every consumer of the interface (runners, eval, compile)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(json.loads((out / "export.json").read_text())["source"]["path"])
    assert architecture_for(hf.model_type).cache_dims(hf) == (1, rope, rank)  # the default, latent
    assert with_mla_cache(architecture_for(hf.model_type), "latent").cache_dims(hf) == (1, rope, rank)
    assert with_mla_cache(architecture_for(hf.model_type), "per-head").cache_dims(hf) == (
        hf.num_attention_heads, hf.qk_nope_head_dim + rope, hf.v_head_dim)
    # what a prefill of 7 tokens on a batch of 2 returns as the cache, on both backends
    for backend in ("onnxruntime", "openvino"):
        present = prefill(out / "model.onnx", backend, config)
        assert sum(a.nbytes for k, a in present.items() if k.startswith("present.0.")) == 2 * 7 * (rank + rope) * 4


def test_the_latent_form_is_the_default_and_per_head_is_chosen_by_the_option(checkpoints, tmp_path):
    """No option: the latent cache (report, graph metadata, cache inputs); mla_cache="per-head": transformers'
    per-head keys and values, kv_b_proj as one weight."""
    # v3-linear's ([heads, width] of the key, of the value): rope 4 and rank 24; 8 heads of nope 12 + rope 4, v 6
    shapes = {"latent": ([1, 4], [1, 24]), "per-head": ([8, 12 + 4], [8, 6])}
    for layout, option in (("latent", None), ("per-head", "per-head")):
        out = tmp_path / layout
        report = export(str(checkpoints["v3-linear"]), out, parity=(), mla_cache=option)
        assert report["graph"]["kv_cache"] == layout
        (key_heads, key_dim), (value_heads, value_dim) = shapes[layout]
        assert report["graph"]["cache_bytes_per_token"] == {"attention": 4 * (key_heads * key_dim +
                                                                              value_heads * value_dim)}
        model = onnx.load(out / "model.onnx", load_external_data=False)
        assert {p.key: p.value for p in model.metadata_props}["dstc.kv_cache"] == layout
        (key_heads, key_dim), (value_heads, value_dim) = shapes[layout]
        inputs = cache_inputs(out / "model.onnx")
        assert inputs["past_key_values.0.key"] == ["batch_size", key_heads, "past_sequence_length", key_dim]
        assert inputs["past_key_values.0.value"] == ["batch_size", value_heads, "past_sequence_length", value_dim]
        names = {t.name for t in model.graph.initializer}
        assert any(n.endswith("kv_b_proj/weight") for n in names) == (layout == "per-head")
        assert any(n.endswith("kv_b_proj/k_absorbed") for n in names) == (layout == "latent")


@pytest.mark.parametrize("name", sorted(["deepseek-v3-tiny", "deepseek-v2-lite-tiny"]))
def test_embedded_models_with_the_latent_cache_match_pytorch(tmp_path, name):
    report = export(name, tmp_path / "out", mla_cache="latent")
    check_report(report)
    assert report["source"]["kind"] == "embedded" and report["graph"]["kv_cache"] == "latent"


@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_passes_stage_keeps_the_latent_graph_exact(latent_exports, tmp_path, target):
    """The targets' pipelines expect no attention fusion on the latent form and keep parity."""
    out, _ = latent_exports("deepseek_v3")
    report = optimize(out, tmp_path / "opt", target, new_tokens=8)
    assert "fuse-mla-attention" not in report["counts"] and "fuse-group-query-attention" not in report["counts"]
    parity = report["parity"][target]
    assert parity["passed"] and parity["tokens_identical"]
    assert cache_inputs(tmp_path / "opt" / "model.onnx") == cache_inputs(out / "model.onnx")


def test_layer_by_layer_parity_on_the_latent_cache(checkpoints, tmp_path, monkeypatch):
    """Above the end-to-end budget each layer is checked against its transformers module, on the latent cache
    (the reference's per-head cache is not what the graph takes)."""
    import toolchain.verify.parity as parity

    monkeypatch.setattr(parity, "FULL_PARITY_BYTES", 1 << 10)
    report = export(str(checkpoints["v3-linear"]), tmp_path / "out", new_tokens=4, mla_cache="latent")
    assert report["parity_mode"] == "layer by layer"
    assert sorted(report["parity"]) == ["onnxruntime", "openvino"]
    for result in report["parity"].values():
        assert result["passed"], result
        assert "layers.2" in result["pieces"] and result["pieces"]["layers.2"] < 1e-4


# --- compression --------------------------------------------------------------------------------------------------

ABSORBED = ("k_absorbed", "v_absorbed")


def absorbed_rows(summary: dict) -> list[dict]:
    return [r for r in summary["per_weight"] if r["weight"].split("/")[-1] in ABSORBED]


@pytest.mark.parametrize("streaming", ["never", "always"])
@pytest.mark.parametrize("scheme", ["int4-grouped", "int8-per-head"])
@pytest.mark.parametrize("target", ["onnxruntime", "openvino"])
def test_compression_of_a_latent_export_reports_the_absorbed_weights_per_head(latent_exports, tmp_path, target,
                                                                            scheme, streaming):
    """W_uk [H, nope, rank] and W_uv [H, rank, v] are not INT4 (a 3-D weight has no INT4 kernel: INT8 with a scale
    per head and output channel, "demoted_3d" under int4), reported as a whole and head by head; whole-model
    compression keeps the next token of fp32 mostly."""
    out, _ = latent_exports("deepseek_v3")
    config = config_of(out)
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    summary = compress(out, tmp_path / "c", CompressSection(scheme=scheme, streaming=streaming), target=target)
    rows = absorbed_rows(summary)
    assert len(rows) == 2 * layers
    for row in rows:
        assert len(row["shape"]) == 3 and row["shape"][0] == heads
        assert row["precision"].startswith("int8")
        assert 0 < row["weight_error"] < 0.02
        assert row["head_side"] == "stacked" and [h["head"] for h in row["heads"]] == list(range(heads))
        assert all(0 < h["weight_error"] < 0.02 for h in row["heads"])
        # the whole weight's error is the heads' combined
        assert min(h["weight_error"] for h in row["heads"]) <= row["weight_error"] <= \
            max(h["weight_error"] for h in row["heads"])
        if streaming == "never":
            assert row["output_error"] is not None and all(h["output_error"] is not None for h in row["heads"])
    demoted = sorted(summary["details"]["demoted_3d"])
    assert demoted == (sorted(r["weight"] for r in rows) if scheme == "int4-grouped" else [])
    if streaming == "never":
        assert summary["model"]["top1_agreement"] > 0.8
    # the compressed graph still runs with the latent cache
    graph_file = tmp_path / "c" / ("openvino_model.xml" if (tmp_path / "c" / "openvino_model.xml").is_file()
                                   else "model.onnx")
    check_compressed_runs(graph_file, target, config)


@pytest.mark.parametrize("scheme", ["int4-grouped", "int8-per-head"])
def test_streamed_compression_of_a_latent_export_with_external_weights(checkpoints, tmp_path, monkeypatch, scheme):
    """An export above the external-data size (every real one) is memory-mapped: each absorbed weight is read a
    head at a time and its pages released after (a view of the map still held made the release fail)."""
    import toolchain.export.graph as graph

    monkeypatch.setattr(graph, "EXTERNAL_DATA_BYTES", 1 << 10)
    export(str(checkpoints["v2-yarn"]), tmp_path / "export", parity=(), mla_cache="latent")
    assert (tmp_path / "export" / "model.onnx.data").is_file()
    summary = compress(tmp_path / "export", tmp_path / "c",
                       CompressSection(scheme=scheme, streaming="always"), target="onnxruntime")
    rows = absorbed_rows(summary)
    assert len(rows) == 2 * 3 and all(len(r["heads"]) == 2 and r["weight_error"] < 0.02 for r in rows)
    check_compressed_runs(tmp_path / "c" / "model.onnx", "onnxruntime", config_of(tmp_path / "export"))


def prefill(graph_file, backend: str, config: dict) -> dict[str, np.ndarray]:
    """The outputs of a prefill of 7 tokens on a batch of 2, from an empty latent cache."""
    from toolchain.runtime.engines import GraphRunner

    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 7))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(7), (2, 1))}
    for i in range(config["num_hidden_layers"]):
        feeds[f"past_key_values.{i}.key"] = np.zeros((2, 1, 0, config["qk_rope_head_dim"]), np.float32)
        feeds[f"past_key_values.{i}.value"] = np.zeros((2, 1, 0, config["kv_lora_rank"]), np.float32)
    return GraphRunner(graph_file, backend)(feeds)


def check_compressed_runs(graph_file, backend: str, config: dict) -> None:
    got = prefill(graph_file, backend, config)
    assert got["logits"].shape == (2, 7, config["vocab_size"]) and np.isfinite(got["logits"]).all()
    assert got["present.0.value"].shape == (2, 1, 7, config["kv_lora_rank"])


# --- compile, build, serve ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_compiled_latent_artifact_decodes_like_pytorch(latent_exports, tmp_path, backend):
    """The compile stage's verification (prefill + greedy steps of the three cases against PyTorch fp32) on the
    stateful OpenVINO IR, whose state variables are the latent and the rotary key, and on the ORT artifact."""
    out, _ = latent_exports("v2-yarn")
    config = config_of(out)
    manifest = compile_artifact(out, tmp_path / "art", backend)
    verification = manifest["verification"]
    assert verification["passed"], verification
    assert {c["name"] for c in verification["cases"]} == {"short", "long", "batch2-left-padded"}
    assert all(c["tokens_identical"] for c in verification["cases"])
    if backend == "openvino":
        import openvino as ov

        model = ov.Core().read_model(tmp_path / "art" / "openvino_model.xml")
        assert [i.get_any_name() for i in model.inputs] == ["input_ids", "attention_mask", "position_ids", "beam_idx"]
        shapes = sorted(str(op.get_output_partial_shape(0)) for op in model.get_ops()
                        if op.get_type_name() == "ReadValue")
        layers = config["num_hidden_layers"]
        assert len(shapes) == 2 * layers
        assert shapes == sorted([f"[?,1,?,{config['qk_rope_head_dim']}]"] * layers +
                                [f"[?,1,?,{config['kv_lora_rank']}]"] * layers)
    else:
        assert cache_inputs(tmp_path / "art" / "model.onnx") == cache_inputs(out / "model.onnx")


def write_recipe(path, **fields):
    recipe = {"name": "mla", "model": "deepseek-v3-tiny", "export": {"parity": [], "mla_cache": "latent"},
              "compile": {"backend": "openvino", "verify": True}, **fields}
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_dstc_build_of_a_latent_recipe_verifies(tmp_path, monkeypatch, backend):
    """A recipe's export.mla_cache: latent through passes, INT4 and compile; the build verifies its artifact
    (stateful OpenVINO included) and the manifest records the export's cache layout."""
    from toolchain.build import build

    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path / "r.yaml", passes={"target": backend},
                          compress={"scheme": "int4-grouped"}, compile={"backend": backend, "verify": True})
    manifest = build(recipe, tmp_path / "art")
    reports = manifest["provenance"]["stage_reports"]
    assert reports["export/export.json"]["graph"]["kv_cache"] == "latent"
    assert reports["compile/compile.json"]["verification"]["passed"]


def test_dstc_build_of_a_latent_recipe_without_compression_verifies(tmp_path, monkeypatch):
    from toolchain.build import build
    from toolchain.recipe import load_recipe

    assert load_recipe(write_recipe(tmp_path / "r.yaml")).export.mla_cache == "latent"
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    manifest = build(write_recipe(tmp_path / "r.yaml"), tmp_path / "art")
    reports = manifest["provenance"]["stage_reports"]
    assert reports["export/export.json"]["graph"]["kv_cache"] == "latent"
    assert reports["compile/compile.json"]["verification"]["passed"]
    # a per-head build of the same model is another export stage
    manifest2 = build(write_recipe(tmp_path / "p.yaml", export={"parity": [], "mla_cache": "per-head"}),
                      tmp_path / "art2")
    assert manifest2["provenance"]["cached_stages"] == []


def test_openvino_continuous_batching_refuses_a_latent_artifact(latent_exports, tmp_path):
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.batching import PipelineSettings, openvino_pipeline

    out, _ = latent_exports("deepseek_v3")
    compile_artifact(out, tmp_path / "art", "openvino", verify=False)
    with pytest.raises(InputError) as error:
        openvino_pipeline(open_artifact(tmp_path / "art"), PipelineSettings(max_batch=2, max_context=64))
    message = str(error.value)
    assert "\n" not in message and "ScaledDotProductAttention" in message and "--mla-cache per-head" in message


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_mla_cache_on_a_model_without_mla_is_an_input_error(tiny_checkpoints, tmp_path, monkeypatch, capsys, name):
    code, out, err = run_cli(monkeypatch, capsys, "export", tiny_checkpoints[name], "-o", tmp_path / "out",
                             "--mla-cache", "latent")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dstc: error:") and "--mla-cache" in lines[0]
    assert not (tmp_path / "out").exists()


def test_dstc_export_mla_cache_option(checkpoints, tmp_path, monkeypatch, capsys):
    import typing

    from toolchain.cli import cli
    from toolchain.export.deepseek import MLA_CACHES
    from toolchain.recipe import ExportSection

    option = next(p for p in cli.commands["export"].params if p.name == "mla_cache")
    assert tuple(option.type.choices) == MLA_CACHES
    literal, none = typing.get_args(ExportSection.model_fields["mla_cache"].annotation)  # Literal[...] | None
    assert typing.get_args(literal) == MLA_CACHES and none is type(None)
    code, out, err = run_cli(monkeypatch, capsys, "export", checkpoints["deepseek_v2"], "-o", tmp_path / "a",
                             "--mla-cache", "latent", "--new-tokens", "2", "--parity", "onnxruntime", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["graph"]["kv_cache"] == "latent" and report["parity"]["onnxruntime"]["passed"]
    with pytest.raises(InputError, match="unknown MLA cache layout"):
        with_mla_cache(architecture_for("deepseek_v3"), "compressed")


# --- the loaders and the eval on a latent artifact ------------------------------------------------------------------

EVAL_SMALL = ["--texts", "20", "--problems", "20", "--prompt-lengths", "16", "--batches", "1,2", "--new-tokens", "4",
              "--warmup", "0", "--repetitions", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_latent_artifact_of_an_embedded_model_generates_and_evaluates(tmp_path, backend):
    """The embedded DeepSeek-V3 (with its tokenizer) on the latent cache: openvino_genai's LLMPipeline and
    optimum-intel (stateful IR) give PyTorch's greedy tokens; dstc eval runs on either backend, with the fp32
    model's accuracy and routing agreement."""
    import os
    import subprocess

    from loader_helpers import F32, llm_pipeline, optimum_intel_greedy, pipeline_greedy, reference_chat_tokens

    from toolchain.models.registry import embedded_path
    from toolchain.report.schema import load_report

    name = "deepseek-v3-tiny"
    export(name, tmp_path / "export", parity=(), mla_cache="latent")
    art = tmp_path / "art"
    manifest = compile_artifact(tmp_path / "export", art, backend, new_tokens=16)
    assert manifest["verification"]["passed"]
    if backend == "openvino":
        prompt, expected = reference_chat_tokens(embedded_path(name), 16)
        pipe, config = llm_pipeline(art, 16, **F32)
        assert pipeline_greedy(pipe, config, prompt) == expected
    proc = subprocess.run([sys.executable, "-m", "toolchain", "eval", str(art), "--reference", name, *EVAL_SMALL,
                           *(["--openvino-f32"] if backend == "openvino" else [])], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "DSTC_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    report = load_report(art / "report.json")
    assert report.value("top1_agreement") > 0.99 and report.value("greedy_match_rate") == 1.0
    assert report.value("routing_agreement") > 0.99
    if backend == "openvino":  # last: it skips where optimum-intel is missing
        assert optimum_intel_greedy(art, prompt, 16) == expected
