"""manifest.json: what an artifact is made of, hashed so that it can be verified and reproduced.

Everything a rebuild must reproduce (recipe, source files, stage ids, output file hashes, versions, seeds) sits
at the top level; time, host, durations, cache hits and the stages' own reports go under "provenance", which
no file hash covers and no comparison reads. ``digest`` is the sha256 of everything but itself, so that an edited
manifest is detected; an Ed25519 signature over the whole file (``dstc sign``, toolchain/signing.py) proves who
built it.

The report files `dstc eval` writes into an artifact are not among ``files`` (their latencies differ from run to run,
so a rebuild never reproduces them): ``report`` records report.json's sha256 when eval writes it (record_report),
report.json records this manifest's digest without that entry and the sha256 of report.md / report.html, and a
digest of its own (toolchain/report/schema.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path

from toolchain import __version__
from toolchain.atomic import MARKER, write_file_atomically
from toolchain.deployment import loads_with
from toolchain.errors import InputError
from toolchain.hashing import digest, file_hashes, self_digest, sha256_file
from toolchain.interface.files import MANIFEST, REPORT_FILES, SIGNATURE
from toolchain.interface.reports import read_json_file
from toolchain.manifest_schema import Manifest
from toolchain.report.schema import check_report_binding, read_report_data
from toolchain.signing import load_private_key, verify_signature, write_signature

# The report files are written by `dstc eval` into the artifact: measured latencies and the host, so no hash
# covers them.
UNHASHED = (MANIFEST, SIGNATURE, MARKER, *REPORT_FILES)
SCHEMA_VERSION = 1
# Packages whose code reads or writes the model on its way to an artifact.
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "onnx", "onnx-ir", "onnxscript",
            "onnxruntime", "openvino", "openvino-tokenizers", "nncf", "pydantic", "pyyaml")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "dstc": __version__}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


# Modules that import a whole package by discovery rather than by name: passes.registry loads every pass module.
DISCOVERED = {"passes.registry": "passes"}


def module_closure(module: str) -> list[Path]:
    """The source files of ``module`` and of every toolchain/passes module it imports, directly or not, at the
    top of a file or inside a function (read from the code, nothing is imported)."""
    root = Path(__file__).resolve().parent.parent

    def file_of(name: str) -> Path | None:
        if name.split(".")[0] not in ("toolchain", "passes"):
            return None
        base = root.joinpath(*name.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    seen: dict[Path, None] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = file_of(name)
        if path is None or path in seen:
            continue
        seen[path] = None
        if name in DISCOVERED:
            found = root / DISCOVERED[name]
            todo += [".".join(f.relative_to(root).with_suffix("").parts) for f in found.rglob("*.py")]
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run first on import
        todo += _imported(path, name if path.name == "__init__.py" else name.rpartition(".")[0])
    return sorted(seen)


@functools.cache
def _imported(path: Path, package: str) -> tuple[str, ...]:
    """The modules a source file imports (absolute names), parsed once per process: a build's four stages share
    most of their closures, and parsing them was a second of every build."""
    import ast

    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return tuple(names)


def code_digest(module: str) -> str:
    """Hash of the code a stage runs: its module and everything of toolchain/ and passes/ it imports. A stage id
    changes when that code changes, and not when a report's plot or the CLI does."""
    root = Path(__file__).resolve().parent.parent
    return digest({p.relative_to(root).as_posix(): sha256_file(p) for p in module_closure(module)})


def git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_manifest(artifact: Path, fields: dict, provenance: dict) -> dict:
    """Write manifest.json from the build's fields (those of toolchain/manifest_schema.py Manifest but files,
    provenance and digest); returns its content."""
    files = file_hashes(artifact, exclude=UNHASHED)
    manifest = Manifest(schema_version=SCHEMA_VERSION, **fields, files=files, loads_with=loads_with(files),
                        provenance=provenance, digest="").dump()
    manifest["digest"] = self_digest(manifest)
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _manifest_data(path: Path) -> dict:
    """manifest.json's JSON, refused in one line when it is not a manifest this dstc reads."""
    data = read_json_file(path, "manifest")
    if "schema" not in data and data.get("schema_version") == SCHEMA_VERSION:
        raise InputError(f"{path} was written by an earlier dstc, before manifests had a schema (this one reads "
                         f"{Manifest.SCHEMA}): build the artifact again")
    if data.get("schema") != Manifest.SCHEMA:
        raise InputError(f"{path} is not a dstc manifest ({Manifest.SCHEMA}; schema: {str(data.get('schema'))[:40]!r})")
    return data


def read_manifest(artifact: Path) -> Manifest:
    """An artifact's manifest.json (toolchain/manifest_schema.py Manifest), checked against its own digest
    (InputError if unreadable, of another version or edited)."""
    path = Path(artifact) / MANIFEST
    if not path.is_file():
        raise InputError(f"{artifact} has no {MANIFEST}: not a dstc artifact")
    data = _manifest_data(path)
    if data.get("digest") != self_digest(data):
        raise InputError(f"{path} was changed after dstc wrote it (its content does not match its digest)")
    return Manifest.parse(data, str(path))


def record_report(artifact: Path, report_sha256: str) -> None:
    """Record report.json's sha256 in the artifact's manifest (its ``report`` entry and digest rewritten). A
    signature made before no longer matches: the report it vouched for was replaced."""
    path = Path(artifact) / MANIFEST
    data = _manifest_data(path)
    if data.get("digest") != self_digest(data):
        raise InputError(f"{path} was changed after dstc wrote it (its content does not match its digest): "
                         f"refusing to record a report in it")
    data = {**data, "report": {REPORT_FILES[0]: report_sha256}}
    data["digest"] = self_digest(data)
    write_file_atomically(path, json.dumps(data, indent=2) + "\n")


def verify_artifact(artifact: Path, public_key: Path | None = None) -> list[str]:
    """Problems found checking the artifact: manifest.json against its digest (and signature, given a public
    key), every file against the manifest (changed, missing, extra), and the report files against report.json
    and report.json against the manifest."""
    artifact = Path(artifact)
    if not (artifact / MANIFEST).is_file():
        raise InputError(f"{artifact} has no {MANIFEST}: not a dstc artifact")
    data = _manifest_data(artifact / MANIFEST)
    problems = []
    if data.get("digest") != self_digest(data):
        # an edited manifest is a finding like a changed file; what it still lists is checked too
        problems.append(f"changed: {MANIFEST} (its content does not match its digest)")
    try:
        expected = Manifest.parse(data, MANIFEST).files
    except InputError as e:
        if not problems:
            raise
        return [*problems, str(e)]
    if public_key is not None:
        problems += verify_signature(artifact / MANIFEST, artifact / SIGNATURE, public_key)
    actual = file_hashes(artifact, exclude=UNHASHED)
    problems += [f"changed: {name}" for name in sorted(expected) if name in actual and actual[name] != expected[name]]
    problems += [f"missing: {name}" for name in sorted(set(expected) - set(actual))]
    problems += [f"extra: {name}" for name in sorted(set(actual) - set(expected))]
    recorded = data.get("report") or {}
    if not (artifact / REPORT_FILES[0]).is_file() and recorded:
        problems.append(f"missing: {REPORT_FILES[0]} (recorded in {MANIFEST})")
    if (artifact / REPORT_FILES[0]).is_file():
        try:
            report = read_report_data(artifact / REPORT_FILES[0])
            check_report_binding(report, artifact, artifact / REPORT_FILES[0])
        except InputError as e:
            return [*problems, f"report: {e}"]
        for name, sha in (report.get("files") or {}).items():
            if not (artifact / name).is_file():
                problems.append(f"missing: {name} (listed in report.json)")
            elif sha256_file(artifact / name) != sha:
                problems.append(f"changed: {name} (since dstc eval wrote it)")
    return problems


def sign_artifact(artifact: Path, key_path: Path) -> Path:
    """Sign ARTIFACT's manifest.json after checking every file against it; returns the signature's path."""
    artifact = Path(artifact)
    key = load_private_key(key_path)
    problems = verify_artifact(artifact)
    if problems:
        raise InputError(f"refusing to sign {artifact}: it does not match its manifest ({problems[0]}"
                         f"{f' and {len(problems) - 1} more' if len(problems) > 1 else ''})")
    return write_signature(artifact / MANIFEST, key)
