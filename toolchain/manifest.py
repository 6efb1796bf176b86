"""manifest.json: what an artifact is made of, hashed so that it can be verified and reproduced.

Everything a rebuild must reproduce (recipe, source files, stage ids, output file hashes, versions, seeds) sits
at the top level; time, host, durations, cache hits and the stages' own reports go under "provenance", which
no hash covers and no comparison reads.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path

from toolchain import __version__

MANIFEST = "manifest.json"
# Written by `dstc eval` into the artifact: measured latencies and the host, so no hash covers them.
REPORT_FILES = ("report.json", "report.md", "report.html")
UNHASHED = (MANIFEST, *REPORT_FILES)
SCHEMA_VERSION = 1
# Packages whose code reads or writes the model on its way to an artifact.
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "onnx", "onnx-ir", "onnxscript",
            "onnxruntime", "openvino", "openvino-tokenizers", "nncf", "pydantic", "pyyaml")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file below root, by relative POSIX path."""
    return {p.relative_to(root).as_posix(): sha256_file(p)
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).as_posix() not in exclude}


def digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "dstc": __version__}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def code_digest() -> str:
    """Hash of the toolchain's own Python code: a stage id changes when the code that runs it changes."""
    root = Path(__file__).resolve().parent.parent
    files = sorted([*(root / "toolchain").rglob("*.py"), *(root / "passes").rglob("*.py")])
    return digest({p.relative_to(root).as_posix(): sha256_file(p) for p in files})


def git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_manifest(artifact: Path, fields: dict, provenance: dict) -> dict:
    manifest = {"schema_version": SCHEMA_VERSION, **fields,
                "files": file_hashes(artifact, exclude=UNHASHED), "provenance": provenance}
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def verify_artifact(artifact: Path) -> list[str]:
    """Problems found re-hashing the artifact against its manifest: changed, missing or extra files."""
    from toolchain.errors import InputError

    path = Path(artifact) / MANIFEST
    try:
        expected = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"{artifact} has no readable {MANIFEST}: not a dstc artifact") from None
    actual = file_hashes(Path(artifact), exclude=UNHASHED)
    problems = [f"changed: {name}" for name in sorted(expected) if name in actual and actual[name] != expected[name]]
    problems += [f"missing: {name}" for name in sorted(set(expected) - set(actual))]
    problems += [f"extra: {name}" for name in sorted(set(actual) - set(expected))]
    return problems
