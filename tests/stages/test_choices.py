"""One decision in one place (issue #42): every choice a build leaves open (the MoE lowering, prefill_int8, the
CPU-dependent defaults, the backend) is taken by toolchain/stages/choices.py into a frozen plan, which refuses a choice
left open; the stages take ``(input, output, section, context)`` and decide nothing again; no function of stages/ is
over 60 lines. Read from the code with ``ast`` where the rule is about who decides, run where it is about the plan."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from pydantic import ValidationError

from toolchain.build_plan import BuildPlan
from toolchain.models.registry import embedded_path
from toolchain.recipe import CompressSection, ExportSection, Recipe

ROOT = Path(__file__).resolve().parents[2]
CHOICES = ROOT / "toolchain" / "stages" / "choices.py"
# The rules each choice follows, and the names a module calls to take it: only choices.py may call them (the
# recipe's own validator checks a recipe's sections when it loads; the recipe template checks what it writes).
DECIDERS = {"auto_lowering", "has_int8_dot_product", "problem", "with_prefill_int8", "resolve_moe"}
MAY_CHECK = {"problem": {ROOT / "toolchain" / "recipe.py", ROOT / "toolchain" / "recipe_template.py"}}


def _calls(path: Path) -> dict[str, int]:
    """The names ``path`` calls (``f(...)`` or ``x.f(...)``), each with its first line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name:
                found.setdefault(name, node.lineno)
    return found


def test_the_reader_sees_the_calls():
    """The check reads what it means to: choices.py calls every rule it owns."""
    assert {"auto_lowering", "has_int8_dot_product", "problem"} <= set(_calls(CHOICES))


def test_only_the_planner_takes_a_choice():
    wrong = [f"{path.relative_to(ROOT)}:{line} calls {name}"
             for path in sorted((ROOT / "toolchain").rglob("*.py")) if path != CHOICES
             for name, line in _calls(path).items()
             if name in DECIDERS and path not in MAY_CHECK.get(name, set())]
    assert not wrong, "\n".join(wrong)


def test_every_stage_takes_input_output_section_context():
    from toolchain.stages.compile import compile_artifact
    from toolchain.stages.compress import compress
    from toolchain.stages.export import export
    from toolchain.stages.optimize import optimize

    for stage in (export, optimize, compress, compile_artifact):
        params = inspect.signature(inspect.unwrap(stage)).parameters
        assert list(params)[2:] == ["section", "context"] and len(params) == 4, (stage.__name__, list(params))


def test_no_function_of_the_stages_is_over_60_lines():
    long = []
    for path in sorted((ROOT / "toolchain" / "stages").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {node.end_lineno - first + 1}")
    assert not long, "\n".join(long)


def test_a_plan_refuses_a_choice_left_open():
    with pytest.raises(ValidationError, match="export.moe is auto"):
        BuildPlan(model="m", export=ExportSection())
    with pytest.raises(ValidationError, match="prefill_int8 is open"):
        BuildPlan(backend="onnxruntime", compress=CompressSection(scheme="int4-grouped"))
    plan = BuildPlan(backend="onnxruntime", compress=CompressSection(scheme="int4-grouped", prefill_int8=False))
    with pytest.raises(ValidationError):
        plan.backend = "openvino"  # type: ignore[misc]  # frozen: what the stages read is what was planned


@pytest.mark.parametrize("int8_dot", [False, True])
def test_a_recipe_is_planned_once_and_recorded_as_planned(monkeypatch, int8_dot):
    """A MoE recipe on onnxruntime: auto becomes the fused lowering, and prefill_int8 this CPU's answer (the
    stages' configurations are the plan's sections, so their ids say what was built); the plan survives the
    manifest's JSON."""
    from toolchain.build import plan as stages_of_recipe
    from toolchain.stages import choices

    monkeypatch.setattr(choices, "has_int8_dot_product", lambda: int8_dot)
    recipe = Recipe(name="r", model="deepseek-v3-tiny", compile={"backend": "onnxruntime"},
                    compress={"scheme": "int4-grouped"})
    source = embedded_path("deepseek-v3-tiny")
    plan = choices.plan_recipe(recipe, source)
    assert plan.export is not None and plan.export.moe == "fused-onnxruntime"
    assert plan.compress is not None and plan.compress.prefill_int8 is int8_dot
    assert set(plan.decisions) == {"export.moe", "compress.prefill_int8"}
    assert BuildPlan.model_validate(plan.dump()) == plan
    stages = {s.name: s for s in stages_of_recipe(recipe, source)}
    assert stages["export"].section is not recipe.export and stages["export"].config["moe"] == "fused-onnxruntime"
    assert stages["compress"].config["prefill_int8"] is int8_dot and stages["compress"].plan == plan
