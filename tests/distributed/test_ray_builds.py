"""dstc build RECIPE... [--ray]: several recipes checked before any is built, each artifact in DIR/<name>, built as
Ray tasks byte-identical to the same recipes built one after another on this machine, and a Ray worker that dies
mid-stage retried into the same bytes; a build's streamed compression split into parts over Ray workers
(--split), byte-identical to the local build, also when a part's worker dies half-way through writing it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import run_cli
from ray_test_hooks import ARM, PART_ARM

ray = pytest.importorskip("ray")  # a dependency of dstc: installed wherever dstc is

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# OpenVINO: its IRs held names counting every node the process had made (an artifact built second differed)
MODELS = ("r1-distill-qwen-tiny", "r1-distill-llama-tiny")
BACKEND = "openvino"


def write_recipe(path: Path, model: str, **fields) -> Path:
    # no parity, no verify, no smoke run: the stages' own checks are tested elsewhere; here, where and how they run
    recipe = {"name": path.stem, "model": model, "export": {"parity": []},
              "compile": {"backend": BACKEND, "verify": False, "smoke": False}, **fields}
    path.write_text(yaml.safe_dump(recipe))
    return path


def files(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["files"]


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("recipes")
    return [write_recipe(root / f"{model}.yaml", model) for model in MODELS]


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    """One local Ray of 2 CPUs for the module (starting one costs seconds); its workers load tests/ray_test_hooks.py
    and import this checkout's dstc. The armed files: ARM, and PART_ARM beside it."""
    arm = tmp_path_factory.mktemp("ray") / "arm"
    path = os.pathsep.join([str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", path)  # the workers' environment is the raylet's, started by ray.init from this one
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 runtime_env={"worker_process_setup_hook": "ray_test_hooks.install",
                              "env_vars": {ARM: str(arm), PART_ARM: str(arm.parent / "part-arm")}})
    yield arm
    ray.shutdown()


@pytest.fixture(scope="module")
def local_builds(recipes, tmp_path_factory) -> Path:
    """The recipes built one after another in this process, with their own stage cache: DIR/<recipe name>."""
    out = tmp_path_factory.mktemp("local")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(out / "cache"))
        code, _, err = run_cli(mp, _NoCapture(), "build", *recipes, "-o", out / "art")
    assert code == 0, err
    return out / "art"


class _NoCapture:
    """run_cli reads capsys; a module fixture has none, and the outputs are read from the artifacts."""

    def readouterr(self):
        return SimpleNamespace(out="", err="")


@pytest.mark.slow  # the default suite builds on Ray, into the local bytes, in the retry test below
def test_recipes_built_as_ray_tasks_are_byte_identical_to_local_builds(recipes, local_builds, ray_local, tmp_path,
                                                                       monkeypatch, capsys):
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))  # a fresh cache: every stage runs in a worker
    code, _, err = run_cli(monkeypatch, capsys, "build", *recipes, "-o", tmp_path / "art", "--ray")
    assert code == 0, err
    for recipe in recipes:
        built = files(tmp_path / "art" / recipe.stem)
        assert built == files(local_builds / recipe.stem) and len(built) >= 3
        assert f"{recipe.stem}: built {tmp_path / 'art' / recipe.stem}" in err
        assert not list((tmp_path / "art").glob(f".{recipe.stem}*"))  # no temporary directory left beside it
    entries = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "stages").iterdir() if p.is_dir())
    assert entries == ["compile", "compile", "export", "export"]  # both tasks wrote the one shared cache


def test_a_bad_recipe_among_good_ones_is_refused_before_anything_is_built(recipes, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "model": MODELS[0], "compile": {"backend": "onnxruntime"},
                                   "exprot": {}}))
    absent = write_recipe(tmp_path / "absent.yaml", "no-such-model")
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    # --ray takes no address here: the recipe after it is a recipe; and nothing starts a Ray before the check
    code, _, err = run_cli(monkeypatch, capsys, "build", recipes[0], "--ray", bad, recipes[1], absent,
                           "-o", tmp_path / "art")
    assert code == 2
    assert err.count("\n") == 1 and "2 of 4 recipes refused, nothing built" in err
    assert "bad.yaml: exprot: unknown key" in err and "no-such-model" in err
    assert not (tmp_path / "art").exists() and not (tmp_path / "cache" / "stages").exists()


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_a_ray_address_where_nothing_listens_is_one_line_and_nothing_is_built(recipes, tmp_path, monkeypatch, capsys,
                                                                              address):
    """Ray's driver would retry the address for minutes, silently: a CI job must not hang on a typo."""
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "build", *recipes, "--ray", address, "-o", tmp_path / "art")
    assert code == 2 and err.count("\n") == 1 and f"no Ray cluster at {address} (Connection refused)" in err
    assert not (tmp_path / "art").exists() and not (tmp_path / "cache" / "stages").exists()


def test_two_recipes_of_one_name_are_refused(recipes, tmp_path, monkeypatch, capsys):
    twin = write_recipe(tmp_path / "other.yaml", MODELS[1], name=recipes[0].stem)
    code, _, err = run_cli(monkeypatch, capsys, "build", recipes[0], twin, "-o", tmp_path / "art")
    assert code == 2 and f"several recipes are named {recipes[0].stem}" in err
    assert not (tmp_path / "art").exists()


def test_a_failed_recipe_reports_its_error_and_the_others_are_built(recipes, tmp_path, monkeypatch, capsys):
    # a checkpoint directory whose config.json is not JSON: found by the check, refused when its build reads it
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    failing = write_recipe(tmp_path / "failing.yaml", str(broken))
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "build", failing, recipes[0], "-o", tmp_path / "art")
    assert code == 2, err
    assert f"{recipes[0].stem}: built" in err and "failing: error (exit 2): " in err
    assert (tmp_path / "art" / recipes[0].stem / "manifest.json").is_file()
    assert not (tmp_path / "art" / "failing").exists()


def test_an_output_that_cannot_be_written_is_refused_before_anything_is_built(recipes, tmp_path, monkeypatch,
                                                                            capsys):
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / recipes[1].stem).mkdir()
    (tmp_path / "art" / recipes[1].stem / "notes.txt").write_text("not dstc's")
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "build", *recipes, "-o", tmp_path / "art")
    assert code == 2 and "was not written by dstc" in err
    assert not (tmp_path / "art" / recipes[0].stem).exists() and not (tmp_path / "cache" / "stages").exists()


def test_a_worker_that_dies_mid_stage_is_retried_into_the_same_bytes(recipes, local_builds, ray_local, tmp_path,
                                                                     monkeypatch, capsys):
    arm = ray_local
    arm.write_text("")  # the first worker to finish writing a stage's files dies before its stage.json
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "build", recipes[0], "-o", tmp_path / "art", "--ray")
    assert code == 0, err
    killed = Path(str(arm) + ".killed")
    assert not arm.exists() and killed.is_file()  # the worker died
    assert Path(killed.read_text()).name.startswith("export-")  # in the export stage, its files in the cache entry
    assert files(tmp_path / "art") == files(local_builds / recipes[0].stem)


@pytest.mark.slow
def test_the_embedded_int4_recipes_built_on_ray_are_byte_identical_to_local_builds(ray_local, tmp_path, monkeypatch,
                                                                                    capsys):
    recipes = []
    for name in ("r1-distill-qwen-tiny-onnxruntime-int4", "r1-distill-llama-tiny-onnxruntime-int4"):
        recipe = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
        recipe.pop("eval"), recipe.pop("gates")  # the artifact, not its report
        recipes.append(tmp_path / f"{name}.yaml")
        recipes[-1].write_text(yaml.safe_dump(recipe))
    for how in ("local", "ray"):
        monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / how / "cache"))
        code, _, err = run_cli(monkeypatch, capsys, "build", *recipes, "-o", tmp_path / how / "art",
                               *(["--ray"] if how == "ray" else []))
        assert code == 0, err
    for recipe in recipes:
        assert files(tmp_path / "ray" / "art" / recipe.stem) == files(tmp_path / "local" / "art" / recipe.stem)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> tuple[Path, Path]:
    """A recipe whose compression streams (one weight at a time, as a large model's does), and its artifact built
    on this machine, unsplit."""
    root = tmp_path_factory.mktemp("streamed")
    recipe = write_recipe(root / "streamed.yaml", MODELS[0], compile={"backend": "onnxruntime", "verify": False,
                                                                      "smoke": False},
                          compress={"scheme": "int4-grouped", "group_size": 32, "backup": "int8",
                                    "streaming": "always", "prefill_int8": True})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(root / "cache"))
        code, _, err = run_cli(mp, _NoCapture(), "build", recipe, "-o", root / "art")
    assert code == 0, err
    return recipe, root / "art"


def split_parts(out: Path) -> list[dict]:
    reports = json.loads((out / "manifest.json").read_text())["provenance"]["stage_reports"]
    return reports["compress/compression.json"]["details"].get("parts", [])


def test_a_streamed_compression_split_over_ray_workers_is_byte_identical_to_the_local_build(streamed, ray_local,
                                                                                          tmp_path, monkeypatch,
                                                                                          capsys):
    recipe, local = streamed
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "art", "--ray", "--split", "2")
    assert code == 0, err
    assert files(tmp_path / "art") == files(local) and "model.onnx.data" in files(local)
    parts = split_parts(tmp_path / "art")
    assert [p["part"].split(" (")[0] for p in parts] == ["part 1/2", "part 2/2"] and all(p["bytes"] for p in parts)
    assert split_parts(local) == []


@pytest.mark.slow  # the default suite has a worker dying mid-stage (above); this is the same retry for a part
def test_a_part_whose_worker_dies_half_way_is_written_again_into_the_same_bytes(streamed, ray_local, tmp_path,
                                                                                monkeypatch, capsys):
    recipe, local = streamed
    part_arm = ray_local.parent / "part-arm"
    part_arm.write_text("")  # the first worker to have written a part's first tensor dies
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "art", "--ray", "--split", "3")
    assert code == 0, err
    killed = Path(str(part_arm) + ".killed")
    assert not part_arm.exists() and killed.is_file()  # the worker died, its part half-written under a temporary name
    assert Path(killed.read_text()).name.startswith("part-") and Path(killed.read_text()).parent.name.startswith(".")
    assert files(tmp_path / "art") == files(local)
    assert len(split_parts(tmp_path / "art")) == 3


def test_split_without_ray_is_refused(streamed, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "build", streamed[0], "-o", tmp_path / "art", "--split", "2")
    # the last line: Ray may still relay a line of the module's earlier tasks
    assert code == 2 and err.strip().splitlines()[-1] == \
        "dstc: error: --split N splits a build's streamed compression over Ray workers: use it with --ray"
    assert not (tmp_path / "art").exists()


def test_recipes_sharing_an_export_start_apart(tmp_path):
    """A matrix lists a model's recipes together; started in parallel, two of them would wait on one export."""
    from toolchain.build_set import plan_jobs, spread

    paths = [write_recipe(tmp_path / f"{model}-{backend}.yaml", model, compile={"backend": backend})
             for model in MODELS for backend in ("onnxruntime", "openvino")]
    paths.append(write_recipe(tmp_path / "qwen-other-export.yaml", MODELS[0], export={"parity": ["onnxruntime"]}))
    jobs = plan_jobs(paths, tmp_path / "out", None)
    assert [job.name for job in spread(jobs)] == [
        "r1-distill-qwen-tiny-onnxruntime", "r1-distill-llama-tiny-onnxruntime", "qwen-other-export",
        "r1-distill-qwen-tiny-openvino", "r1-distill-llama-tiny-openvino"]
    assert sorted(spread(jobs), key=jobs.index) == jobs
