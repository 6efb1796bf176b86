"""`dstc compare`: the same evaluation, in one run, of several artifacts (typically one recipe built for
ONNX Runtime and for OpenVINO), so that their latencies are ratios measured side by side."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from toolchain.evaluate.run import evaluate_artifact
from toolchain.interface.reports import CompressionReport, ExportReport
from toolchain.manifest_schema import Manifest
from toolchain.reference.choice import resolve_reference
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


def build_facts(manifest: Manifest | None) -> dict[str, str]:
    """What an artifact was built with beyond its runtime, from its manifest: a comparison of two builds of "one
    recipe" shows where they differ (GPTQ + INT8 q_a/kv_a on one side, RTN on the other) before any figure."""
    if manifest is None:
        return {}
    recipe, stages = manifest.recipe, {row.name: row.config for row in manifest.stages}
    facts: dict[str, str] = {"backend": recipe.compile.backend}
    export = manifest.provenance.report("export", ExportReport)
    facts["MoE lowering"] = str(stages.get("export", {}).get("moe", recipe.export.moe))
    if export is not None:
        facts["KV cache"] = export.graph.kv_cache
    compression = manifest.provenance.report("compress", CompressionReport)
    if compression is None:
        facts["weights"] = "float32 (not compressed)"
        return facts
    options = compression.options
    methods = [name for name, on in (("GPTQ", options.gptq), ("AWQ", options.awq),
                                     ("scale estimation", options.scale_estimation)) if on]
    facts["weights"] = compression.scheme + (f" g{options.group_size} {'sym' if options.sym else 'asym'}"
                                             if compression.scheme == "int4-grouped" else "")
    facts["method"] = ", ".join(methods) or "data-free (RTN)"
    facts["INT8 weights"] = ", ".join(compression.policy.int8_scope) or "none"
    if compression.weights.bits_per_weight is not None:
        facts["bits per weight"] = f"{compression.weights.bits_per_weight:.2f}"
    if options.prefill_int8:
        facts["prefill int8 copy"] = "yes"
    return facts


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
