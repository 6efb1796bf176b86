"""dstc build: recipe validation, byte-reproducible artifacts, the stage cache, atomicity, dstc verify."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from toolchain.build import build
from toolchain.hashing import blake3_file, self_digest
from toolchain.errors import RecipeError
from toolchain.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def write_recipe(path: Path, **fields) -> Path:
    recipe = {"name": "test", "model": "deepseek-v3-tiny", "export": {"parity": []},
              "compile": {"backend": "openvino", "verify": False}, **fields}
    path.write_text(yaml.safe_dump(recipe))
    return path


def dstc(*args, env: dict, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "toolchain", *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "DSTC_CACHE_DIR": str(tmp_path / "cache")}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_validate(recipe):
    assert load_recipe(recipe).name == recipe.stem


def test_recipe_typo_names_the_key_and_file(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", compile={"backend": "openvino", "verfy": False})
    with pytest.raises(RecipeError, match=r"r\.yaml: compile\.verfy: unknown key"):
        load_recipe(path)
    path = write_recipe(tmp_path / "r.yaml", compile={"backend": "tensorrt"})
    with pytest.raises(RecipeError, match=r"compile\.backend"):
        load_recipe(path)


@pytest.mark.parametrize(("section", "key", "meant"), [
    ("compress", "grup_size", "group_size"),
    ("gates", "max_ppl_increase", "max_perplexity_increase"),  # dstc gate's former option name
    ("gates", "min_top1", "min_top1_agreement"),
    ("export", "new_token", "new_tokens")])
def test_an_unknown_key_is_named_first_with_the_key_meant(tmp_path, section, key, meant):
    values = {"scheme": "int4-grouped"} if section == "compress" else {}
    # the section's only other problem is a missing compile: the misspelt key is reported before it
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "model": "deepseek-v3-tiny", section: {**values, key: 1}}))
    with pytest.raises(RecipeError, match=rf"r\.yaml: {section}\.{key}: unknown key \(did you mean {meant}\?\) "
                                          r"\(and 1 more\)"):
        load_recipe(path)
    path = write_recipe(tmp_path / "r.yaml", compile={"backend": "openvino", "nothing_like_it": 1})
    with pytest.raises(RecipeError, match=r"compile\.nothing_like_it: unknown key$"):
        load_recipe(path)


def test_recipe_error_exits_2_and_writes_nothing(tmp_path, env):
    path = write_recipe(tmp_path / "r.yaml", exprot={})
    proc = dstc("build", path, "-o", tmp_path / "out", env=env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "exprot: unknown key" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_calibration_file_is_read_beside_the_recipe_and_a_missing_one_stops_before_any_stage(tmp_path, env):
    from toolchain.build import _calibration_beside_recipe

    recipes = tmp_path / "recipes"
    (recipes / "data").mkdir(parents=True)
    (recipes / "data" / "calibration.txt").write_text("The old man walked to the market.\n")
    compress = {"scheme": "int4-grouped", "awq": True, "dataset": "data/calibration.txt"}
    path = write_recipe(recipes / "r.yaml", compress=compress)
    resolved = _calibration_beside_recipe(load_recipe(path), path)
    assert resolved.compress.dataset == str((recipes / "data" / "calibration.txt").resolve())  # not from the CWD

    missing = write_recipe(recipes / "m.yaml", compress={**compress, "dataset": "data/absent.txt"})
    proc = dstc("build", missing, "-o", tmp_path / "out", env=env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "compress.dataset data/absent.txt does not exist" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
def test_two_fresh_builds_are_byte_identical(tiny_checkpoints, tmp_path, env, backend):
    recipe = write_recipe(tmp_path / "r.yaml", compile={"backend": backend, "verify": False})
    manifests = []
    for out in ("a", "b"):
        proc = dstc("build", recipe, "-o", tmp_path / out, "--model", tiny_checkpoints["deepseek_v3"], "--no-cache",
                    env=env)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        manifests.append(json.loads((tmp_path / out / "manifest.json").read_text()))
    a, b = manifests
    assert a["files"] == b["files"] and len(a["files"]) >= 3
    assert [s["id"] for s in a["stages"]] == [s["id"] for s in b["stages"]]
    assert a["provenance"]["output"] != b["provenance"]["output"]


def test_rebuild_reuses_cached_stages_and_verify_catches_a_flipped_byte(tiny_checkpoints, tmp_path, env,
                                                                       monkeypatch):
    monkeypatch.setenv("DSTC_CACHE_DIR", env["DSTC_CACHE_DIR"])
    recipe = write_recipe(tmp_path / "r.yaml")
    first = build(recipe, tmp_path / "art", model=str(tiny_checkpoints["llama"]))
    assert first["provenance"]["cached_stages"] == []
    second = build(recipe, tmp_path / "art", model=str(tiny_checkpoints["llama"]))
    assert second["provenance"]["cached_stages"] == ["export", "compile"]
    assert second["files"] == first["files"]

    proc = dstc("verify", tmp_path / "art", env=env)
    assert proc.wait(timeout=120) == 0
    weights = tmp_path / "art" / "openvino_model.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    (tmp_path / "art" / "notes.txt").write_text("extra")
    proc = dstc("verify", tmp_path / "art", env=env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "changed: openvino_model.bin" in out and "extra: notes.txt" in out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_build_leaves_the_previous_artifact(tiny_checkpoints, tmp_path, env, monkeypatch, sig):
    monkeypatch.setenv("DSTC_CACHE_DIR", env["DSTC_CACHE_DIR"])
    recipe = write_recipe(tmp_path / "r.yaml", export={"parity": ["onnxruntime"]})
    model = str(tiny_checkpoints["deepseek_v2"])
    build(recipe, tmp_path / "art", model=model)
    before = (tmp_path / "art" / "manifest.json").read_text()

    proc = dstc("build", recipe, "-o", tmp_path / "art", "--model", model, "--no-cache", env=env)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".art.tmp-*")) or not list((tmp_path / "cache").rglob(".export-*.tmp-*")):
        assert time.time() < deadline and proc.poll() is None, "the build never reached its export stage"
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert (tmp_path / "art" / "manifest.json").read_text() == before
    proc = dstc("verify", tmp_path / "art", env=env)
    assert proc.wait(timeout=120) == 0
    if sig == signal.SIGINT:  # cleaned up on the way out
        assert not list(tmp_path.glob(".art.*"))
    build(recipe, tmp_path / "art", model=model)  # a later build removes a killed build's leftovers
    assert not list(tmp_path.glob(".art.*"))


def test_interrupted_first_build_leaves_no_artifact(tiny_checkpoints, tmp_path, env):
    recipe = write_recipe(tmp_path / "r.yaml", export={"parity": ["onnxruntime"]})
    proc = dstc("build", recipe, "-o", tmp_path / "art", "--model", tiny_checkpoints["qwen2"], env=env)
    deadline = time.time() + 120
    while not list((tmp_path / "cache").rglob(".export-*.tmp-*")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    assert not (tmp_path / "art").exists()


def test_real_checkpoint_recipe_without_the_checkpoint_stops_clearly(tmp_path, env):
    env = {**env, "HF_HOME": str(tmp_path / "empty-hf-home")}
    proc = dstc("build", REPO / "recipes" / "deepseek-r1-distill-qwen-1.5b-openvino-int4.yaml", "-o", tmp_path / "out",
                env=env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "not in the local Hugging Face cache" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_real_checkpoint_recipes_pin_a_commit_and_only_that_snapshot_is_used(tmp_path, monkeypatch):
    import re

    from toolchain import source as sources
    from toolchain.errors import InputError
    from toolchain.recipe import load_recipe

    real = [load_recipe(p) for p in sorted((REPO / "recipes").glob("*.yaml")) if "tiny" not in p.name]
    assert len(real) == 5 and all(re.fullmatch(r"[0-9a-f]{40}", r.revision or "") for r in real)

    recipe = next(r for r in real if r.model.endswith("Qwen-1.5B"))
    repo = tmp_path / "hub" / ("models--" + recipe.model.replace("/", "--"))
    other = "0" * 40
    (repo / "snapshots" / other).mkdir(parents=True)
    (repo / "snapshots" / other / "config.json").write_text('{"model_type": "qwen2"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(other)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(InputError, match=f"at revision {recipe.revision}"):
        sources.resolve(recipe.model, recipe.revision)
    assert sources.resolve(recipe.model).path.name == other  # unpinned takes what the cache has

    (repo / "snapshots" / recipe.revision).mkdir()
    (repo / "snapshots" / recipe.revision / "config.json").write_text('{"model_type": "qwen2"}')
    assert sources.resolve(recipe.model, recipe.revision).path.name == recipe.revision


def test_a_cached_stage_from_a_checkout_that_is_gone_is_still_usable(tmp_path, monkeypatch):
    """Stage ids hash the checkpoint's files, not its path: another clone's cached export is reused, and the
    later stages read the checkpoint this build resolved rather than the path that export recorded."""
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    build(write_recipe(tmp_path / "a.yaml", model="r1-distill-llama-tiny"), tmp_path / "a")
    (report_file,) = (tmp_path / "cache").rglob("export-*/export.json")
    report = json.loads(report_file.read_text())
    report["source"]["path"] = str(tmp_path / "old-clone" / "r1-distill-llama-tiny")
    report_file.write_text(json.dumps(report))
    record = json.loads((report_file.parent / "stage.json").read_text())  # as that clone recorded it
    record["files"]["export.json"] = blake3_file(report_file)
    record["digest"] = self_digest(record)
    (report_file.parent / "stage.json").write_text(json.dumps(record))
    recipe = write_recipe(tmp_path / "b.yaml", model="r1-distill-llama-tiny",
                          compile={"backend": "onnxruntime", "verify": True})
    manifest = build(recipe, tmp_path / "b")
    assert manifest["provenance"]["cached_stages"] == ["export"]
    assert manifest["provenance"]["stage_reports"]["compile/compile.json"]["verification"]["passed"]


def test_a_stage_id_hashes_the_code_the_stage_imports_and_nothing_else():
    from toolchain.manifest import module_closure

    root = Path(__file__).resolve().parent.parent
    closure = {p.relative_to(root).as_posix() for p in module_closure("toolchain.stages.export")}
    assert {"toolchain/stages/export.py", "toolchain/export/blocks.py", "toolchain/export/deepseek_v3.py",
            "toolchain/source.py"} <= closure
    assert not {"toolchain/report/plots.py", "toolchain/cli.py", "toolchain/evaluate/run.py"} & closure
    optimize = {p.relative_to(root).as_posix() for p in module_closure("toolchain.stages.optimize")}
    assert "passes/fusions/mla_attention.py" in optimize  # imported inside a function, through the registry


# the fused lowerings in the default suite, the dispatch ones (the same MoE code as every other family's) slow
@pytest.mark.parametrize("backend,lowering", [pytest.param("onnxruntime", "dispatch", marks=pytest.mark.slow),
                                              ("onnxruntime", "fused-onnxruntime"),
                                              pytest.param("openvino", "dispatch", marks=pytest.mark.slow),
                                              ("openvino", "fused-openvino")])
def test_qwen3_moe_builds_int4_on_both_backends(tiny_checkpoints, tmp_path, env, backend, lowering):
    """An architecture added with the MoE component alone (toolchain/export/qwen3_moe.py) goes through every stage:
    export with parity, the passes, INT4 (the fused experts too), compile verified against the compressed graph;
    the artifact keeps the lowering in its metadata, and its router outputs are found by it."""
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.routing import router_outputs

    recipe = write_recipe(tmp_path / "r.yaml", export={"moe": lowering}, passes={"target": backend},
                          compress={"scheme": "int4-grouped", "group_size": 32},
                          compile={"backend": backend, "verify": True})
    proc = dstc("build", recipe, "-o", tmp_path / "art", "--model", tiny_checkpoints["qwen3_moe"], "--no-cache",
                env=env)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    art = tmp_path / "art"
    manifest = json.loads((art / "manifest.json").read_text())
    assert [s["name"] for s in manifest["stages"]] == ["export", "passes", "compress", "compile"]
    stages = Path(env["DSTC_CACHE_DIR"]) / "stages"
    (export_dir,), (compress_dir,), (compile_dir,) = (list(stages.glob(f"{n}-*")) for n in ("export", "compress",
                                                                                              "compile"))
    parity = json.loads((export_dir / "export.json").read_text())["parity"]
    assert sorted(parity) == (["onnxruntime"] if lowering == "fused-onnxruntime" else ["onnxruntime", "openvino"])
    assert all(r["passed"] and r["tokens_identical"] for r in parity.values())
    summary = json.loads((compress_dir / "compression.json").read_text())
    experts = [r for r in summary["per_weight"] if r["role"] == "routed_expert"]
    assert len(experts) == 2 * 8 * 3 and {r["precision"] for r in experts} == {"int4-asym-g32"}
    assert [r["layer"] for r in summary["routing"]] == [0, 2]  # mlp_only_layers keeps layer 1 dense
    assert all(0.5 < r["agreement"] <= 1.0 for r in summary["routing"])
    if lowering == "fused-onnxruntime":
        assert summary["details"]["onnxruntime_kernels"].get("QMoE") == 2
    assert json.loads((compile_dir / "compile.json").read_text())["verification"]["passed"]
    artifact = open_artifact(art)  # the compiled graph keeps the record, where routing and serving read it
    assert artifact.moe_lowering == lowering and sorted(router_outputs(artifact)) == [0, 2]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_deepseek_v4_builds_int4_through_every_stage(tmp_path, env, backend):
    """A random DeepSeek-V4 (sliding, CSA, HCA layers; hash and top-k MoE) read from its checkpoint through export
    with parity, the passes with their parity, INT4, compile verified against the compressed graph, eval against
    the fp32 reference (the whole model: the layer-by-layer one runs the shared decoder's layers only) and
    `dstc generate`. The embedded tokenizer, with the vocabulary widened to it, gives eval its text."""
    import shutil

    from conftest import make_checkpoint, tiny_configs
    from toolchain.models.registry import embedded_path

    config = tiny_configs()["deepseek_v4"]
    config.vocab_size = 640
    checkpoint = make_checkpoint(config, tmp_path / "v4")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(embedded_path("deepseek-v3-tiny") / name, checkpoint / name)
    recipe = write_recipe(tmp_path / "r.yaml", model=str(checkpoint), export={}, passes={"target": backend},
                          compress={"scheme": "int4-grouped", "group_size": 32},
                          compile={"backend": backend, "verify": True},
                          eval={"texts": 24, "problems": 8, "greedy_prompts": 4, "latency": False})
    proc = dstc("build", recipe, "-o", tmp_path / "art", "--no-cache", env=env)
    _, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err
    art = tmp_path / "art"
    stages = Path(env["DSTC_CACHE_DIR"]) / "stages"
    reports = {name: json.loads(next(stages.glob(f"{name}-*/{name if name != 'compress' else 'compression'}.json"))
                                .read_text()) for name in ("export", "passes", "compress", "compile")}
    assert all(r["passed"] and r["tokens_identical"] for r in reports["export"]["parity"].values())
    assert reports["passes"]["parity"][backend]["passed"] and reports["passes"]["parity"][backend]["tokens_identical"]
    routing = {r["layer"]: r["agreement"] for r in reports["compress"]["routing"]}
    assert sorted(routing) == [0, 1, 2, 3] and routing[0] == routing[2] == 1.0  # hash layers route by token id
    assert reports["compile"]["verification"]["passed"]
    report = json.loads((art / "report.json").read_text())
    assert 0.0 <= report["metrics"]["kl_mean"]["value"] < 0.01
    assert report["metrics"]["routing_agreement"]["value"] > 0.5
    out = subprocess.run([sys.executable, "-m", "toolchain", "generate", str(art), "the", "--raw"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
