"""Issue #39 items 8 and 9 and issue #40's recipe check: input that used to be taken wrongly, or refused with a
traceback or a library's noise, is taken as written or refused in one line, exit 2, before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from cli_helpers import assert_one_line_error, run_cli

from toolchain import source as sources
from toolchain.chat_roles import CHAT_ROLES
from toolchain.errors import InputError, RecipeError
from toolchain.evaluate.dataset import load_data
from toolchain.recipe import DESCRIPTION_CHARS, load_recipe
from toolchain.serve.schemas import ChatMessage
from toolchain.settings.evaluation import EvalSettings
from toolchain.tokenizer_loading import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL = "r1-distill-qwen-tiny"
BASE = f"name: r\nmodel: {MODEL}\n"


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


# -- stages that build for different runtimes: refused when the recipe loads ----------------------------------------


@pytest.mark.parametrize("sections, keys", [
    # the MoE lowering was chosen for ONNX Runtime (com.microsoft.MoE), which the openvino passes cannot convert:
    # a 40-line traceback in the passes stage, exit 1
    ("passes: {target: openvino}\ncompile: {backend: onnxruntime}\n",
     "passes.target is openvino and compile.backend is onnxruntime"),
    ("passes: {target: onnxruntime}\ncompile: {backend: openvino}\n",
     "passes.target is onnxruntime and compile.backend is openvino"),
    ("export: {moe: fused-onnxruntime}\ncompile: {backend: openvino}\n",
     "export.moe is fused-onnxruntime, which runs on onnxruntime only, and compile.backend is openvino"),
])
def test_stages_for_different_runtimes_are_refused_before_anything_runs(monkeypatch, capsys, tmp_path, sections,
                                                                        keys):
    recipe = _recipe(tmp_path, f"name: mix\nmodel: deepseek-v3-tiny\n{sections}")
    code, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, f"{recipe}: {keys}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_stages_for_one_runtime_still_load(tmp_path):
    for backend in ("openvino", "onnxruntime"):
        recipe = load_recipe(_recipe(tmp_path, f"{BASE}passes: {{target: {backend}}}\ncompile: {{backend: {backend}}}\n"
                                               f"export: {{moe: fused-openvino}}\n"))
        assert recipe.passes.target == recipe.compile.backend == backend


# -- YAML merge keys ------------------------------------------------------------------------------------------------


def test_merge_keys_merge_and_the_mappings_own_keys_win(tmp_path):
    merged = load_recipe(_recipe(tmp_path, f"{BASE}x-compile: &base {{backend: onnxruntime, verify: false, smoke: "
                                           "false}\ncompile:\n  <<: *base\n  verify: true\n"))
    written = load_recipe(_recipe(tmp_path, f"{BASE}compile: {{backend: onnxruntime, verify: true, smoke: false}}\n"))
    assert merged == written and merged.digest() == written.digest()


def test_a_key_given_twice_beside_a_merge_is_still_refused(tmp_path):
    with pytest.raises(RecipeError, match="duplicate key 'verify'"):
        load_recipe(_recipe(tmp_path, f"{BASE}x-base: &base {{backend: onnxruntime}}\ncompile:\n  <<: *base\n"
                                      "  verify: true\n  verify: false\n"))


def test_an_anchor_key_without_x_is_an_unknown_key(tmp_path):
    with pytest.raises(RecipeError, match="base: unknown key"):
        load_recipe(_recipe(tmp_path, f"{BASE}base: &base {{backend: onnxruntime}}\ncompile:\n  <<: *base\n"))


# -- booleans are booleans, as numbers are numbers --------------------------------------------------------------------


@pytest.mark.parametrize("value", ["no", "false", "true", "off", 0, 1])
@pytest.mark.parametrize("key", ["compress.sym", "compress.awq", "compress.prefill_int8", "compile.verify",
                                 "export.mtp"])
def test_a_string_or_number_for_a_boolean_is_refused_as_one_for_a_number(monkeypatch, capsys, tmp_path, key, value):
    """``sym: "no"`` was taken as false (pydantic's lax bool) where ``group_size: "128"`` is refused."""
    section, field = key.split(".")
    sections: dict = {"compress": {"scheme": "int4-grouped"}, "compile": {"backend": "onnxruntime"}}
    sections.setdefault(section, {})[field] = value
    recipe = _recipe(tmp_path, yaml.safe_dump({"name": "r", "model": MODEL, **sections}))
    code, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, f"{key}: {value!r} is not a boolean: write true or false")


def test_string_numbers_were_refused_already_and_true_false_still_load(tmp_path):
    with pytest.raises(RecipeError, match=r"compress\.group_size"):
        load_recipe(_recipe(tmp_path, f'{BASE}compress: {{scheme: int4-grouped, group_size: "128"}}\n'
                                      "compile: {backend: onnxruntime}\n"))
    recipe = load_recipe(_recipe(tmp_path, f"{BASE}compress: {{scheme: int4-grouped, sym: true, prefill_int8: null}}\n"
                                           "compile: {backend: onnxruntime, verify: false}\n"))
    assert recipe.compress.sym is True and recipe.compress.prefill_int8 is None and recipe.compile.verify is False


def test_a_boolean_option_still_takes_its_flag(monkeypatch, capsys, tmp_path):
    """The command-line spelling of a boolean (--sym/--asym) reaches the section as a bool."""
    code, err = run_cli(monkeypatch, capsys, "compress", tmp_path / "missing", "-o", tmp_path / "out", "--sym",
                        "--scheme", "int8-per-channel", "--awq")
    assert_one_line_error(code, err, "awq")


# -- free text is bounded ---------------------------------------------------------------------------------------------


def test_a_description_of_more_than_2000_characters_is_one_line(monkeypatch, capsys, tmp_path):
    assert DESCRIPTION_CHARS == 2000
    ok = f"{BASE}description: {'d' * 2000}\ncompile: {{backend: onnxruntime}}\n"
    assert len(load_recipe(_recipe(tmp_path, ok)).description) == 2000
    recipe = _recipe(tmp_path, f"{BASE}description: {'d' * 100_000}\ncompile: {{backend: onnxruntime}}\n")
    code, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, f"{recipe}: description: String should have at most 2000 characters")
    assert len(err) < 400


# -- chat roles: eval's records and the server's requests take the same ones ------------------------------------------


def test_the_server_and_eval_take_the_same_chat_roles():
    assert typing.get_args(ChatMessage.model_fields["role"].annotation) == CHAT_ROLES
    assert "wizard" not in CHAT_ROLES


def test_eval_refuses_a_chat_record_of_an_unknown_role(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]}\n')
    tokenizer = load_tokenizer(sources.resolve(MODEL).path)
    with pytest.raises(InputError, match=r"mine.jsonl:1: unknown message role 'wizard' \(one of system, developer, "
                                         r"user, assistant, tool, as the server's\)"):
        load_data(EvalSettings(dataset=str(path)), tokenizer, task=False, max_length=1024)


# -- a prompt longer than the context: dstc's line alone ---------------------------------------------------------------


def test_a_100k_character_prompt_is_one_line_without_transformers_warning(artifact):
    """In a child process: transformers' logging handler holds the stderr of when it was made."""
    art = artifact(MODEL, "onnxruntime")
    proc = subprocess.run([sys.executable, "-m", "toolchain", "generate", str(art.path), "1+2=3 " * 17_000, "--raw"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert_one_line_error(proc.returncode, proc.stderr, "the prompt is 102001 tokens")
    assert proc.stderr.count("\n") == 1 and "Token indices" not in proc.stderr, proc.stderr
