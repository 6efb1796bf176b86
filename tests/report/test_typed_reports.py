"""compression.json, manifest.json and stage.json as typed documents (issue #13.4): what the writers dump is what
the readers parse back, byte for byte; an unknown key or another schema version is one InputError; an artifact
from before manifests had a schema is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from cli_helpers import assert_one_line_error, run_cli
from toolchain.errors import InputError
from toolchain.hashing import self_digest
from toolchain.interface.files import MANIFEST
from toolchain.manifest import read_manifest, verify_artifact
from toolchain.manifest_schema import Manifest
from toolchain.interface.reports import CompressionReport, StageRecord

MODEL = "r1-distill-qwen-tiny"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An INT8 artifact, its cached stages, and a streamed compression of the same export."""
    from toolchain.build import build
    from toolchain.recipe import CompressSection
    from toolchain.stages.alone import compress

    root = tmp_path_factory.mktemp("typed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(root / "cache"))
        recipe = root / "r.yaml"
        recipe.write_text(yaml.safe_dump({"name": "r", "model": MODEL, "export": {"parity": []},
                                          "compress": {"scheme": "int8-per-head", "sym": True},
                                          "compile": {"backend": "onnxruntime", "verify": False}}))
        build(recipe, root / "art")
        (export_dir,) = (root / "cache" / "stages").glob("export-*")
        compress(export_dir, root / "streamed", CompressSection(scheme="int4-grouped", streaming="always"))
    (compressed,) = (root / "cache" / "stages").glob("compress-*")
    return root / "art", compressed, root / "streamed"


def test_compression_json_round_trips_in_both_forms(built):
    _, whole, streamed = built
    for directory, is_streamed in ((whole, False), (streamed, True)):
        text = (directory / "compression.json").read_text()
        report = CompressionReport.read(directory / "compression.json")
        assert report.schema_ == "dstc.compression/1" and report.streaming is is_streamed
        assert json.dumps(report.dump(), indent=1) + "\n" == text  # nulls kept, absent keys left out
    whole_report = CompressionReport.read(whole / "compression.json")
    assert whole_report.model.top1_agreement is not None and whole_report.calibration is not None
    assert any(row.heads for row in whole_report.per_weight)  # per-head rows of q/k/v
    streamed_report = CompressionReport.read(streamed / "compression.json")
    assert streamed_report.model.top1_agreement is None and streamed_report.model.note
    assert all(row.output_error is None for row in streamed_report.per_weight)


def test_compression_json_refuses_unknown_keys_and_other_versions(built):
    _, whole, _ = built
    data = json.loads((whole / "compression.json").read_text())
    for changed, fragment in (({**data, "extra": 1}, "extra: Extra inputs are not permitted"),
                              ({**data, "schema": "dstc.compression/2"}, "not a dstc.compression/1"),
                              ({**data, "model": {**data["model"], "kl_mean": "x"}}, "model.kl_mean"),
                              ({k: v for k, v in data.items() if k != "schema"}, "not a dstc.compression/1")):
        with pytest.raises(InputError, match=fragment):
            CompressionReport.parse(changed, "compression.json")


def test_compression_json_options_and_policy_are_the_recipe_sections_fields():
    """compression.json's options are compress-section fields by their names, its policy the section's policy
    fields (ignore and int8 as the scopes they name), and its schemes the section's: nothing spelled twice."""
    from toolchain.compress.policy import SCHEMES, SCHEME_PRECISION, Policy
    from toolchain.interface.reports import CompressionOptions, CompressionPolicy
    from toolchain.recipe import CompressSection

    assert set(CompressionOptions.model_fields) <= set(CompressSection.model_fields)
    section = CompressSection(scheme="int4-grouped", ignore=["a"], int8=["b"], router="int8")
    assert CompressionPolicy(**Policy.of(section).as_dict()) == CompressionPolicy(
        embeddings="int8", lm_head="int8", router="int8", shared_experts="scheme", ignored_scope=["a"],
        int8_scope=["b"])
    assert set(SCHEMES) == set(SCHEME_PRECISION) == set(CompressionReport.model_fields["scheme"].annotation.__args__)


def test_stage_record_round_trips(built):
    _, whole, _ = built
    text = (whole / "stage.json").read_text()
    record = StageRecord.read(whole / "stage.json")
    assert record.name == "compress" and record.config["target"] == "onnxruntime"
    assert json.dumps(record.dump(), indent=2) + "\n" == text
    with pytest.raises(InputError, match="extra"):
        StageRecord.parse({**json.loads(text), "extra": 1})


def test_manifest_round_trips_byte_for_byte_and_is_typed(built):
    artifact, _, _ = built
    text = (artifact / MANIFEST).read_text()
    manifest = read_manifest(artifact)
    assert isinstance(manifest, Manifest) and manifest.schema_ == "dstc.manifest/1" and manifest.schema_version == 1
    assert json.dumps(manifest.dump(), indent=2) + "\n" == text  # the digest and any signature stay valid
    data = json.loads(text)
    assert list(data)[:2] == ["schema", "schema_version"] and data["digest"] == self_digest(data)
    assert manifest.recipe.compress.scheme == "int8-per-head"
    compression = manifest.provenance.report("compress", CompressionReport)
    assert compression is not None and compression.scheme == "int8-per-head"
    assert manifest.provenance.report("passes", CompressionReport) is None


def test_a_manifest_with_an_unknown_key_or_another_schema_is_refused(monkeypatch, capsys, tmp_path, built):
    artifact, _, _ = built
    data = json.loads((artifact / MANIFEST).read_text())
    for changed, fragment in (({**data, "extra": 1}, "extra: Extra inputs are not permitted"),
                              ({**data, "schema": "dstc.manifest/2"}, "is not a dstc manifest"),
                              ({**data, "recipe": {**data["recipe"], "nope": 1}}, "recipe.nope")):
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(artifact, copy)
        (copy / MANIFEST).write_text(json.dumps({**changed, "digest": self_digest(changed)}, indent=2) + "\n")
        with pytest.raises(InputError, match=fragment):
            read_manifest(copy)
        assert_one_line_error(*run_cli(monkeypatch, capsys, "verify", copy), fragment)


def test_an_artifact_from_before_manifests_had_a_schema_is_one_line_exit_2(monkeypatch, capsys, tmp_path, built):
    artifact, _, _ = built
    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    data = json.loads((old / MANIFEST).read_text())
    data.pop("schema")
    (old / MANIFEST).write_text(json.dumps({**data, "digest": self_digest(data)}, indent=2) + "\n")
    for command in (["verify", old], ["generate", old, "1+2=", "--raw"], ["eval", old, "--no-latency"]):
        assert_one_line_error(*run_cli(monkeypatch, capsys, *command), "written by an earlier dstc")
    with pytest.raises(InputError, match="build the artifact again"):
        verify_artifact(old)


def test_an_edited_manifest_is_a_finding_even_when_it_no_longer_validates(tmp_path, built):
    artifact, _, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    data = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**data, "files": "none"}))
    problems = verify_artifact(copy)
    assert problems[0] == "changed: manifest.json (its content does not match its digest)"
    assert "files" in problems[1] and len(problems) == 2


def test_build_summary_reads_the_typed_manifest(monkeypatch, capsys, built):
    from toolchain.cli import _stage_check

    artifact, _, _ = built
    provenance = read_manifest(artifact).provenance
    assert "bits/w, top-1" in _stage_check("compress", provenance)
    assert _stage_check("passes", provenance) == ""


def test_eval_reads_quantization_rows_from_the_typed_manifest(built):
    from toolchain.evaluate.run import quantization_series

    artifact, _, _ = built
    layers, heads = quantization_series(read_manifest(artifact))
    assert layers and heads and {row.precision for row in layers} == {"int8-sym-per-axis"}
    assert quantization_series(None) == ([], [])
    assert not (artifact / "stage.json").exists()  # stage records stay in the cache


def test_the_manifest_says_which_runtimes_load_the_artifact(tmp_path, built):
    """loads_with, from the artifact's files (toolchain/deployment.py): this ONNX Runtime build of a dense model
    has genai_config.json, so onnxruntime-genai loads it too; the build summary prints it. A manifest written before
    the field reads without it, byte for byte."""
    from toolchain.cli import _loads_with_line
    from toolchain.deployment import loads_with

    artifact, _, _ = built
    manifest = read_manifest(artifact)
    assert "genai_config.json" in manifest.files
    assert manifest.loads_with == loads_with(manifest.files) == ["dstc", "onnxruntime-genai"]
    assert _loads_with_line(manifest) == "loads with: dstc, onnxruntime-genai"
    assert loads_with(["openvino_model.xml", "openvino_model.bin"]) == ["dstc", "openvino_genai", "optimum-intel"]
    assert loads_with(["model.onnx", "model.onnx.data", "config.json"]) == ["dstc"]
    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    data = json.loads((old / MANIFEST).read_text())
    data.pop("loads_with")
    text = json.dumps({**data, "digest": self_digest(data)}, indent=2) + "\n"
    (old / MANIFEST).write_text(text)
    before = read_manifest(old)
    assert before.loads_with is None and json.dumps(before.dump(), indent=2) + "\n" == text
    assert verify_artifact(old) == []
