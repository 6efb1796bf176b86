"""The import graph of toolchain/ and passes/, read from the code with ``ast`` (nothing is imported): no module
reaches itself through its imports, passes/ stands on its own, and the graph/artifact contract
(toolchain/interface/) stands below everything that reads or writes graphs and artifacts.

Every import of a project module counts, wherever it is written: at the top of a file, inside a function or under
``if TYPE_CHECKING``. An import moved into a function still makes the module depend on the other one; it only
hides a circle from the interpreter.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("toolchain", "passes")
CONTRACT = "toolchain.interface"
# What the contract may stand on: nothing of the toolchain but its error types.
CONTRACT_MAY_IMPORT = ("toolchain.errors",)


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The project module an imported name lives in (``toolchain.a.b.NAME`` -> ``toolchain.a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> dict[str, int]:
    """The project modules ``module`` imports (absolute names), each with the line of its first import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            owner = _owner(name) if name.split(".")[0] in PACKAGES else None
            if owner and owner != module:
                found.setdefault(owner, node.lineno)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(circle: list[str]) -> str:
    members = set(circle)
    arrows = [f"  {a} -> {b} ({MODULES[a].relative_to(ROOT)}:{line})"
              for a in circle for b, line in sorted(GRAPH[a].items()) if b in members]
    return "\n".join([f"circle of {len(circle)} modules:", *arrows])


def test_the_reader_sees_the_packages():
    """The graph is read at all: the modules are found and their imports resolved (a test that reads nothing
    passes whatever the code does)."""
    assert len(MODULES) > 100
    assert "toolchain.errors" in GRAPH["toolchain.cli"]
    assert GRAPH["toolchain.__main__"] == {"toolchain.cli": 1}


def test_circle_detection_finds_a_circle():
    assert _circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b": 1}, "b": {}}) == []


def test_no_module_imports_itself_through_others():
    circles = _circles(GRAPH)
    assert not circles, "\n".join(_describe(c) for c in circles)


def test_passes_never_import_the_toolchain():
    """passes/ is a library of graph rewrites over onnx_ir; the toolchain runs it, never the other way round."""
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
             for m, targets in GRAPH.items() if m.split(".")[0] == "passes"
             for target, line in targets.items() if target.split(".")[0] == "toolchain"]
    assert not wrong, "\n".join(wrong)


def test_the_contract_stands_below_the_stages_and_runtimes():
    """toolchain/interface/ owns the graph's names, the cache spec, the artifact's file names and the stage
    reports; what writes or reads them (export, compile, runtime, stages, ...) imports it, never the reverse."""
    contract = [m for m in MODULES if m == CONTRACT or m.startswith(CONTRACT + ".")]
    assert CONTRACT in contract
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}" for m in contract
             for target, line in GRAPH[m].items()
             if not target.startswith(CONTRACT) and target not in CONTRACT_MAY_IMPORT]
    assert not wrong, "\n".join(wrong)
