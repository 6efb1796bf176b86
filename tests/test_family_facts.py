"""Family facts live in the family: outside toolchain/export/<family>*.py no code tells the model families apart
by ``isinstance(arch, <Family>Architecture)`` or by comparing a ``model_type`` with a family's name; it asks the
architecture (Architecture's attributes and hooks, e.g. mtp_block) instead. Qwen3-MoE shows what that buys: a
family in one module and a registry line."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAMILY_MODULES = ("deepseek", "llama", "qwen")  # toolchain/export/<family>*.py
# what an architecture can do, not which family it is: asking for the capability is the hook
CAPABILITIES = ("Architecture", "MoeArchitecture")


def _is_family_module(path: Path) -> bool:
    return path.parent == REPO / "toolchain" / "export" and path.name.startswith(FAMILY_MODULES)


def _names_model_type(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "model_type") or \
        (isinstance(node, ast.Name) and node.id == "model_type")


def _literal_strings(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def family_checks(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_model_type(s) for s in sides) and any(_literal_strings(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(k, ast.Name) and k.id.endswith("Architecture") and k.id not in CAPABILITIES
                   for k in kinds):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_family_is_told_apart_outside_its_module():
    offenders = [f"{path.relative_to(REPO)}:{line}: {text}"
                 for root in ("toolchain", "passes") for path in sorted((REPO / root).rglob("*.py"))
                 if not _is_family_module(path) for line, text in family_checks(path.read_text())]
    assert offenders == []


def test_the_check_finds_what_it_forbids():
    source = ('if config.model_type == "deepseek_v4": pass\n'
              'if model_type in ("deepseek_v3", "deepseek_v32"): pass\n'
              "if isinstance(arch, DeepseekV4Architecture): pass\n"
              "if isinstance(arch, Architecture) and arch.exports_mtp and model_type == other: pass\n")
    assert [line for line, _ in family_checks(source)] == [1, 2, 3]
