"""docs/recipe.md's key tables and recipes/recipe.schema.json are what toolchain/recipe_reference.py writes from the
recipe's models (regenerate with `python -m toolchain.recipe_reference`), every key has its meaning, and the JSON
Schema accepts every shipped recipe and refuses a misspelt key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from toolchain import recipe_reference
from toolchain.recipe import Recipe

REPO = Path(__file__).resolve().parent.parent


def test_the_reference_and_the_schema_are_generated_from_the_models():
    assert recipe_reference.DOC.read_text() == recipe_reference.rendered_doc(recipe_reference.DOC.read_text()), \
        "docs/recipe.md is stale: python -m toolchain.recipe_reference"
    assert recipe_reference.SCHEMA.read_text() == recipe_reference.generated_schema(), \
        "recipes/recipe.schema.json is stale: python -m toolchain.recipe_reference"


def test_every_key_of_every_section_has_its_meaning():
    missing = [f"{model.__name__}.{name}" for model in (Recipe, *(m for _, m in recipe_reference._sections()))
               for name, field in model.model_fields.items() if not field.description]
    assert missing == []


def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(recipe_reference.SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_the_schema_accepts_each_shipped_recipe(path):
    data = yaml.safe_load(path.read_text())
    errors = [e.message for e in _validator().iter_errors(data)]
    assert errors == []


def test_the_schema_refuses_a_misspelt_key():
    data = {"name": "r", "model": "m", "compile": {"backend": "openvino"}, "compress": {"scheme": "int4-grouped",
                                                                                      "grup_size": 64}}
    assert any("grup_size" in e.message for e in _validator().iter_errors(data))
    anchored = {**data, "x-base": {"backend": "openvino"}}
    del anchored["compress"]
    assert list(_validator().iter_errors(anchored)) == []
