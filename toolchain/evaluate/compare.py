"""`dstc compare`: the same evaluation, in one run, of several artifacts (typically one recipe built for
ONNX Runtime and for OpenVINO), so that their latencies are ratios measured side by side."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
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
    """One Report per artifact, in order; ``log(artifact, message)``. Each source model's PyTorch reference is
    loaded once for all the artifacts built from it."""
    from toolchain.evaluate.reference import TorchDecoder, resolve_reference
    from toolchain.runtime.artifact import open_artifact

    references: dict[tuple, TorchDecoder] = {}
    # Every artifact and its reference are checked before any is evaluated: a bad one fails at once.
    chosen = [resolve_reference(open_artifact(path).manifest, reference) for path in paths]
    reports = []
    for path, (source, choice) in zip(paths, chosen):
        key = (source.path, tuple(sorted(choice.items())))
        if key not in references:
            references[key] = TorchDecoder(source, settings.threads, choice)
        reports.append(evaluate_artifact(path, settings, reference_decoder=references[key],
                                         log=partial(log, str(path))))
    return reports
