"""`dstc compare`: the same evaluation, in one run, of several artifacts (typically one recipe built for
ONNX Runtime and for OpenVINO), so that their latencies are ratios measured side by side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolchain.evaluate.run import evaluate_artifact
from toolchain.evaluate.settings import EvalSettings
from toolchain.report.schema import Report


def labels_for(reports: list[Report]) -> list[str]:
    """Short column names: the backends when they differ, else recipe names, else paths."""
    for key in ("backend", "recipe", "path"):
        names = [str(r.artifact.get(key)) for r in reports]
        if len(set(names)) == len(names):
            return names
    return [f"{i}:{r.artifact.get('path')}" for i, r in enumerate(reports)]


def compare_artifacts(paths: list[Path], settings: EvalSettings, *, reference: str | None = None,
                      log: Callable[[str, str], None] = lambda _a, _m: None) -> list[Report]:
    """One Report per artifact, in order; ``log(artifact, message)``."""
    return [evaluate_artifact(p, settings, reference=reference, log=lambda m, p=p: log(str(p), m)) for p in paths]
