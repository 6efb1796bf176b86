"""Memory guards (issue #22): every load of an artifact's runtime or of the whole fp32 reference estimates what it
will hold and refuses in one line (exit 2) when that exceeds the memory available, here made small with
DSTC_MEMORY_LIMIT_BYTES."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli
from conftest import run_cli as _run
from test_cli_errors import BACKENDS, artifacts  # noqa: F401 - the module fixture, shared

from toolchain.checkpoint.reader import open_checkpoint
from toolchain.errors import InputError
from toolchain.hardware import MEMORY_LIMIT_ENV, available_memory_bytes, memory_bytes
from toolchain.memory_guard import REFERENCE_FACTOR, reference_bytes, require_memory, size
from toolchain.models.registry import embedded_path
from toolchain.reference.layered import memory_need
from toolchain.reference.whole import release_reference
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.memory import RUNTIME_FACTOR, artifact_runtime_bytes

MODEL = "r1-distill-qwen-tiny"  # the artifacts' model


def test_available_memory_is_memavailable_unless_a_limit_is_given(monkeypatch):
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kernel = int(meminfo["MemAvailable"].split()[0]) * 1024
    assert 0 < available_memory_bytes() <= memory_bytes()
    assert abs(available_memory_bytes() - kernel) < 2**30  # the same figure, read a moment apart
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "12345")
    assert available_memory_bytes() == 12345
    for bad in ("0", "-1", "lots", "1.5e9"):
        monkeypatch.setenv(MEMORY_LIMIT_ENV, bad)
        with pytest.raises(InputError, match=f"{MEMORY_LIMIT_ENV} must be a positive number of bytes, not '{bad}'"):
            available_memory_bytes()


def test_require_memory_names_both_figures_and_the_way_out(monkeypatch):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(3 * 2**30))
    require_memory(3 * 2**30, "x", "y")  # exactly what is available: allowed
    with pytest.raises(InputError) as refused:
        require_memory(30 * 2**30 + 2**29, "loading X", "buy more")
    assert str(refused.value) == ("loading X needs about 30.5 GiB of memory and 3.0 GiB is available "
                                  f"({MEMORY_LIMIT_ENV}): buy more")
    assert (size(512), size(5 * 2**20 + 2**19), size(2**40)) == ("512 B", "5.5 MiB", "1024.0 GiB")


def test_estimates_come_from_the_tensor_shapes_and_the_model_files(artifacts):  # noqa: F811
    with open_checkpoint(embedded_path("deepseek-v3-tiny")) as reader:
        assert reader.parameters() == 1_241_280  # parameters and the routers' buffers: all loaded
    assert reference_bytes(embedded_path("deepseek-v3-tiny")) == int(1_241_280 * 4 * REFERENCE_FACTOR)
    for backend in BACKENDS:
        artifact = open_artifact(artifacts[backend])
        files = sum(p.stat().st_size for p in artifact.model_files)
        assert artifact_runtime_bytes(artifact) == int(files * RUNTIME_FACTOR[backend])


def _between(low: int, high: int) -> str:
    assert low < high
    return str((low + high) // 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_commands_refuse_an_artifact_that_does_not_fit(monkeypatch, capsys, tmp_path, artifacts, backend):  # noqa: F811
    artifact = artifacts[backend]
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(artifact_runtime_bytes(open_artifact(artifact)) - 1))
    commands = {"generate": ["generate", artifact, "1+2=", "--raw"],
                "eval": ["eval", artifact, "--no-latency", "--texts", "2", "--problems", "2", "-o", tmp_path / "o"],
                "compare": ["compare", artifact, artifact, "--no-latency", "--texts", "2", "--problems", "2"],
                "serve": ["serve", artifact, "--port", "0"]}
    for args in commands.values():
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, f"running {artifact} on {backend} (")
        assert f"is available ({MEMORY_LIMIT_ENV}): free memory, build a smaller artifact" in err
    assert not (tmp_path / "o").exists()
    # with the memory it needs, the same artifact runs
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(artifact_runtime_bytes(open_artifact(artifact))))
    code, out, err = _run(monkeypatch, capsys, "generate", artifact, "321+654=", "--raw", "--new-tokens", "4")
    assert code == 0 and out.startswith("9750"), err


def test_serve_with_replicas_counts_each_replicas_engine(monkeypatch, capsys, artifacts):  # noqa: F811
    artifact = artifacts["onnxruntime"]
    one = artifact_runtime_bytes(open_artifact(artifact))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, _between(2 * one, 3 * one))
    # refused before Ray starts: 3 engines at once do not fit where 2 would
    code, err = run_cli(monkeypatch, capsys, "serve", artifact, "--port", "0", "--replicas", "3")
    assert_one_line_error(code, err, f"running {artifact} on onnxruntime (3 copies of it, each ")
    assert "run fewer replicas" in err


def test_eval_refuses_a_reference_that_does_not_fit_after_its_artifact_did(monkeypatch, capsys, tmp_path,
                                                                          artifacts):  # noqa: F811
    artifact = artifacts["onnxruntime"]
    # eval's reference runs one layer at a time (toolchain/reference/layered.py): its own estimate
    limit = _between(artifact_runtime_bytes(open_artifact(artifact)), memory_need(embedded_path(MODEL), 0))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, limit)
    for args in (["eval", artifact, "--no-latency", "-o", tmp_path / "o"], ["compare", artifact, artifact]):
        code, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, f"the fp32 reference of {MODEL}, one layer at a time (")
        assert "free memory, evaluate on a machine with more" in err
    assert not (tmp_path / "o").exists()


def test_export_parity_refuses_a_reference_that_does_not_fit(monkeypatch, capsys, tmp_path, stage_cache):
    release_reference()  # an earlier test's reference still loaded in this process would be reused, not loaded
    monkeypatch.setenv("DSTC_CACHE_DIR", str(stage_cache))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(reference_bytes(embedded_path(MODEL)) - 1))
    code, err = run_cli(monkeypatch, capsys, "export", MODEL, "-o", tmp_path / "e", "--parity", "onnxruntime",
                        "--no-cache")
    assert_one_line_error(code, err, f"loading the fp32 PyTorch reference of {MODEL} whole (")
    assert list(tmp_path.iterdir()) == []
