"""ONNX Runtime's optimisation of a graph whose input weights are given up as the artifact's are written
(toolchain/compile/ort_streamed.py): the bytes ORT writes to a file, the input's blocks punched out, what ORT
folds taken from its stream, and the input left whole when its weights are not one file of disjoint tensors."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from toolchain.compile import onnxruntime_artifact, ort_streamed
from toolchain.compile.onnxruntime_artifact import INLINE_MAX_BYTES
from toolchain.errors import DstcError
from toolchain.export import graph
from toolchain.recipe import CompressSection
from toolchain.stages.alone import compress


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture(scope="module")
def compressed(tiny_checkpoints, tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """(model, prefill_int8) -> the streamed INT4 compression for ONNX Runtime of a tiny GQA (R1-Distill-Qwen) and
    MLA (DeepSeek-V3) model, its weights in model.onnx.data, as a large model's are."""
    from toolchain.stages.alone import export

    root = tmp_path_factory.mktemp("compressed")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graph, "EXTERNAL_DATA_BYTES", 1 << 10)
        for name, model in (("qwen", "r1-distill-qwen-tiny"), ("v3", str(tiny_checkpoints["deepseek_v3"]))):
            export(model, root / name, parity=(), defer_weights=True)
            for prefill in (False, True):
                section = CompressSection(scheme="int4-grouped", group_size=32, backup="int8", streaming="always",
                                          prefill_int8=prefill)
                compress(root / name, root / f"{name}-{prefill}", section, target="onnxruntime")
                out[name, prefill] = root / f"{name}-{prefill}"
    return out


def releasing(src_dir: Path, work: Path) -> tuple[Path, Path, list[str], list[int]]:
    """src_dir's graph optimized by ORT as a plain save writes it (work/plain) and giving up a copy of its weights
    (work/in -> work/out): the two output directories, the log, and the input's allocated bytes when
    release_input was called."""
    for name in ("in", "plain", "out"):
        (work / name).mkdir(parents=True)
    for name in (onnxruntime_artifact.ONNX_MODEL, onnxruntime_artifact.ONNX_WEIGHTS):
        shutil.copyfile(src_dir / name, work / "in" / name)
    onnxruntime_artifact.optimize(work / "in" / "model.onnx", work / "plain" / "model.onnx")
    log, released = [], []
    done = ort_streamed.optimize_releasing(work / "in" / "model.onnx", work / "out" / "model.onnx", INLINE_MAX_BYTES,
                                           lambda: released.append(allocated(work / "in" / "model.onnx.data")),
                                           log.append)
    assert done
    return work / "plain", work / "out", log, released


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("model", ["qwen", "v3"])
def test_the_artifact_is_the_bytes_ort_writes_and_the_input_weights_are_given_up(compressed, tmp_path, model,
                                                                                 prefill):
    src = compressed[model, prefill]
    before = allocated(src / "model.onnx.data")
    plain, out, log, released = releasing(src, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in plain.iterdir()) == \
        ["model.onnx", "model.onnx.data"]
    for name in ("model.onnx", "model.onnx.data"):
        assert (out / name).read_bytes() == (plain / name).read_bytes(), name
    assert released == [before]  # called once, before the first byte went
    # every input tensor went (ORT's copies as they streamed past, the folded ones at the stream's end): what is
    # left is the last partial block
    assert allocated(tmp_path / "in" / "model.onnx.data") <= os.stat(src / "model.onnx.data").st_blksize
    inputs = {t.name for t in ort_streamed.external_tensors(src / "model.onnx")[0]}
    outputs = {t.name for t in ort_streamed.external_tensors(out / "model.onnx")[0]}
    made = outputs - inputs
    summary = log[-1]
    assert f"{len(outputs & inputs)} of its {len(outputs)} tensors are the input's" in summary
    assert "(0 of the same name, type and shape differ)" in summary
    if model == "v3":  # ORT folds the dequantization of MLA's absorbed kv_b_proj: its float32 comes from the stream
        assert any(name.endswith("absorbed_dequantized") for name in made), made
    assert not (tmp_path / "out" / ".layout").exists() and not (tmp_path / "out" / ".model.onnx.data.part").exists()


def synthetic(directory: Path, shared: bool = False) -> Path:
    """A graph in which ORT folds large constants (a Transpose of a weight, the sum of two) and keeps one weight
    as it is, all in external data; ``shared``: two initializers on the same bytes of the weights file."""
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal((64, 64)).astype(np.float32) for name in ("W", "A", "B", "C")}
    initializers = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["X", "Wt"], ["Y"]),
             helper.make_node("Add", ["A", "B"], ["AB"]),
             helper.make_node("MatMul", ["Y", "AB"], ["Z"]),
             helper.make_node("MatMul", ["Z", "C"], ["out"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 64])], initializers)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    directory.mkdir(parents=True)
    onnx.save(model, str(directory / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=1024)
    if shared:  # B read from A's bytes
        model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
        a, b = (next(t for t in model.graph.initializer if t.name == n) for n in ("A", "B"))
        del b.external_data[:]
        b.external_data.extend(a.external_data)
        onnx.save(model, str(directory / "model.onnx"))
    return directory


def test_what_ort_folds_comes_from_its_stream_and_the_folded_inputs_are_given_up(tmp_path):
    src = synthetic(tmp_path / "src")
    plain, out, log, _ = releasing(src, tmp_path / "work")
    for name in ("model.onnx", "model.onnx.data"):
        assert (out / name).read_bytes() == (plain / name).read_bytes(), name
    outputs = {t.name: t for t in ort_streamed.external_tensors(out / "model.onnx")[0]}
    assert sorted(outputs) == ["AB", "C", "Wt"]  # W, A and B folded into new tensors, C kept
    assert "1 of its 3 tensors are the input's" in log[-1]
    assert allocated(tmp_path / "work" / "in" / "model.onnx.data") == 0  # 4 x 16 KiB, whole blocks: all given up
    weights = np.fromfile(out / "model.onnx.data", dtype=np.float32)
    w = numpy_helper.to_array(onnx.load(str(src / "model.onnx")).graph.initializer[0], base_dir=str(src))
    t = outputs["Wt"]
    assert np.array_equal(weights[t.offset // 4:(t.offset + t.length) // 4].reshape(64, 64), w.T)


def test_an_input_whose_tensors_share_bytes_is_kept_whole_and_nothing_is_written(tmp_path):
    src = synthetic(tmp_path / "src", shared=True)
    (tmp_path / "out").mkdir()
    log, released = [], []
    before = (src / "model.onnx.data").read_bytes()
    assert not ort_streamed.optimize_releasing(src / "model.onnx", tmp_path / "out" / "model.onnx", INLINE_MAX_BYTES,
                                               lambda: released.append(1), log.append)
    assert log == ["the input's weights are not one file of disjoint tensors (model.onnx.data): kept whole while "
                   "ONNX Runtime writes the artifact's"]
    assert not released and not list((tmp_path / "out").iterdir())
    assert (src / "model.onnx.data").read_bytes() == before


def test_a_tensor_of_an_input_name_with_other_bytes_keeps_the_input_ones(tmp_path, monkeypatch):
    """ORT may change a tensor and keep its name (its transpose optimizer does, in place): the bytes decide."""
    src = synthetic(tmp_path / "src")
    read = ort_streamed.external_tensors

    def w_named_wt(path: Path):  # the input's W under the name of ORT's transpose of it, of the same type and shape
        tensors, files, inline = read(path)
        return [replace(t, name="Wt") if path.parent.name == "in" and t.name == "W" else t for t in tensors], files, \
            inline

    monkeypatch.setattr(ort_streamed, "external_tensors", w_named_wt)
    plain, out, log, _ = releasing(src, tmp_path / "work")
    for name in ("model.onnx", "model.onnx.data"):
        assert (out / name).read_bytes() == (plain / name).read_bytes(), name
    assert "(1 of the same name, type and shape differ)" in log[-1]
    w = next(t for t in read(src / "model.onnx")[0] if t.name == "W")
    kept = (tmp_path / "work" / "in" / "model.onnx.data").read_bytes()[w.offset:w.offset + w.length]
    assert kept == (src / "model.onnx.data").read_bytes()[w.offset:w.offset + w.length]
    assert allocated(tmp_path / "work" / "in" / "model.onnx.data") == w.length


def test_a_second_run_that_streams_other_bytes_fails_the_stage(tmp_path, monkeypatch):
    src = synthetic(tmp_path / "src")
    save, runs = ort_streamed._ort_save, []

    def spoiled(src_path, dst, min_bytes, consume):
        runs.append(dst)
        if len(runs) == 1:
            return save(src_path, dst, min_bytes, consume)
        return save(src_path, dst, min_bytes, lambda offset, chunk: consume(offset, bytes(len(chunk))))

    monkeypatch.setattr(ort_streamed, "_ort_save", spoiled)
    with pytest.raises(DstcError, match="ONNX Runtime wrote another graph or other weights on its second run"):
        releasing(src, tmp_path / "work")
    assert not (tmp_path / "work" / "out" / "model.onnx.data").exists()
