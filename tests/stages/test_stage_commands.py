"""Single-stage commands (`dstc export`, `optimize`, `compress`, `compile`) run through the stage runner as `dstc
build` does (issue #13.3): their options are the recipe sections' fields, checked by the same rules with the same
messages, the stage cache is used (--no-cache to run again), and the output records the stage (stage.json)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import yaml

from cli_helpers import assert_one_line_error, run_cli
from toolchain.cli import PASSES_EXCLUDED, cli
from toolchain.errors import RecipeError
from toolchain.hashing import file_hashes
from toolchain.recipe import CompileSection, CompressSection, ExportSection, PassesSection, load_recipe
from toolchain.interface.reports import CompressionReport, ExportReport, StageRecord
from toolchain.interface.files import STAGE_RECORD
from toolchain.stages.runner import cache_damage

MODEL = "r1-distill-qwen-tiny"
COMMANDS = [("export", ExportSection, ()), ("optimize", PassesSection, PASSES_EXCLUDED),
            ("compress", CompressSection, ()), ("compile", CompileSection, ())]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def model_files(path: Path) -> dict[str, str]:
    return {name: sha for name, sha in file_hashes(path).items() if not name.endswith(".json")}


@pytest.mark.parametrize("name, section, excluded", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_section_field_is_an_option_with_the_sections_choices_and_default(name, section, excluded):
    params = {p.name: p for p in cli.commands[name].params}
    assert set(section.model_fields) - set(params) == set(excluded)
    for field_name, field in section.model_fields.items():
        if field_name in excluded:
            continue
        option = params[field_name]
        assert option.help, f"--{field_name} has no help"
        kind = typing.get_args(field.annotation)[0] if typing.get_origin(field.annotation) is typing.Union \
            else field.annotation
        if typing.get_origin(kind) is typing.Literal:
            assert tuple(option.type.choices) == typing.get_args(kind)
        if not field.is_required() and field.default_factory is None:
            assert option.default == field.default
    assert "expect" in PASSES_EXCLUDED and "--no-cache" in {o for p in params.values() for o in p.opts}


def test_export_runs_through_the_stage_cache_and_records_the_stage(monkeypatch, capsys, tmp_path, cache):
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    code, err = run_cli(monkeypatch, capsys, "export", MODEL, "-o", first, "--parity", "none", "--new-tokens", "2")
    assert code == 0, err
    record = StageRecord.read(first / STAGE_RECORD)
    # mtp off, no V4 cache layout, a float32 cache: not recorded; moe auto: an export alone has no target, so
    # dispatch (the record it had before auto)
    section = ExportSection(parity=[], new_tokens=2, moe="dispatch").model_dump(
        mode="json", exclude={"mtp", "v4_cache", "cache_dtype"})
    assert record.name == "export" and record.config == {"model": MODEL, **section}
    assert cache_damage(first) is None  # the record lists every file with its hash
    assert ExportReport.read(first / "export.json").parity == {}

    code, err = run_cli(monkeypatch, capsys, "export", MODEL, "-o", second, "--parity", "none", "--new-tokens", "2")
    assert code == 0 and "reused from the stage cache" in err
    assert file_hashes(second) == file_hashes(first)  # the cached directory, export.json and stage.json included

    code, err = run_cli(monkeypatch, capsys, "export", MODEL, "-o", third, "--parity", "none", "--new-tokens", "2",
                        "--no-cache")
    assert code == 0 and "reused" not in err
    assert model_files(third) == model_files(first) and StageRecord.read(third / STAGE_RECORD).id == record.id

    # a build reaching the same stage (same checkpoint, configuration and code) reuses it, and the other way round
    from toolchain.build import build

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": MODEL, "export": {"parity": [], "new_tokens": 2},
                                      "compile": {"backend": "onnxruntime", "verify": False}}))
    manifest = build(recipe, tmp_path / "art")
    assert manifest["provenance"]["cached_stages"] == ["export"] and manifest["stages"][0]["id"] == record.id


def test_compress_and_compile_commands_chain_cache_and_refuse_what_a_recipe_refuses(monkeypatch, capsys, tmp_path,
                                                                                     cache):
    exported, compressed = tmp_path / "e", tmp_path / "c"
    assert run_cli(monkeypatch, capsys, "export", MODEL, "-o", exported, "--parity", "none")[0] == 0
    code, err = run_cli(monkeypatch, capsys, "compress", exported, "-o", compressed, "--scheme", "int8-per-channel",
                        "--sym")
    assert code == 0, err
    record = StageRecord.read(compressed / STAGE_RECORD)
    # prefill_int8 decided (int4-grouped only): the id says what was built
    assert record.config == {"target": "onnxruntime", **CompressSection(scheme="int8-per-channel", sym=True,
                                                                        prefill_int8=False).model_dump(mode="json")}
    assert CompressionReport.read(compressed / "compression.json").options.sym
    # the same input, options and code: from the cache; another target is another stage
    code, err = run_cli(monkeypatch, capsys, "compress", exported, "-o", tmp_path / "c2", "--scheme",
                        "int8-per-channel", "--sym")
    assert code == 0 and "reused from the stage cache" in err
    code, err = run_cli(monkeypatch, capsys, "compress", exported, "-o", tmp_path / "c3", "--scheme",
                        "int8-per-channel", "--sym", "--backend", "openvino")
    assert code == 0 and "reused" not in err and (tmp_path / "c3" / "openvino_model.xml").is_file()
    code, err = run_cli(monkeypatch, capsys, "compile", compressed, "-o", tmp_path / "art", "--backend", "onnxruntime",
                        "--no-verify", "--json")
    assert code == 0, err
    assert StageRecord.read(tmp_path / "art" / STAGE_RECORD).config == {"backend": "onnxruntime", "verify": False}

    # cross-field rules: the recipe's message, exit 2, nothing written
    cases = [(["compress", exported, "--scheme", "int8-per-channel", "--awq"],
              {"compress": {"scheme": "int8-per-channel", "awq": True}}),
             (["compress", exported, "--gptq"], {"compress": {"scheme": "int4-grouped", "gptq": True}}),
             (["compress", exported, "--ratio", "0.5", "--scheme", "int8-per-head"],
              {"compress": {"scheme": "int8-per-head", "ratio": 0.5}}),
             (["export", MODEL, "--moe", "fused-onnxruntime", "--parity", "openvino"],
              {"export": {"moe": "fused-onnxruntime", "parity": ["openvino"]}})]
    for args, sections in cases:
        recipe = tmp_path / "bad.yaml"
        recipe.write_text(yaml.safe_dump({"name": "r", "model": MODEL, "compile": {"backend": "onnxruntime"},
                                          **sections}))
        with pytest.raises(RecipeError) as refused:
            load_recipe(recipe)
        problem = str(refused.value).rsplit(f"{next(iter(sections))}: ", 1)[1]  # after the file and the section
        out = tmp_path / "refused"
        assert_one_line_error(*run_cli(monkeypatch, capsys, *args, "-o", out), problem)
        assert not out.exists()
    # a single field's bounds are the section's, named as the option
    assert_one_line_error(*run_cli(monkeypatch, capsys, "export", MODEL, "-o", tmp_path / "x", "--parity", "tpu"),
                          "--parity: Input should be 'openvino' or 'onnxruntime'")


def test_optimize_command_records_no_parity_in_its_stage_only_when_asked(monkeypatch, capsys, tmp_path, cache):
    from toolchain.build import plan
    from toolchain.models.registry import embedded_path

    exported = tmp_path / "e"
    assert run_cli(monkeypatch, capsys, "export", MODEL, "-o", exported, "--parity", "none")[0] == 0
    code, err = run_cli(monkeypatch, capsys, "optimize", exported, "-o", tmp_path / "o", "--backend", "onnxruntime",
                        "--no-parity", "--passes", "infer-shapes,fuse-rms-norm")
    assert code == 0, err
    record = StageRecord.read(tmp_path / "o" / STAGE_RECORD)
    assert record.config == {"target": "onnxruntime", "passes": ["infer-shapes", "fuse-rms-norm"], "expect": None,
                             "parity": False}
    passes = json.loads((tmp_path / "o" / "passes.json").read_text())
    assert passes["pipeline"] == ["infer-shapes", "fuse-rms-norm"] and "parity" not in passes
    assert_one_line_error(*run_cli(monkeypatch, capsys, "optimize", exported, "-o", tmp_path / "p", "--backend",
                                   "onnxruntime", "--passes", "no-such-pass"), "no-such-pass")
    # a recipe's passes stage (parity on) has the configuration it had before the option existed
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": MODEL, "passes": {"target": "openvino"},
                                      "compress": {"scheme": "int4-grouped"}, "compile": {"backend": "openvino"}}))
    stages = {s.name: s.config for s in plan(load_recipe(recipe), embedded_path(MODEL))}
    assert stages["passes"] == {"target": "openvino", "passes": None, "expect": None}
    assert stages["compress"]["target"] == "openvino"  # the compress stage's output depends on the backend


def test_the_stage_commands_name_the_runtime_backend_and_still_take_target(monkeypatch, capsys, tmp_path):
    """One name for the runtime a stage builds for (compile's --backend); --target, the former name of optimize's,
    compress's and passes list's, still works with a warning, and both at once are refused."""
    from conftest import run_cli as run_with_output

    code, out, err = run_with_output(monkeypatch, capsys, "passes", "list", "--target", "openvino")
    assert code == 0 and "dstc: warning: --target is now --backend" in err
    assert out == run_with_output(monkeypatch, capsys, "passes", "list", "--backend", "openvino")[1]
    assert_one_line_error(*run_cli(monkeypatch, capsys, "passes", "list", "--backend", "openvino", "--target",
                                   "openvino"), "--backend given twice")
    for command in ("optimize", "compress"):
        help_text = run_with_output(monkeypatch, capsys, command, "--help")[1]
        assert "--backend" in help_text and "--target" not in help_text
    assert_one_line_error(*run_cli(monkeypatch, capsys, "optimize", tmp_path / "none", "-o", tmp_path / "o"),
                          "--backend")
