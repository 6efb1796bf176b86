"""Property-based fuzzing (hypothesis) of everything dstc reads from a user's disk: recipes, report.json,
manifest.json, a checkpoint's config.json and safetensors headers. Whatever the input, the reader returns a
result or raises one of dstc's own errors (the CLI's one-line exit 2), never anything else."""

from __future__ import annotations

import json
import shutil
import struct
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolchain import source as sources
from toolchain.errors import DstcError
from toolchain.manifest import verify_artifact
from toolchain.recipe import load_recipe
from toolchain.report.schema import load_report

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "toolchain/models/embedded/r1-distill-qwen-tiny"
# 500 inputs per reader in the default suite (its time budget); DSTC_FUZZ_EXAMPLES=2000 for a longer search
FUZZ = settings(max_examples=int(os.environ.get("DSTC_FUZZ_EXAMPLES", "500")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def mutations(document: dict):
    """``document`` with one value somewhere replaced by an arbitrary JSON value (or a key removed/added)."""
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                paths.append((*path, key))
                walk(value, (*path, key))

    walk(document, ())

    @st.composite
    def mutate(draw):
        doc = json.loads(json.dumps(document))
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(json_values)
        elif action == "delete":
            del parent[path[-1]]
        else:
            parent[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
        return doc

    return mutate()


def only_dstc_errors(call) -> None:
    try:
        call()
    except DstcError:
        pass


# -- recipes --------------------------------------------------------------------------------------------------------

VALID_RECIPE = {"name": "r", "model": "r1-distill-qwen-tiny", "export": {"parity": ["onnxruntime"], "new_tokens": 4},
                "passes": {"target": "onnxruntime"}, "compress": {"scheme": "int4-grouped", "group_size": 64},
                "compile": {"backend": "onnxruntime", "verify": True}, "gates": {"min_top1_agreement": 0.9}}


@FUZZ
@given(doc=mutations(VALID_RECIPE))
def test_recipe_loader_mutated_recipes(tmp_path, doc):
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    only_dstc_errors(lambda: load_recipe(path))


@FUZZ
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_recipe_loader_arbitrary_text(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    only_dstc_errors(lambda: load_recipe(path))


# -- report.json and manifest.json --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report_doc():
    from test_gates import report

    return report().dump()


@FUZZ
@given(data=st.data())
def test_report_reader(tmp_path, report_doc, data):
    doc = data.draw(mutations(report_doc) | json_values)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    only_dstc_errors(lambda: load_report(path))


@pytest.fixture(scope="module")
def manifest_doc():
    from toolchain.hashing import self_digest
    from toolchain.manifest_schema import Manifest
    from toolchain.interface.reports import CompileReport

    compiled = CompileReport(dstc_version="0", backend="onnxruntime", export={}, model_type="qwen2", tokenizer=True,
                             files=["model.onnx"])
    doc = Manifest(schema_version=1, dstc_version="0", git_commit=None, recipe=VALID_RECIPE, recipe_sha256="0" * 64,
                   source={"model": "m", "revision": None, "kind": "embedded", "files": {"config.json": "0" * 64}},
                   stages=[{"name": "compile", "id": "1", "parent": "0", "config": {"backend": "onnxruntime"}}],
                   versions={"dstc": "0"}, seeds={"parity_prompts": 0}, nondeterministic={},
                   files={"model.onnx": "0" * 64},
                   provenance={"built_at": "", "host": "", "output": "", "durations_s": {"compile": 1.0},
                               "cached_stages": [], "stage_reports": {"compile/compile.json": compiled}},
                   digest="").dump()
    return {**doc, "digest": self_digest(doc)}


@FUZZ
@given(data=st.data())
def test_manifest_reader(tmp_path, manifest_doc, data):
    doc = data.draw(mutations(manifest_doc) | json_values)
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    only_dstc_errors(lambda: verify_artifact(tmp_path))


# -- a checkpoint's config.json and safetensors ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "m"
    shutil.copytree(TINY, path)
    return path


@FUZZ
@given(data=st.data())
def test_config_reader(checkpoint, data):
    config = json.loads((TINY / "config.json").read_text())
    doc = data.draw(mutations(config))
    (checkpoint / "config.json").write_text(json.dumps(doc))
    only_dstc_errors(lambda: sources.resolve(str(checkpoint)))


def _safetensors(header: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + body


@FUZZ
@given(data=st.data())
def test_safetensors_reader(tmp_path, data):
    good = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).encode()
    blob = data.draw(st.one_of(
        st.binary(max_size=64),
        st.builds(_safetensors, st.binary(max_size=64), st.binary(max_size=32)),
        st.builds(_safetensors, json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=32)),
        st.builds(lambda cut: _safetensors(good, bytes(16))[:cut], st.integers(0, 40)),
    ))
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    shutil.copyfile(TINY / "config.json", model / "config.json")
    (model / "model.safetensors").write_bytes(blob)
    only_dstc_errors(lambda: sources.check_weights(sources.resolve(str(model))))
