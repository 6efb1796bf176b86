"""The recipe's reference, written from its models: docs/recipe.md's key tables and recipes/recipe.schema.json (a
JSON Schema editors validate recipes with). Both are generated, so that they cannot drift from toolchain/recipe.py;
tests/test_recipe_reference.py checks the files against this output.

    python -m toolchain.recipe_reference   # rewrites both files
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from toolchain.recipe import Recipe

REPO = Path(__file__).resolve().parent.parent
DOC, SCHEMA = REPO / "docs" / "recipe.md", REPO / "recipes" / "recipe.schema.json"
BEGIN, END = "<!-- generated: python -m toolchain.recipe_reference -->", "<!-- end of generated part -->"


def _type(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " \\| ".join(_type(a) for a in parts) + (" or null" if len(parts) < len(typing.get_args(annotation))
                                                          else "")
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    value = field.default_factory() if field.default_factory else field.default
    if value is PydanticUndefined or isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value)}`"


def _section(model: type[BaseModel]) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        text = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {text} |")
    return rows


def _sections() -> list[tuple[str, type[BaseModel]]]:
    found = []
    for name, field in Recipe.model_fields.items():
        annotation = field.annotation
        model = next((a for a in (annotation, *typing.get_args(annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is not None:
            found.append((name, model))
    return found


def generated_markdown() -> str:
    lines = [BEGIN, "", "### Top level", "", *_section(Recipe)]
    for name, model in _sections():
        lines += ["", f"### `{name}:`", "", *_section(model)]
        for field_name, field in model.model_fields.items():  # a mapping of sections (serve.thresholds)
            inner = typing.get_args(field.annotation)
            if inner and isinstance(inner[-1], type) and issubclass(inner[-1], BaseModel):
                lines += ["", f"#### each entry of `{name}.{field_name}`", "", *_section(inner[-1])]
    return "\n".join([*lines, "", END])


def generated_schema() -> str:
    schema = Recipe.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "dstc recipe"
    schema["patternProperties"] = {"^x-": {}}  # what a recipe's YAML anchors name (toolchain/recipe.py ANCHOR_PREFIX)
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def rendered_doc(current: str) -> str:
    """docs/recipe.md with its generated part replaced (the prose around it is kept)."""
    head, _, rest = current.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + generated_markdown() + tail


def main() -> None:
    DOC.write_text(rendered_doc(DOC.read_text()))
    SCHEMA.write_text(generated_schema())
    print(f"wrote {DOC} and {SCHEMA}")


if __name__ == "__main__":
    main()
