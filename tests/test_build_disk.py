"""The disk a streamed build holds: its export leaves the weights in the checkpoint, where the streamed compression
reads them (toolchain/stages/export.py recomputed_weights), into the artifact a build that writes the export's
weights file makes, byte for byte; `--no-keep-stages` deletes each stage cache entry once read and moves the last
one into the artifact."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

import pytest
import yaml

from toolchain import build as build_module
from toolchain.build import build
from toolchain.errors import InputError
from toolchain.export import graph
from toolchain.stages import runner
from toolchain.stages.runner import export_stage


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # renamed or deleted between the listing and the stat
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class DiskPeak:
    """The most bytes under a directory while a block runs: sampled by a thread, and at every stage's end."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()

    def sample(self) -> None:
        self.peak = max(self.peak, tree_bytes(self.path))

    def __enter__(self) -> DiskPeak:
        def run() -> None:
            while not self._stop.wait(0.002):
                self.sample()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class StageEnds(build_module.Events):
    def __init__(self, disk: DiskPeak) -> None:
        self.disk, self.lines = disk, []

    def stage_finished(self, name: str, seconds: float, cached: bool) -> None:
        self.disk.sample()

    def log(self, message: str) -> None:
        self.lines.append(message)


@pytest.fixture
def streamed(tiny_checkpoints, tmp_path, monkeypatch) -> Path:
    """The tiny DeepSeek-V3's INT4 ONNX Runtime recipe, its export written as a large one's (weights in
    model.onnx.data) and compressed one weight at a time."""
    monkeypatch.setattr(graph, "EXTERNAL_DATA_BYTES", 1 << 10)
    recipe = tmp_path / "streamed.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "streamed", "model": str(tiny_checkpoints["deepseek_v3"]), "export": {"parity": []},
        # prefill_int8 off: on a CPU with an int8 dot product it would default on and add the int8 copies (+33 %
        # on disk), which this comparison with the export's weights file is not about
        "compress": {"scheme": "int4-grouped", "group_size": 32, "backup": "int8", "streaming": "always",
                     "prefill_int8": False},
        "compile": {"backend": "onnxruntime", "verify": False, "smoke": False}}))
    return recipe


def built(recipe: Path, root: Path, monkeypatch, **options) -> tuple[dict, DiskPeak, list[str]]:
    """The recipe built into ROOT/art with the stage cache ROOT/cache: its manifest, the disk it held at most under
    ROOT and its log."""
    monkeypatch.setenv("DSTC_CACHE_DIR", str(root / "cache"))
    root.mkdir(exist_ok=True)
    with DiskPeak(root) as disk:
        events = StageEnds(disk)
        manifest = build(recipe, root / "art", events=events, **options)
    return manifest, disk, events.lines


@pytest.fixture
def written(streamed, tmp_path, monkeypatch) -> tuple[dict, int]:
    """The same build with the export's weights file written (as every build wrote it before): its manifest and
    the bytes of that file."""
    with monkeypatch.context() as mp:
        mp.setattr(runner, "export_stage",
                   lambda plan: export_stage(plan.model_copy(update={"defer_weights": False})))
        manifest, _, _ = built(streamed, tmp_path / "written", mp)
    export = next((tmp_path / "written" / "cache" / "stages").glob("export-*"))
    return manifest, (export / "model.onnx.data").stat().st_size


def test_a_streamed_build_never_holds_the_export_weights_and_builds_the_same_bytes(streamed, written, tmp_path,
                                                                                    monkeypatch):
    reference, weights = written
    manifest, disk, log = built(streamed, tmp_path / "streamed", monkeypatch)
    assert manifest["files"] == reference["files"] and "model.onnx.data" in manifest["files"]
    assert disk.peak < weights, (disk.peak, weights)  # the export, the INT4 stages and the artifact together
    export = next((tmp_path / "streamed" / "cache" / "stages").glob("export-*"))
    assert not (export / "model.onnx.data").exists()
    assert (export / "model.onnx").read_bytes() == \
        (next((tmp_path / "written" / "cache" / "stages").glob("export-*")) / "model.onnx").read_bytes()
    assert any("read from" in line and "as they are compressed" in line for line in log)
    assert not any("given up" in line for line in log)  # its stages are kept: ORT writes the artifact itself
    # the model's size before compression, as the export with its weights records it
    reports = [m["provenance"]["stage_reports"] for m in (manifest, reference)]
    assert reports[0]["export/export.json"]["graph"]["deferred"]["bytes"] == weights
    assert reports[0]["compress/compression.json"]["input_size_bytes"] == \
        reports[1]["compress/compression.json"]["input_size_bytes"]


def test_no_keep_stages_leaves_no_entry_of_its_own_and_keeps_what_it_reused(streamed, written, tmp_path,
                                                                            monkeypatch):
    reference, _ = written
    root = tmp_path / "lean"
    manifest, disk, log = built(streamed, root, monkeypatch, keep_stages=False)
    assert manifest["files"] == reference["files"]
    assert not [p for p in (root / "cache" / "stages").iterdir() if not p.name.startswith(".")]
    assert sum("(--no-keep-stages)" in line for line in log) == 3  # export and compress deleted, compile moved
    # the compile stage gave up the compressed weights as it wrote the artifact's, the same bytes
    assert [line for line in log if "of the input's weights given up as the artifact's" in line
            and "(0 of the same name, type and shape differ)" in line]
    artifact = tree_bytes(root / "art")
    assert disk.peak < 3 * artifact, (disk.peak, artifact)  # two stages' outputs (INT4) and the small export
    # entries it did not write are not its own to delete
    build(streamed, root / "kept")
    entries = sorted(p.name for p in (root / "cache" / "stages").iterdir() if not p.name.startswith("."))
    again, _, log = built(streamed, root, monkeypatch, keep_stages=False)
    assert again["files"] == reference["files"] and again["provenance"]["cached_stages"] == \
        ["export", "compress", "compile"]
    assert sorted(p.name for p in (root / "cache" / "stages").iterdir() if not p.name.startswith(".")) == entries
    assert not any("(--no-keep-stages)" in line for line in log)


def test_no_keep_stages_keeps_the_compressed_weights_while_the_verification_runs_them(streamed, tmp_path,
                                                                                   monkeypatch):
    recipe = yaml.safe_load(streamed.read_text())
    streamed.write_text(yaml.safe_dump({**recipe, "compile": {**recipe["compile"], "verify": True}}))
    manifest, _, log = built(streamed, tmp_path / "verified", monkeypatch, keep_stages=False)
    assert "the input's weights are kept until the verification has run the compressed graph" in log
    assert not any("given up" in line for line in log)
    verification = manifest["provenance"]["stage_reports"]["compile/compile.json"]["verification"]
    assert verification["passed"] and verification["reference"] == "compressed input graph"


def test_an_export_without_its_weights_file_is_refused_by_the_stages_that_read_it(streamed, tmp_path, monkeypatch):
    from toolchain.stages.alone import compile_artifact

    built(streamed, tmp_path / "b", monkeypatch)
    export = next((tmp_path / "b" / "cache" / "stages").glob("export-*"))
    assert json.loads((export / "export.json").read_text())["graph"]["deferred"]["file"] == "model.onnx.data"
    with pytest.raises(InputError, match="weights file was not written"):
        compile_artifact(export, tmp_path / "c", "onnxruntime", verify=False, smoke=False)


def test_a_recipe_whose_passes_read_the_export_weights_says_why_they_are_written(streamed, tmp_path, monkeypatch):
    recipe = yaml.safe_load(streamed.read_text())
    streamed.write_text(yaml.safe_dump({**recipe, "passes": {"target": "onnxruntime"}}))
    manifest, _, log = built(streamed, tmp_path / "passes", monkeypatch)
    assert [s["name"] for s in manifest["stages"]] == ["export", "passes", "compress", "compile"]
    assert [line for line in log if line.startswith("disk: ")] == \
        [next(line for line in log if "passes stage rewrites the graph with them" in line)]
    export = next((tmp_path / "passes" / "cache" / "stages").glob("export-*"))
    assert (export / "model.onnx.data").is_file()


def test_no_keep_stages_builds_one_recipe_on_this_machine(streamed, tmp_path, monkeypatch, capsys):
    from conftest import run_cli

    code, _, err = run_cli(monkeypatch, capsys, "build", streamed, streamed, "-o", tmp_path / "set",
                           "--no-keep-stages")
    assert code == 2 and "--no-keep-stages builds one recipe on this machine" in err
    assert not (tmp_path / "set").exists()
