"""`dstc compare`: the same evaluation, in one run, of several artifacts (typically one recipe built for
ONNX Runtime and for OpenVINO), so that their latencies are ratios measured side by side."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from toolchain.evaluate.reference import resolve_reference
from toolchain.evaluate.run import evaluate_artifact
from toolchain.report.schema import Report
from toolchain.runtime.artifact import open_artifact
from toolchain.settings.evaluation import EvalSettings


def labels_for(reports: list[Report]) -> list[str]:
    """Short column names: the backends when they differ, else recipe names, else paths."""
    for key in ("backend", "recipe", "path"):
        names = [str(r.artifact.get(key)) for r in reports]
        if len(set(names)) == len(names):
            return names
    return [f"{i}:{r.artifact.get('path')}" for i, r in enumerate(reports)]


def compare_artifacts(paths: list[Path], settings: EvalSettings, *, reference: str | None = None,
                      log: Callable[[str, str], None] = lambda _a, _m: None) -> list[Report]:
    """One Report per artifact, in order; ``log(artifact, message)``. The reference's outputs are computed once
    for all the artifacts of one source model and data (kept in memory here even when the cache is off)."""
    # Every artifact and its reference are checked before any is evaluated: a bad one fails at once.
    for path in paths:
        resolve_reference(open_artifact(path).manifest, reference)
    records: dict = {}
    return [evaluate_artifact(path, settings, reference=reference, records=records, log=partial(log, str(path)))
            for path in paths]
