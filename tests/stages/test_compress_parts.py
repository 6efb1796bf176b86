"""A streamed compression written in parts, by layer range, each part planned and written as another process would
(toolchain/stages/compress_parts.py): the same files, byte for byte, as one process writes; a part that is not
what its task wrote is never assembled."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from toolchain.errors import DstcError
from toolchain.export import graph
from toolchain.recipe import CompressSection
from toolchain.stages.alone import compress
from toolchain.stages.compress_parts import AFTER, BEFORE, plan_parts


class InProcess:
    """The parts' tasks run one after another here; ``damage`` changes a part's file after its task returned."""

    def __init__(self, count: int, damage=None) -> None:
        self.count, self.damage, self.titles = count, damage, []

    def run(self, work, tasks, log):
        files = [work(task, log) for task in tasks]
        self.titles = [task.part.title for task in tasks]
        if self.damage:
            self.damage(files)
        return files


def sha256s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name != "compression.json"}


def without_timings(directory: Path) -> dict:
    report = json.loads((directory / "compression.json").read_text())
    report.pop("timings")
    report["source"].pop("export")
    return report


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Exports written as a large model's are by a streamed build: model.onnx only, the weights left in the
    checkpoint (recomputed as they are compressed)."""
    from toolchain.stages.alone import export

    root = tmp_path_factory.mktemp("exports")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graph, "EXTERNAL_DATA_BYTES", 1 << 10)
        for name, model in (("qwen", "r1-distill-qwen-tiny"), ("v3", str(tiny_checkpoints["deepseek_v3"]))):
            export(model, root / name, parity=(), defer_weights=True)
            assert not (root / name / "model.onnx.data").exists()
    return {"qwen": root / "qwen", "v3": root / "v3"}


@pytest.mark.parametrize(("model", "target", "count"), [("qwen", "onnxruntime", 3), ("qwen", "openvino", 2),
                                                       ("v3", "onnxruntime", 4)])
def test_a_compression_written_in_parts_is_the_bytes_one_process_writes(exports, tmp_path, model, target, count):
    # prefill_int8 on: its int8 copies are computed from the 4-bit tensors, in the part of their weight
    section = CompressSection(scheme="int4-grouped", group_size=32, backup="int8", streaming="always",
                              prefill_int8=target == "onnxruntime")
    compress(exports[model], tmp_path / "whole", section, target=target)
    runner = InProcess(count)
    compress(exports[model], tmp_path / "parts", section, target=target, parts=runner)
    whole = sha256s(tmp_path / "whole")
    assert sha256s(tmp_path / "parts") == whole and "model.onnx.data" in whole
    split = without_timings(tmp_path / "parts")
    assert [p["part"] for p in split["details"].pop("parts")] == runner.titles
    assert split == without_timings(tmp_path / "whole")  # the weights' errors too
    assert len(runner.titles) == count and runner.titles[0].startswith(f"part 1/{count} (embeddings, layer")
    assert "weights outside the layers" in runner.titles[-1]
    assert not (tmp_path / "parts" / "parts").exists()  # deleted once assembled


@pytest.mark.parametrize("damage", ["truncated", "changed"])
def test_a_part_that_is_not_what_its_task_wrote_is_never_assembled(exports, tmp_path, damage):
    """A half-written part at its final name (a writer that died on a file system without atomic renames), or
    one changed since its task returned, stops the stage; nothing is written."""

    def spoil(files):
        path = files[1].path
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2] if damage == "truncated" else data[:-1] + bytes([data[-1] ^ 1]))

    section = CompressSection(scheme="int4-grouped", group_size=32, backup="int8", streaming="always")
    with pytest.raises(DstcError, match=r"part 2/2 \(.*\) of the streamed compression, is not what its task wrote"):
        compress(exports["qwen"], tmp_path / "out", section, parts=InProcess(2, spoil))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_parts_are_contiguous_layer_ranges_of_about_equal_bytes():
    places = {"embed": (BEFORE, 400), **{f"l{i}/w": (float(i), 100) for i in range(8)}, "head": (AFTER, 400)}
    names = ["l0/w_q", "l1/w", *[f"l{i}/w_q" for i in range(1, 8)], "embed_q", "head_q", "head_q_prefill_int8",
             "orphan"]
    parts = plan_parts(places, names, 2)
    assert [p.what for p in parts] == ["embeddings, layers 0-3", "layers 4-7, weights outside the layers"]
    assert sorted(n for p in parts for n in p.names) == sorted(names)  # each tensor in one part, in file order
    assert parts[1].names == ("l4/w_q", "l5/w_q", "l6/w_q", "l7/w_q", "head_q", "head_q_prefill_int8", "orphan")
    assert [p.what for p in plan_parts(places, names, 20)][:2] == ["embeddings", "layer 0"]
    assert len(plan_parts(places, names, 20)) == 10  # never more parts than places
