"""Bad input: one-line error, exit code 2, nothing written. Remote code is not run without the flag."""

from __future__ import annotations

import json
import shutil

import pytest

from cli_helpers import assert_one_line_error, run_cli


@pytest.fixture
def out(tmp_path):
    return tmp_path / "out"


def test_unknown_architecture(monkeypatch, capsys, tmp_path, out):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", tmp_path / "m", "-o", out), "'gpt2' is not supported")
    assert not out.exists()


def test_directory_that_is_not_a_model(monkeypatch, capsys, tmp_path, out):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", tmp_path / "empty", "-o", out), "no config.json")
    assert not out.exists()


def test_unknown_name_or_uncached_hub_id(monkeypatch, capsys, out):
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", "no-such-model", "-o", out), "not an embedded model")
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", "deepseek-ai/DeepSeek-V3", "-o", out),
                          "not in the local Hugging Face cache")
    assert not out.exists()


def test_missing_and_corrupt_safetensors(monkeypatch, capsys, tiny_checkpoints, tmp_path, out):
    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["qwen2"], model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", model, "-o", out), "no model.safetensors")
    weights.write_bytes(b"\xff" * 8 + data[8:])  # header length field destroyed
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", model, "-o", out), "not a readable safetensors")
    weights.write_bytes(data[: len(data) // 2])  # truncated
    code, err = run_cli(monkeypatch, capsys, "export", model, "-o", out)
    assert code == 2 and "Traceback" not in err
    assert not out.exists()


def test_unwritable_output(monkeypatch, capsys, tiny_checkpoints, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, err = run_cli(monkeypatch, capsys, "export", tiny_checkpoints["llama"], "-o", blocker / "out")
    assert_one_line_error(code, err, "cannot write to")
    assert blocker.read_text() == "not a directory"


def test_existing_foreign_directory_is_not_replaced(monkeypatch, capsys, tiny_checkpoints, tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, err = run_cli(monkeypatch, capsys, "export", tiny_checkpoints["llama"], "-o", foreign, "--parity", "none")
    assert_one_line_error(code, err, "was not written by dstc")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".home")]


def test_remote_code_is_not_run_without_the_flag(monkeypatch, capsys, tiny_checkpoints, tmp_path, out):
    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["llama"], model)
    sentinel = tmp_path / "remote-code-ran"
    (model / "modeling_evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    code, _ = run_cli(monkeypatch, capsys, "export", model, "-o", out, "--parity", "none")
    assert code == 0 and (out / "model.onnx").exists()
    assert not sentinel.exists()


@pytest.mark.parametrize("fields,fragment", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"use_sliding_window": True, "sliding_window": 16},
     "qwen3_moe: sliding-window attention (use_sliding_window) is not supported"),
])
def test_qwen3_moe_config_that_cannot_be_exported(monkeypatch, capsys, tiny_checkpoints, tmp_path, out, fields,
                                                  fragment):
    model = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["qwen3_moe"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", model, "-o", out), fragment)
    assert not out.exists()


def test_an_mtp_layer_is_refused_for_an_architecture_that_has_none(monkeypatch, capsys, out):
    code, err = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "--mtp", "-o", out)
    assert_one_line_error(code, err, "mtp: the MTP layer is exported for deepseek_v3, deepseek_v32, deepseek_v4, not qwen2")
    assert not out.exists()
