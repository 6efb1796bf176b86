"""The import graph of toolchain/ and passes/, read from the code with ``ast`` (nothing is imported): no module
reaches itself through its imports, no folder reaches itself through its neighbours either (in every folder, its
files and sub-folders stand on floors: each imports only what stands below it), passes/ stands on its own, and the
graph/artifact contract (toolchain/interface/) stands below everything that reads or writes graphs and artifacts.

Every import of a project module counts, wherever it is written: at the top of a file, inside a function or under
``if TYPE_CHECKING``. An import moved into a function still makes the module depend on the other one; it only
hides a circle from the interpreter. So an import of a project module inside a function is there for one reason,
a heavy dependency loaded late (torch, the runtimes, lm-evaluation-harness), and says so in a comment.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("toolchain", "passes")
CONTRACT = "toolchain.interface"
# What the contract may stand on: nothing of the toolchain but its error types, and the graph metadata keys the
# passes read, which passes/ owns (it never imports the toolchain).
CONTRACT_MAY_IMPORT = ("toolchain.errors", "passes.graph_contract")


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


def _floor_arrows(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], dict[tuple[str, str], list]]:
    """Each import ``a -> b`` seen from the folder that holds both: an arrow between the two entries of that folder
    (a file, or a sub-folder taken whole) that contain them, e.g. toolchain.export.mtp -> toolchain.checkpoint.reader
    is the arrow export/ -> checkpoint/ of toolchain/. Keyed by folder, then by arrow: the imports drawing it."""
    arrows: dict[tuple[str, str], dict[tuple[str, str], list]] = {}
    for a, targets in graph.items():
        pa = _place(a)
        for b, line in targets.items():
            pb = _place(b)
            common = 0
            while common < min(len(pa), len(pb)) - 1 and pa[common] == pb[common]:
                common += 1
            if pa[common] == pb[common]:
                continue  # a package's face and a module inside it: not two entries of one folder
            folder = "".join(pa[:common]) or "./"
            arrows.setdefault(folder, {}).setdefault((pa[common], pb[common]), []).append((a, b, line))
    return arrows


def _place(module: str) -> list[str]:
    """Where a module stands: the folders its file is in, then the file (a package's __init__.py is a file of its
    folder)."""
    *folders, file = MODULES[module].relative_to(ROOT).parts
    return [*(f"{folder}/" for folder in folders), file]


def _arrows_back_up(graph: dict[str, dict[str, int]]) -> list[str]:
    """For every folder whose entries do not stand on floors (their arrows go round), the arrows that go round."""
    found = []
    for folder, arrows in sorted(_floor_arrows(graph).items()):
        entries = {a: dict.fromkeys(b for (x, b) in arrows if x == a) for (a, _) in arrows}
        for circle in _circles(entries):
            members = set(circle)
            found.append(f"in {folder}, {' <-> '.join(circle)} import each other:")
            found += [f"  {a} -> {b} ({MODULES[a].relative_to(ROOT)}:{line})"
                      for (x, y), imports in sorted(arrows.items()) if x in members and y in members
                      for a, b, line in imports]
    return found


def test_folder_floors_see_folders_whole():
    """The arrows of a folder are those between its entries, however deep the files that draw them."""
    graph = {"toolchain.export.mtp": {"toolchain.checkpoint.reader": 3, "toolchain.export.graph": 4},
             "toolchain.checkpoint.fp8": {"toolchain.export.architectures": 7},
             "toolchain.checkpoint.reader": {"toolchain.errors": 1}}
    assert _arrows_back_up(graph) == [
        "in toolchain/, checkpoint/ <-> export/ import each other:",
        "  toolchain.checkpoint.fp8 -> toolchain.export.architectures (toolchain/checkpoint/fp8.py:7)",
        "  toolchain.export.mtp -> toolchain.checkpoint.reader (toolchain/export/mtp.py:3)"]
    del graph["toolchain.checkpoint.fp8"]
    assert _arrows_back_up(graph) == []
    assert ("checkpoint/", "errors.py") in _floor_arrows(graph)["toolchain/"]


def test_no_import_runs_back_up_a_floor():
    """In toolchain/, passes/ and each folder inside them, the files and sub-folders stand on floors: no two import
    each other, directly or round a loop of others (a folder counts as one, whichever of its files import).
    Knowledge has one home, and what uses it stands above it."""
    wrong = _arrows_back_up(GRAPH)
    assert not wrong, "\n".join(wrong)


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


def _late_imports_without_reason(path: Path) -> list[int]:
    """Lines of the imports of project modules inside functions that no comment explains: the comment stands on
    the line above the run of import statements the import belongs to (blank lines between them allowed)."""
    lines = path.read_text().splitlines()
    found = []

    def visit(body: list[ast.stmt], in_function: bool) -> None:
        run_start = None  # first statement of the current run of imports
        for statement in body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                run_start = run_start or statement
                names = [a.name for a in statement.names] if isinstance(statement, ast.Import) else \
                    [statement.module or ""]
                project = getattr(statement, "level", 0) > 0 or any(n.split(".")[0] in PACKAGES for n in names)
                if in_function and project:
                    above = run_start.lineno - 2
                    while above >= 0 and not lines[above].strip():
                        above -= 1
                    if above < 0 or not lines[above].strip().startswith("#"):
                        found.append(statement.lineno)
                continue
            run_start = None
            inner = in_function or isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef))
            blocks = [getattr(statement, name, []) for name in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(statement, "handlers", [])]
            for block in blocks:
                if isinstance(block, list):
                    visit(block, inner)

    visit(ast.parse(path.read_text(), str(path)).body, False)
    return found


def test_imports_inside_functions_say_why():
    wrong = [f"{path.relative_to(ROOT)}:{line}" for path in MODULES.values()
             for line in _late_imports_without_reason(path)]
    assert not wrong, "imports of project modules inside functions without a comment giving the reason:\n" + \
        "\n".join(wrong)


def test_the_reason_check_reads_comments(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("import os\n\n\ndef f():\n    from toolchain import errors\n\n\n"
                    "def g():\n    # torch loads only here\n    import json\n\n    from toolchain import errors\n")
    assert _late_imports_without_reason(code) == [5]
