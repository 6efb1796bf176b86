"""The pass registry: names, targets, descriptions, lookups."""

from __future__ import annotations

import ast
from pathlib import Path

import onnx_ir as ir
import pytest
from passes_helpers import make_model, node

from passes import CountedResult, PassError, create_pass, get_pass, list_passes, registry

GENERIC = {"cse", "eliminate-transposes", "fold-batchnorm", "fold-constants", "fuse-matmul-add-gemm",
           "infer-shapes", "remove-unused"}


@pytest.fixture
def scratch_registry(monkeypatch):
    """Lets a test register passes without leaking them into the real registry."""
    registry._load()
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_list_passes_rows():
    rows = list_passes()
    assert {row["name"] for row in rows} >= GENERIC
    assert [row["name"] for row in rows] == sorted(row["name"] for row in rows)
    for row in rows:
        assert set(row) == {"name", "targets", "description"}
        assert row["targets"] and set(row["targets"]) <= {"any", "onnxruntime", "openvino"}
        assert row["description"] and "\n" not in row["description"]


def test_list_passes_by_target(scratch_registry):
    @registry.register("ort-only-test", description="A pass only for ONNX Runtime.", targets=("onnxruntime",))
    class OrtOnly(ir.passes.InPlacePass):
        def call(self, model):
            return ir.passes.PassResult(model, False)

    ort_names = {row["name"] for row in list_passes("onnxruntime")}
    ov_names = {row["name"] for row in list_passes("openvino")}
    assert "ort-only-test" in ort_names and "ort-only-test" not in ov_names
    assert GENERIC <= ort_names and GENERIC <= ov_names
    with pytest.raises(PassError, match="unknown target"):
        list_passes("tensorrt")


def test_unknown_pass_suggests_the_closest_name():
    with pytest.raises(PassError, match="did you mean 'fold-batchnorm'"):
        get_pass("fold-batchnrom")


@pytest.mark.parametrize(
    "name, targets, description",
    [("Bad_Name", ("any",), "ok"), ("good-name", ("tensorrt",), "ok"), ("good-name", ("any",), "two\nlines")],
)
def test_register_rejects_bad_entries(scratch_registry, name, targets, description):
    with pytest.raises(ValueError):
        registry.register(name, description=description, targets=targets)


def test_every_registered_pass_is_in_place_and_counts():
    model = make_model([node("Relu", ["x"], ["y"])], {"x": [2, 3]}, ["y"])
    for name in GENERIC:
        pass_ = create_pass(name)
        assert pass_.in_place, name
        result = pass_(model)
        assert isinstance(result, CountedResult) and result.model is model, name


def test_passes_import_only_public_onnxscript_apis_and_never_toolchain():
    """Private onnxscript modules (a path segment starting with '_') change without notice between versions."""
    root = Path(__file__).resolve().parents[2] / "passes"
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in modules:
                parts = module.split(".")
                if parts[0] == "toolchain" or (parts[0] == "onnxscript" and any(p.startswith("_") for p in parts)):
                    bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: {module}")
    assert bad == []
