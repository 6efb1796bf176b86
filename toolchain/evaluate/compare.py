"""`dstc compare`: the same evaluation, in one run, of several artifacts (typically one recipe built for
ONNX Runtime and for OpenVINO), so that their latencies are ratios measured side by side."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from toolchain.evaluate import tasks
from toolchain.evaluate.latency import latency_settings, measure_latency_interleaved
from toolchain.evaluate.run import eval_latency_settings, evaluate_artifact, latency_plan
from toolchain.interface.reports import CompressionReport, ExportReport
from toolchain.manifest_schema import Manifest
from toolchain.memory_guard import available_memory_bytes, size
from toolchain.reference.choice import resolve_reference
from toolchain.report.schema import Report
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.memory import artifact_runtime_bytes
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
    for all the artifacts of one source model and data (kept in memory here even when the cache is off). Their
    latency is measured in interleaved rounds (A, B, A, B...) when they fit in memory together, else one after the
    other (the report's settings say which)."""
    # Every artifact and its reference are checked before any is evaluated: a bad one fails at once.
    artifacts = [open_artifact(path) for path in paths]
    for artifact in artifacts:
        resolve_reference(artifact.manifest, reference)
    tasks.check(settings)  # before the latency rounds, as evaluate_artifact checks it before the reference
    latencies: list[dict | None] = [None] * len(paths)
    if settings.latency:
        latencies = list(_interleaved_latency(paths, artifacts, settings, log))
    records: dict = {}
    return [evaluate_artifact(path, settings, reference=reference, records=records, measured_latency=latency,
                              log=partial(log, str(path)))
            for path, latency in zip(paths, latencies)]


def _interleaved_latency(paths: list[Path], artifacts: list, settings: EvalSettings,
                         log: Callable[[str, str], None]) -> list[dict | None]:
    """Every artifact's latency in rounds, when all fit in memory at once; [None, ...] otherwise (each is then
    measured after its accuracy, one after the other)."""
    need = sum(artifact_runtime_bytes(a) for a in artifacts)
    if need > available_memory_bytes():
        log(str(paths[0]), f"latency: the artifacts need {size(need)} loaded together, more than is available: "
                           "timed one after the other, not interleaved")
        return [None] * len(paths)
    log(str(paths[0]), latency_plan(settings) + f"; the {len(paths)} artifacts interleaved, one round = one run of "
                                                 "every case of each in turn")
    chosen = eval_latency_settings(settings)
    results = measure_latency_interleaved([latency_settings(p, **chosen) for p in paths],
                                          lambda i, m: log(str(paths[i]), f"latency {m}"))
    for result in results:
        result["interleaved"] = True
    return list(results)
