"""`dstc eval`: accuracy against the fp32 PyTorch reference and latency of one artifact, as a Report.

Latency runs in a child process (toolchain/evaluate/latency.py) so that its peak RSS is the runtime's alone;
accuracy runs here, beside the reference model.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from toolchain.atomic import write_file_atomically
from toolchain.evaluate import tasks
from toolchain.evaluate.dataset import load_data
from toolchain.evaluate.latency import measure_latency
from toolchain.hardware import describe_cpu
from toolchain.interface.files import MANIFEST, REPORT_FILES
from toolchain.interface.reports import CompressionReport, lost_share, read_json_file
from toolchain.manifest import record_report, versions
from toolchain.reference.choice import resolve_reference
from toolchain.report.html import render_html
from toolchain.report.markdown import render_markdown
from toolchain.report.schema import SCHEMA, HeadError, LatencyCase, LayerError, Metric, Report, Series, manifest_binding
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.routing import router_outputs
from toolchain.runtime.speculative import draft_artifact
from toolchain.settings.evaluation import DEFAULT_WINDOW, EvalSettings
from toolchain.source_hashes import checkpoint_hashes

if TYPE_CHECKING:
    from toolchain.manifest_schema import Manifest

HEADLINE = (128, 1)  # prompt length and batch of the headline latency metrics


def _percentile(samples: list[float], q: float) -> float | None:
    return float(np.percentile(samples, q)) if samples else None


def latency_metrics(cases: list[dict], load_s: float | None, peak_rss_mb: float | None) -> dict[str, Metric]:
    """Headline latency metrics from the case at HEADLINE (or the first case measured)."""
    case = next((c for c in cases if (c["prompt_length"], c["batch"]) == HEADLINE), cases[0] if cases else None)
    where = f"prompt {case['prompt_length']} tokens, batch {case['batch']}" if case else "not measured"
    ttft, itl = (case["ttft_ms"], case["itl_ms"]) if case else ([], [])

    def ms(name: str, samples: list[float], q: float, what: str) -> tuple[str, Metric]:
        # a median carries its confidence interval (toolchain/evaluate/spread.py), which a latency gate reads
        interval = (case or {}).get(name.replace("_ms", "_interval_ms")) if q == 50 else None
        return name, Metric(value=_percentile(samples, q), unit="ms", direction="lower", interval=interval,
                            description=f"{what} P{q:g} ({where})")

    return dict([
        ("load_time_s", Metric(value=load_s, unit="s", direction="lower", description="model load and compile")),
        ms("ttft_p50_ms", ttft, 50, "time to first token"), ms("ttft_p90_ms", ttft, 90, "time to first token"),
        ms("ttft_p99_ms", ttft, 99, "time to first token"),
        ms("itl_p50_ms", itl, 50, "inter-token latency"), ms("itl_p90_ms", itl, 90, "inter-token latency"),
        ("tokens_per_s", Metric(value=case["tokens_per_s"] if case else None, unit="tokens/s", direction="higher",
                                description=f"decode throughput ({where})")),
        ("peak_rss_mb", Metric(value=peak_rss_mb, unit="MB", direction="lower",
                               description="peak resident memory of the process running the artifact")),
        *_speculative_metrics(case, where),
    ])


def _speculative_metrics(case: dict | None, where: str) -> list[tuple[str, Metric]]:
    """The headline case's speculative decoding (eval's speculate), when it was measured."""
    spec = (case or {}).get("speculative")
    if spec is None:
        return []
    how = f"{spec['method']}, {spec['draft_tokens']} draft tokens, {where}"
    return [("speculative_acceptance", Metric(value=spec["acceptance"], unit="ratio", direction="higher",
                                              description=f"draft tokens accepted ({how})")),
            ("speculative_speedup", Metric(value=spec["speedup"], unit="x", direction="higher",
                                           description=f"decode throughput over plain decoding's ({how})")),
            ("speculative_greedy_match_rate", Metric(
                value=spec["greedy_match"], unit="ratio", direction="higher",
                description=f"share of the tokens before the first that differs from plain decoding's ({how})"))]


def compressed_report(manifest: Manifest | None) -> CompressionReport | None:
    return manifest.provenance.report("compress", CompressionReport) if manifest else None


def compression_metrics(routes: dict[int, list[np.ndarray]], config: dict,
                        compression: CompressionReport | None) -> dict[str, Metric]:
    """What the model's metrics cannot see: the worst weight the compression stage measured (an expert written as
    zeros measures 1.0 whatever the KL, when no eval token reaches it), how many weights no calibration token
    reached (NNCF's data-free scales), and the share of routed experts the eval data reached (the experts whose
    outputs KL and routing agreement judge at all)."""
    metrics = {}
    rows = compression.per_weight if compression else []
    if rows:
        worst = max(rows, key=lambda r: lost_share(r.weight_error, r.rescaled_error))
        metrics["max_weight_error"] = Metric(
            value=lost_share(worst.weight_error, worst.rescaled_error), unit="ratio", direction="lower",
            description=f"largest relative weight error ||W - Q(W)|| / ||W|| of any compressed weight, AWQ's "
                        f"per-channel rescaling not counted ({worst.weight}; 1.0: a weight of zeros)")
    elif compression is None:
        metrics["max_weight_error"] = Metric(value=0.0, unit="ratio", direction="lower",
                                             description="no weight compressed: every weight as exported")
    unreached = (compression.details.get("data_free_unreached") if compression else None) or []
    options = compression.options if compression else None
    if options and (options.gptq or options.awq or options.scale_estimation or options.ratio < 1):
        metrics["calibration_unreached_weights"] = Metric(
            value=float(len(unreached)), unit="", direction="none",
            description="routed-expert weights no calibration token reached: compressed data-free")
    experts = config.get("n_routed_experts")
    if routes and experts:
        reached = sum(len(np.unique(np.concatenate([r.ravel() for r in rows]))) for rows in routes.values())
        metrics["expert_coverage"] = Metric(
            value=reached / (experts * len(routes)), unit="ratio", direction="higher",
            description=f"share of the {len(routes)} MoE layers' {experts} routed experts the eval data reached "
                        "in the reference (KL and routing agreement say nothing of the rest)")
    return metrics


def quantization_series(manifest: Manifest | None) -> tuple[list[LayerError], list[HeadError]]:
    """Per-weight and per-head errors the compression stage measured, from the manifest's provenance."""
    report = compressed_report(manifest)
    layers, heads = [], []
    for row in report.per_weight if report else []:
        layers.append(LayerError(weight=row.weight, layer=row.layer, precision=row.precision,
                                 weight_error=row.weight_error, output_error=row.output_error))
        heads += [HeadError(weight=row.weight, layer=row.layer, head=h.head, weight_error=h.weight_error,
                            output_error=h.output_error) for h in row.heads or []]
    return layers, heads


def reference_task_scores(artifact, settings: EvalSettings, *, reference: str | None = None,
                          log: Callable[[str], None] = lambda _: None) -> tuple[dict, dict]:
    """The reference's lm-eval scores on settings.tasks: from the reference cache, or computed by the layer-by-layer
    reference (released before it returns). Returns them and what the report records of their cache entry."""
    # torch loads only where the reference runs: a cached reference's outputs need none
    from toolchain.evaluate import tasks
    from toolchain.reference import cache as reference_cache
    from toolchain.reference.outputs import open_reference

    source, choice = resolve_reference(artifact.manifest, reference)
    key = reference_cache.task_key(checkpoint_hashes(source.path), tasks.task_files(Path(str(settings.task_data))),
                                   settings)
    scores, why = reference_cache.load_tasks(key) if settings.reference_cache else (None, "absent")
    reused = scores is not None
    if why not in (None, "absent"):
        log(f"the reference cache entry tasks-{key[:16]} is not usable ({why}); scoring the reference again")
    if scores is None:
        ref = open_reference(source, settings.threads, choice)
        try:
            log(f"reference: lm-eval {', '.join(settings.tasks)}")
            scores = tasks.score(ref, artifact.tokenizer(), settings,
                                 max_length=artifact.context_length or settings.window or DEFAULT_WINDOW,
                                 stop_ids=artifact.eos_token_ids, log=log)
        finally:
            ref.close()
        if settings.reference_cache:
            reference_cache.store_tasks(key, scores)
    else:
        log(f"reference: lm-eval scores reused from the reference cache ({key[:16]})")
    return scores, {"key": key, "reused": reused}


def _measured_latency(path: Path, settings: EvalSettings, measured: dict | None,
                      log: Callable[[str], None]) -> dict:
    """What the latency child measured, or ``measured`` (`dstc compare`'s interleaved rounds); {} when
    settings.latency is off."""
    if not settings.latency:
        return {}
    if measured is not None:
        return measured
    log(latency_plan(settings))
    return measure_latency(path, log=lambda m: log(f"latency {m}"), **eval_latency_settings(settings))


def evaluate_artifact(path: Path, settings: EvalSettings | None = None, *, reference: str | None = None,
                      records: dict | None = None, display_path: Path | None = None,
                      measured_latency: dict | None = None, log: Callable[[str], None] = lambda _: None) -> Report:
    """Measure the artifact at ``path``. ``records``: reference records by cache key, shared by the artifacts of
    one `dstc compare`. ``display_path``: where the artifact will live, when ``path`` is the temporary directory of
    a build that has not been renamed into place yet. ``measured_latency``: its latency, measured already
    (`dstc compare` interleaves the artifacts' runs, latency_settings(path, **eval_latency_settings(settings)))."""
    # torch loads only when accuracy is measured
    from toolchain.evaluate.accuracy import measure_accuracy
    from toolchain.models.train import END_OF_LINE
    from toolchain.reference.outputs import reference_record

    settings = settings if settings is not None else EvalSettings()
    artifact = open_artifact(path)
    tasks.check(settings)  # before the reference runs (minutes at real size)
    tokenizer = artifact.tokenizer()
    # a bad draft model is bad input now, not after the accuracy runs (it drafts after the latency cases' prompts)
    draft_artifact(settings, artifact,
                   max(settings.prompt_lengths) + settings.new_tokens if settings.latency else None)
    task = artifact.manifest is not None and artifact.manifest.source.kind == "embedded"
    data = load_data(settings, tokenizer, task=task,
                     max_length=int(artifact.config.get("max_position_embeddings") or settings.window
                                    or DEFAULT_WINDOW))
    newline_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(END_OF_LINE))[0] if task else None
    record, ref_about = reference_record(artifact, data, settings, reference=reference, records=records,
                                         eos_ids=artifact.eos_token_ids, pad_id=artifact.pad_token_id,
                                         newline_id=newline_id, log=log)
    if settings.tasks:
        ref_tasks, ref_about["tasks_cache"] = reference_task_scores(artifact, settings, reference=reference, log=log)
    routers = router_outputs(artifact)
    decoder = open_decoder(artifact, threads=settings.threads, extra_outputs=list(routers.values()),
                           openvino_f32=settings.openvino_f32)
    log(f"{artifact.backend} artifact loaded in {decoder.load_seconds:.2f} s ({decoder.threads} threads)")
    metrics, series = measure_accuracy(decoder, record, data, routers, tokenizer, eos_ids=artifact.eos_token_ids,
                                       pad_id=artifact.pad_token_id, newline_id=newline_id, settings=settings,
                                       log=log)
    if settings.tasks:
        log(f"lm-eval {', '.join(settings.tasks)} on the artifact")
        scores = tasks.score(decoder, tokenizer, settings,
                             max_length=artifact.context_length or settings.window or DEFAULT_WINDOW,
                             stop_ids=artifact.eos_token_ids, log=log)
        metrics.update(tasks.task_metrics(scores, ref_tasks))
    threads, runtime_config = decoder.threads, decoder.runtime_config
    del decoder  # before latency runs in its child process

    latency = _measured_latency(path, settings, measured_latency, log)
    cases = latency.get("cases", [])
    if latency:
        metrics.update(latency_metrics(cases, latency["load_s"], latency["peak_rss_mb"]))
    metrics["model_size_mb"] = Metric(value=artifact.size_bytes / 1e6, unit="MB", direction="lower",
                                      description="model files on disk (graph and weights)")

    layer_errors, head_errors = quantization_series(artifact.manifest)
    metrics.update(compression_metrics(record.routes, artifact.config, compressed_report(artifact.manifest)))
    manifest_file = Path(path) / MANIFEST
    recipe = artifact.manifest.recipe if artifact.manifest else None
    return Report.model_validate({
        "schema": SCHEMA,
        "artifact": {"path": str(Path(display_path or path).resolve()), "recipe": recipe.name if recipe else None,
                     "backend": artifact.backend,
                     "model": artifact.manifest.source.model if artifact.manifest else None,
                     "model_type": artifact.config.get("model_type"),
                     "compression": recipe.compress.scheme if recipe and recipe.compress else "none",
                     "manifest_digest": manifest_binding(read_json_file(manifest_file, "manifest"))
                     if manifest_file.is_file() else None,
                     "size_bytes": artifact.size_bytes, "report_files": list(REPORT_FILES)},
        "reference": ref_about,
        "environment": {"host": platform.node(), "cpu": describe_cpu(), "cores": os.cpu_count(),
                        "threads": latency.get("threads", threads),
                        "runtime_config": latency.get("runtime_config", runtime_config), "versions": versions()},
        "settings": {**settings.model_dump(), "task": _task(settings, task, data),
                     "data": data.description,
                     "latency_skipped": latency.get("skipped", []),
                     # `dstc compare`: its artifacts' runs alternated, round by round
                     "latency_interleaved": latency.get("interleaved"),
                     "rss_increase_mb": round(latency["rss_increase_mb"], 1) if latency else None},
        "metrics": {k: v.model_dump() for k, v in metrics.items()},
        "latency": [LatencyCase.model_validate(c).model_dump() for c in cases],
        "series": Series(kl_per_position=series["kl_per_position"],
                         routing_agreement_per_layer=series["routing_agreement_per_layer"],
                         layer_errors=layer_errors, head_errors=head_errors).model_dump(),
    })


def eval_latency_settings(settings: EvalSettings) -> dict:
    """measure_latency's settings from eval's."""
    return {"prompt_lengths": tuple(settings.prompt_lengths), "batches": tuple(settings.batches),
            "new_tokens": settings.new_tokens, "warmup": settings.warmup, "repetitions": settings.repetitions,
            "threads": settings.threads, "openvino_f32": settings.openvino_f32, "speculate": settings.speculate,
            "draft_tokens": settings.draft_tokens}


def latency_plan(settings: EvalSettings) -> str:
    return (f"latency: prompts {settings.prompt_lengths} x batch {settings.batches}, {settings.new_tokens} new "
            f"tokens, {settings.warmup} warm-up + {settings.repetitions} measured runs each")


def _task(settings: EvalSettings, embedded: bool, data) -> str | None:
    """What exact match measured: the embedded arithmetic task, the data's prompt/answer records, or nothing."""
    if not data.problems:
        return None
    return "embedded arithmetic" if settings.dataset is None and embedded else "prompt/answer records of --dataset"


def write_report(report: Report, directory: Path) -> list[Path]:
    """report.md, report.html, then report.json (which records their sha256 and a digest of itself) into
    ``directory``, each written to a temporary name and renamed, so a reader never sees half a report."""
    import json

    texts = {"report.md": render_markdown(report), "report.html": render_html(report)}
    report.files = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in texts.items()}
    texts["report.json"] = json.dumps(report.sealed(), indent=2) + "\n"
    for name, text in texts.items():
        write_file_atomically(Path(directory) / name, text)
    if (Path(directory) / MANIFEST).is_file():  # an artifact: its manifest records the report (check_report_binding)
        record_report(Path(directory), hashlib.sha256(texts["report.json"].encode()).hexdigest())
    return [Path(directory) / name for name in REPORT_FILES]
