"""The KV cache stored in float16 (``export.cache_dtype``, toolchain/export/cache_precision.py): parity with PyTorch
on both backends within the float16 cache's bound, the graph's cache types, metadata and bytes, the compiled
artifacts (ONNX Runtime, the stateful OpenVINO IR) and the batched serving paths over them, and what is refused."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import yaml
from batching_helpers import decode_joining_and_leaving
from conftest import run_cli

from toolchain.interface.graph import CACHE_DTYPE
from toolchain.stages.alone import compile_artifact, export
from toolchain.verify.parity import CACHE_TOLERANCES, TOLERANCES

# deepseek_v3's latent cache in the default suite; V3.2's indexer keys and V4's per-token state take 1.5-3 min each
MODELS = ("deepseek_v3", pytest.param("deepseek_v32", marks=pytest.mark.slow),
          pytest.param("deepseek_v4", marks=pytest.mark.slow))


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    """exports(model, dtype): the checkpoint exported with its cache in ``dtype``, parity checked on both backends
    (cached)."""
    root = tmp_path_factory.mktemp("cache-dtype")
    done = {}

    def get(name: str, dtype: str):
        if (name, dtype) not in done:
            out = root / f"{name}-{dtype}"
            done[name, dtype] = out, export(str(tiny_checkpoints[name]), out, cache_dtype=dtype, new_tokens=8)
        return done[name, dtype]

    return get


def cache_types(path) -> dict[str, int]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]
            if v.name.startswith(("past_key_values.", "present."))}


@pytest.mark.parametrize("name", MODELS)
def test_float16_cache_matches_pytorch_within_its_bound_and_halves_the_bytes(exports, name):
    """Every cache tensor (MLA's latent and rotary key, V3.2's indexer keys, V4's per-token state) is float16 at the
    graph's interface; the logits stay within 2e-3 of their range of PyTorch's with the greedy tokens identical, on
    both backends; export.json's bytes per token are half float32's (2 bytes for each cached element)."""
    from transformers import AutoConfig

    from toolchain.interface.graph import cache_bytes_per_token, onnx_inputs

    out, report = exports(name, "float16")
    for backend, result in report["parity"].items():
        assert result["passed"] and result["tokens_identical"], (backend, result)
        assert result["tolerance_relative_to_logits_range"] == CACHE_TOLERANCES["float16"] > TOLERANCES[backend]
        assert result["max_relative_diff"] <= CACHE_TOLERANCES["float16"]
    assert set(report["parity"]) == {"onnxruntime", "openvino"}
    types = cache_types(out / "model.onnx")
    assert types and set(types.values()) == {onnx.TensorProto.FLOAT16}
    assert report["graph"]["cache_dtype"] == "float16"
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    layer_types = getattr(AutoConfig.from_pretrained(report["source"]["path"]), "layer_types", None)
    wide = cache_bytes_per_token([(n, shape, 4) for n, shape in onnx_inputs(model.graph)], layer_types)
    assert report["graph"]["cache_bytes_per_token"] == {kind: size // 2 for kind, size in wide.items()}
    assert all(wide.values())
    metadata = {p.key: p.value for p in model.metadata_props}
    assert metadata[CACHE_DTYPE] == "float16"


def test_a_growing_cache_converts_only_its_new_positions(exports):
    """Where present is the past concatenated with the new positions, the stored tensor is Concat(past, Cast(new)):
    per cache tensor one Cast widens the past, one narrows the new positions, and no Cast reads a whole present."""
    out, _ = exports("deepseek_v3", "float16")
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    caches = [v.name for v in graph.input if v.name.startswith("past_key_values.")]
    producers = {o: n for n in graph.node for o in n.output}
    for past in caches:
        present = producers["present." + past[len("past_key_values."):]]
        assert present.op_type == "Concat" and present.input[0] == past
        assert producers[present.input[1]].op_type == "Cast"
    casts = [n for n in graph.node if n.op_type == "Cast" and n.name.split("/")[-1] in ("widen", "narrow_new")]
    assert len(casts) == 2 * len(caches)


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_compiled_float16_cache_artifacts_decode_like_pytorch_and_batch(exports, tmp_path, backend):
    """The compile stage's verification passes; the runtime keeps the cache in float16 (ORT's OrtValues, the stateful
    IR's variables) through decode and a rollback; sequences joining and leaving a batch (serve's layouts) get
    their batch-1 greedy tokens."""
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.batching import batched_decoder
    from toolchain.runtime.batching_openvino import StatefulBatch
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.generate import greedy_generate

    out, _ = exports("deepseek_v3", "float16")
    manifest = compile_artifact(out, tmp_path / "art", backend)
    assert manifest["verification"]["passed"], manifest["verification"]
    art = open_artifact(tmp_path / "art")
    decoder = open_decoder(art, threads=2, openvino_f32=True)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, art.config["vocab_size"], n).tolist() for n in (13, 5, 21, 8)]
    alone = [greedy_generate(decoder, [p], 8, set(), 0).tokens[0] for p in prompts]
    decoder.reset()
    whole = decoder.forward(np.array([prompts[0]]), np.ones((1, 13), np.int64))[0, -1]
    if backend == "openvino":
        import openvino as ov

        model = ov.Core().read_model(tmp_path / "art" / "openvino_model.xml")
        assert {op.get_output_element_type(0) for op in model.get_ops() if op.get_type_name() == "ReadValue"} \
            == {ov.Type.f16}
        states = [np.asarray(s.state.data) for s in decoder.request.query_state()]
    else:
        states = [value.numpy() for value in decoder.cache.values()]
    assert states and {s.dtype for s in states} == {np.dtype(np.float16)} and {s.shape[2] for s in states} == {13}
    decoder.rollback(7)  # the float16 state read, cut and set back: the same 7 positions go on
    again = decoder.forward(np.array([prompts[0][7:]]), np.ones((1, 13), np.int64))[0, -1]
    assert np.abs(again - whole).max() <= 1e-4 * np.ptp(whole)
    layouts = ["stateful"] if backend == "openvino" else ["batch", "gather"]
    for layout in layouts:
        decoder.reset()
        batch = StatefulBatch(decoder, 0) if layout == "stateful" else batched_decoder(decoder, 0, layout)
        assert decode_joining_and_leaving(batch, prompts, 8) == alone, layout


def test_cache_dtype_option_refuses_other_types_in_one_line(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "export", tiny_checkpoints["deepseek_v3"], "-o", tmp_path / "out",
                             "--cache-dtype", "int8")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--cache-dtype" in lines[0] and "int8" in lines[0]
    assert not (tmp_path / "out").exists()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": "deepseek-v3-tiny", "export": {"cache_dtype": "bfloat16"},
                                      "compile": {"backend": "onnxruntime"}}))
    code, out, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "art")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "export.cache_dtype" in lines[0]
    assert not (tmp_path / "art").exists()


def test_a_narrow_per_head_cache_is_refused_in_one_line(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    """A per-head cache is read by the runtimes' fused attention in float32 (OpenVINO keeps it in its
    KV_CACHE_PRECISION): refused at export for a per-head architecture, and when a recipe loads for MLA's per-head
    layout."""
    code, out, err = run_cli(monkeypatch, capsys, "export", tiny_checkpoints["qwen2"], "-o", tmp_path / "out",
                             "--cache-dtype", "float16")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "per-head KV cache" in lines[0]
    assert not (tmp_path / "out").exists()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": "deepseek-v3-tiny",
                                      "export": {"cache_dtype": "float16", "mla_cache": "per-head"},
                                      "compile": {"backend": "onnxruntime"}}))
    code, out, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "art")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "per-head KV cache" in lines[0] and "cache_dtype" in lines[0]
    assert not (tmp_path / "art").exists()


def test_a_float32_cache_keeps_the_export_stage_id(tmp_path):
    """The default is the stage configuration exports had before the option (every cached stage stays valid); a
    float16 cache is a configuration of its own."""
    from toolchain.recipe import ExportSection
    from toolchain.stages.choices import plan_export
    from toolchain.stages.runner import export_stage

    default = export_stage(plan_export("deepseek-v3-tiny", ExportSection()))
    assert "cache_dtype" not in default.config
    narrow = export_stage(plan_export("deepseek-v3-tiny", ExportSection(cache_dtype="float16")))
    assert narrow.config["cache_dtype"] == "float16"
