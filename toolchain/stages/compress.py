"""Stage: an export directory (model.onnx + export.json) -> weight-compressed model + compression.json.

Schemes: ``int4-grouped`` (NNCF INT4, group size 32/64/128, asymmetric or symmetric, INT8 or no backup for
what is left at ratio < 1, optional AWQ / scale estimation / GPTQ on calibration text), ``int8-per-channel``
(NNCF INT8) and ``int8-per-head`` (the passes.quantize int8-per-head pass). The sensitive weights follow a
stated policy (toolchain/compress/policy.py): embeddings and lm_head INT8, MoE routers FP32, unless asked.

Targets:

* ``onnxruntime``: OUT/model.onnx (+ model.onnx.data above 1 GiB of weights, or when streamed), every compressed
  MatMul a com.microsoft MatMulNBits (4 or 8 bits) with ``accuracy_level``, embeddings gathered then dequantized
  (passes/quantize/matmul_nbits.py); compression.json lists the kernels ORT's profiler saw run.
* ``openvino``: OUT/openvino_model.xml/.bin, the stateless model (same inputs and outputs as the ONNX graph,
  past_key_values.* / present.*) with NNCF's compressed weights; the compile stage makes it stateful as it does
  a converted ONNX file (openvino_ir.fuse_beam_reorder + make_stateful on ``ov.Core().read_model``).

Both copy IN/export.json to OUT/export.json (the source checkpoint and graph interface the compile stage reads).
compression.json holds the error where it happens: per weight, per attention head, per MoE router (routing
agreement), for the whole model, and bits per weight (toolchain/compress/metrics.py).
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import onnx_ir as ir

from toolchain import __version__
from toolchain.atomic import atomic_output_dir
from toolchain.checkpoint.reader import open_checkpoint
from toolchain.compress import (
    calibration,
    engine,
    metrics,
    moe as fused_moe,
    shipped,
    streamed_awq,
    streaming as stream,
)
from toolchain.compress.blas_threads import one_blas_thread
from toolchain.compress.layer_statistics import linear_statistics
from toolchain.compress.policy import Policy
from toolchain.compress.streaming import blocked_dq_to_nbits
from toolchain.errors import CompressionError, InputError
from toolchain.export.graph import float32_bytes, load_graph, save_graph
from toolchain.interface.graph import HEAD_LAYOUT, cache_dtype, cache_spec
from toolchain.interface.reports import CompressionOptions, CompressionReport, lost_share
from toolchain.recipe import CompressSection
from toolchain.runtime.engines import GraphRunner, ort_kernels
from toolchain.stages import compress_parts
from toolchain.stages.compress_parts import PartFile, PartRunner, PartTask
from toolchain.stages.context import StageContext
from toolchain.stages.export import recomputed_weights
from toolchain.stages.inputs import carry_mtp, check_weights_written, read_export

CALIBRATION_SEQUENCES = 16
# an ONNX model serialized whole (the whole-model path runs it on ORT from one protobuf with its float32 weights)
PROTOBUF_LIMIT = 2**31 - (64 << 20)
# Above this many bytes of float weights, compression runs one weight at a time ("auto").
STREAMING_BYTES = 1 << 30
OPENVINO_XML = "openvino_model.xml"


def _load(in_dir: Path, section: CompressSection, target: str) \
        -> tuple[ir.Model, dict[str, tuple[str, int]], engine.Options, list]:
    """The export's graph, its head layout, the compression's options and its fused MoE layers."""
    model = load_graph(in_dir / "model.onnx")
    layout = head_layout(model, in_dir / "model.onnx")
    opts = engine.Options(**section.model_dump(),
                          head_blocks={p: w for p, (side, w) in layout.items() if side == "out"})
    fused = fused_moe.fused_layers(model)  # experts of a fused MoE lowering, which NNCF does not see
    fused_moe.check(fused, target, opts)
    return model, layout, opts, fused


def head_layout(model: ir.Model, path: Path) -> dict[str, tuple[str, int]]:
    """projection -> ("out", head width) for projections whose output channels are heads, ("in", width) for the
    output projection, whose input rows are: what the exporter's architecture module wrote into the graph
    (``dstc.head_layout``), the one source; a graph without it (an older dstc's, another exporter's) is refused,
    its heads not guessed from names."""
    recorded = model.metadata_props.get(HEAD_LAYOUT)
    if recorded is None:
        raise InputError(f"{path} has no {HEAD_LAYOUT} (the head layout dstc's exporter records): the graph comes "
                         f"from an older dstc or another exporter; export the checkpoint again")
    return {projection: (side, int(width)) for projection, (side, width) in json.loads(recorded).items()}


def _borrowed_inputs(weights, rows) -> dict[str, np.ndarray]:
    """For each routed expert's weight no calibration token reached: the calibration inputs of its layer's other
    routed-expert weights of the same input width (the hidden states routed to them, or their activations), so
    that its output error is measured on inputs of that layer's distribution rather than not at all."""
    reached: dict[tuple, list[np.ndarray]] = defaultdict(list)
    for w in weights:
        x = rows.get(w.name)
        if w.role == "routed_expert" and w.kind == "matmul" and len(w.shape) == 2 and x is not None and len(x):
            reached[(w.layer, w.shape[0])].append(x)
    borrowed = {}
    for w in weights:
        x, donors = rows.get(w.name), reached.get((w.layer, w.shape[0]))
        if w.role == "routed_expert" and x is not None and not len(x) and donors:
            borrowed[w.name] = np.concatenate(donors)[:metrics.MAX_ROWS]
    return borrowed


def _weight_rows(weights, plan, restored, rows, layout) -> list[dict]:
    out = []
    borrowed = _borrowed_inputs(weights, rows)
    for w in weights:
        r = restored.get(w.name)
        if r is None:
            continue
        original = w.array
        x = borrowed.get(w.name, rows.get(w.name))
        if w.kind == "gather":  # rows of the table the calibration tokens read
            x = None
        row = {"weight": w.name, "node": w.node, "role": w.role,
               "layer": w.layer,
               "shape": list(w.shape), "planned": plan[w.name], "precision": r.precision,
               "bits_per_weight": round(8 * r.nbytes / original.size, 4),
               "weight_error": metrics.relative_error(original, r.array),
               "output_error": metrics.output_error(x, original, r.array) if w.kind == "matmul" else None,
               "borrowed_inputs": w.name in borrowed,
               "rescaled_error": metrics.rescaled_error(original, r.array) if w.kind == "matmul" else None}
        projection = w.name.split("/")[-2] if "/" in w.name else ""
        side, width = layout.get(projection, ("", 0)) if w.kind == "matmul" else ("", 0)
        if side == "stacked" and len(w.shape) == 3:  # MLA's absorbed kv_b_proj: a head per index of axis 0
            row["head_side"] = "stacked"
            row["heads"] = metrics.head_errors(x, original, r.array, side, 1)
        elif side and len(w.shape) == 2 and (w.shape[1] if side == "out" else w.shape[0]) % width == 0:
            row["head_side"] = "output channels" if side == "out" else "input rows"
            row["heads"] = metrics.head_errors(x, original, r.array, side, width)
        out.append(row)
    return out


def _layer_summary(rows: list[dict]) -> list[dict]:
    """Per decoder layer (and embeddings / lm_head): parameter-weighted errors and bits."""
    groups: dict = defaultdict(list)
    for row in rows:
        groups[row["layer"] if row["layer"] is not None else row["role"]].append(row)
    out = []
    for key, members in groups.items():
        sizes = np.array([np.prod(m["shape"]) for m in members], np.float64)
        out_err = [m["output_error"] for m in members if m["output_error"] is not None]
        out.append({"layer": key, "weights": len(members), "parameters": int(sizes.sum()),
                    "bits_per_weight": float((sizes * [m["bits_per_weight"] for m in members]).sum() / sizes.sum()),
                    "weight_error_max": max(m["weight_error"] for m in members),
                    "output_error_max": max(out_err) if out_err else None,
                    "output_error_mean": float(np.mean(out_err)) if out_err else None})
    return out


@dataclass
class _Job:
    """One compression: what each of its steps reads (the stage's input, its section and the plan's target)."""

    in_dir: Path
    out_dir: Path
    target: str
    section: CompressSection
    options: engine.Options
    policy: Policy
    report: dict  # the input's export.json
    source: Path  # the checkpoint the export was made from
    config: dict  # its config.json
    log: Callable[[str], None]
    timings: dict[str, float] = field(default_factory=dict)


@one_blas_thread()
def compress(in_dir: Path, out_dir: Path, section: CompressSection, context: StageContext) -> dict:
    """Compress IN's model.onnx into OUT (see the module doc) for the plan's backend as a recipe's compress
    ``section`` says (toolchain/recipe.py CompressSection, where each field is described; its prefill_int8 resolved by
    the plan, toolchain/stages/choices.py); returns compression.json's content. ``streaming`` "auto" compresses one
    weight at a time (toolchain/compress/streaming.py) when the export's float weights exceed STREAMING_BYTES. The
    context's ``parts``: a streamed compression's weights are written in parts, by layer range, each by a task of
    its own (toolchain/stages/compress_parts.py), into the same bytes.
    """
    in_dir, out_dir, target, log = Path(in_dir), Path(out_dir), context.plan.backend, context.log
    assert target is not None  # a plan with a compress section names its backend (BuildPlan)
    report, source = read_export(in_dir, context.source)
    if section.scheme == "shipped":
        shipped.check_source(source, target)
    policy = Policy.of(section)
    config = json.loads((source / "config.json").read_text())
    t0 = time.perf_counter()
    model, layout, opts, fused = _load(in_dir, section, target)
    if fused and opts.scheme == "shipped":
        raise InputError(f"{in_dir}: the shipped scheme rewrites each routed expert's MatMul weight; export with "
                         f"the dispatch MoE lowering (moe: dispatch), not a fused one")
    work = _Job(in_dir, out_dir, target, section, opts, policy, report, source, config, log)
    weight_bytes = float32_bytes(model)  # bf16-stored weights as float32: the same choice for either storage
    if opts.streaming == "always" or (opts.streaming == "auto" and weight_bytes > STREAMING_BYTES):
        if opts.gptq or opts.ratio < 1.0:
            raise InputError(f"{in_dir} has {weight_bytes / 2**30:.1f} GiB of float weights: gptq and ratio < 1 run "
                             f"on the whole model and are not available in bounded memory; use the data-free scheme, "
                             f"awq or scale estimation (computed layer by layer)")
        recomputed_weights(model, in_dir, source, log)
        return _compress_streaming(work, model, fused, _split(context.parts, opts, log), t0)
    check_weights_written(report, in_dir, "compress it with streaming: auto or always")
    if weight_bytes > PROTOBUF_LIMIT:
        raise InputError(f"{in_dir} has {weight_bytes / 2**30:.1f} GiB of float weights: the whole-model path "
                         f"(streaming: never) runs the graph from one ONNX protobuf, which holds at most 2 GiB; "
                         f"use streaming: auto")
    return _compress_whole(work, model, layout, fused, t0)


@dataclass
class _Reference:
    """The fp32 model run on the calibration text: its feeds, what each weight saw, its logits and routing, and
    the fused MoE layers' expert jobs planned on its activations."""

    feeds: list
    tokens: int
    tokenization: str
    routers: dict
    rows: dict
    logits: list
    routing: dict
    statistics: object
    expert_jobs: list


def _reference(work: _Job, model: ir.Model, weights, fused) -> _Reference:
    opts = work.options
    specs = cache_spec((v.name, v.shape) for v in model.graph.inputs)
    texts = calibration.load_texts(opts.dataset, CALIBRATION_SEQUENCES)
    sequences, tokenization = calibration.token_sequences(texts, work.source, work.config["vocab_size"])
    feed_list = [calibration.feeds(ids, specs, cache_dtype(model.metadata_props)) for ids in sequences]
    # the routers' choices: what the dispatch's experts compare with, or what the fused layers are fed
    routers = metrics.router_indices(model) if fused_moe.lowering_of(model) == "dispatch" else \
        fused_moe.router_indices(fused)
    work.log(f"fp32 reference on {len(feed_list)} calibration sequences ({tokenization})")
    rows, ref_logits, ref_routing = metrics.capture(model, weights, feed_list, routers, work.log)
    activations = statistics = None
    if fused:
        run = GraphRunner(model, "onnxruntime", extra_outputs=fused_moe.capture_names(fused))
        captured = [run(feeds) for feeds in feed_list]
        activations = fused_moe.calibration_activations(fused, captured)
        if opts.awq or opts.scale_estimation:
            statistics = fused_moe.calibration_statistics(fused, captured)
    expert_jobs = fused_moe.compress_experts(model, fused, work.policy.precision, opts, opts.accuracy_level,
                                             activations, statistics)
    return _Reference(feed_list, int(sum(len(s) for s in sequences)), tokenization, routers, rows, ref_logits,
                      ref_routing, statistics, expert_jobs)


def _compress_whole(work: _Job, model: ir.Model, layout, fused, t0: float) -> dict:
    """NNCF's whole-model call (or the shipped scheme's rewrite), then the compressed model run on the calibration
    text against the fp32 reference: errors per weight, head and router, and next-token agreement."""
    engine.widen_stored_weights(model)  # NNCF and the metrics take float32 weights
    weights = engine.graph_weights(model)
    plan = work.policy.plan(weights)
    reader = found = None
    if work.options.scheme == "shipped":
        reader = open_checkpoint(work.source)
        found = shipped.sources(model, weights, reader)
        plan = {w.name: shipped.PRECISION if w.name in found else "fp32" for w in weights}
    ref = _reference(work, model, weights, fused)
    work.timings["reference_s"] = time.perf_counter() - t0
    with atomic_output_dir(work.out_dir) as tmp:
        t0 = time.perf_counter()
        if reader is not None:
            with reader:
                compressed, files, run, details = _shipped(model, found, weights, reader, work.target, tmp,
                                                           ref.routers, work.log)
            restored = metrics.restored_onnx(compressed, weights) if work.target == "onnxruntime" else \
                metrics.restored_openvino(compressed, weights)
            work.timings["compress_s"] = time.perf_counter() - t0
            if work.target == "onnxruntime":
                details["onnxruntime_kernels"] = ort_kernels(tmp / "model.onnx", ref.feeds[0])
        else:
            compressed, files, run, restored, details = _nncf(work, model, weights, plan, ref, tmp, t0)
        weight_rows, routing, model_metrics = _measure(work, run, weights, plan, restored, ref, layout, fused,
                                                       details)
        shutil.copyfile(work.in_dir / "export.json", tmp / "export.json")
        files += ["export.json", *carry_mtp(work.in_dir, tmp)]
        typed = CompressionReport(
            **_head(work, tmp, files, weight_rows), streaming=False,
            calibration={"sequences": len(ref.feeds), "tokens": ref.tokens, "tokenization": ref.tokenization},
            model=model_metrics, routing=routing,
            routing_agreement_min=min((r["agreement"] for r in routing), default=None),
            layers=_layer_summary(weight_rows), per_weight=weight_rows, details=details,
            timings={k: round(v, 3) for k, v in work.timings.items()})
        typed.write(tmp / "compression.json")
    return typed.dump()


def _nncf(work: _Job, model: ir.Model, weights, plan: dict[str, str], ref: _Reference, tmp: Path, t0: float):
    """NNCF's compression of the whole model for the job's target, written into ``tmp``: (graph, files, a runner
    of it, the restored weights, details)."""
    opts, log = work.options, work.log
    # the weights no calibration token reaches (routed experts the calibration never chose): NNCF's data-aware
    # steps have nothing to fit them to (GPTQ zeroes every weight column whose input is never active), so they
    # take its data-free scales on every backend
    unreached = frozenset(name for name, x in ref.rows.items() if x is not None and not len(x))
    nncf_dataset = engine.numpy_dataset(ref.feeds) if opts.data_aware else None
    extra = list(ref.routers.values())
    if work.target == "onnxruntime":
        compressed, details = engine.compress_onnx(model, plan, opts, nncf_dataset, log, unreached)
        restored = metrics.restored_onnx(compressed, weights)
        details["ort_rewrites"] = {"blocked_dq_to_matmul_nbits": blocked_dq_to_nbits(compressed),
                                   **engine.to_ort_kernels(compressed, opts.accuracy_level, opts.prefill_int8)}
        if not opts.accuracy_level:
            # measured (benchmarks/compression.py): ORT 1.32 has no fast fp32-compute path for MatMulNBits;
            # a 2048x2048 weight takes 9.5 ms at 8 bits and 0.58 ms at 4 bits vs 0.36 ms in fp32
            details["warning"] = ("accuracy_level 0: MatMulNBits computes in fp32 on a slow path, slower "
                                  "than the fp32 model; level 4 is 2x faster than fp32")
            log(f"warning: {details['warning']}")
        files = save_graph(compressed, tmp / "model.onnx")
        work.timings["compress_s"] = time.perf_counter() - t0
        details["onnxruntime_kernels"] = ort_kernels(tmp / "model.onnx", ref.feeds[0])
        return compressed, files, GraphRunner(compressed, "onnxruntime", extra_outputs=extra), restored, details
    import openvino as ov

    compressed, details = engine.compress_openvino(model, plan, opts, nncf_dataset, tmp, log, unreached)
    restored = metrics.restored_openvino(compressed, weights)
    ov.save_model(compressed, tmp / OPENVINO_XML, compress_to_fp16=False)
    files = [OPENVINO_XML, OPENVINO_XML.replace(".xml", ".bin")]
    work.timings["compress_s"] = time.perf_counter() - t0
    return compressed, files, GraphRunner(compressed, "openvino", extra_outputs=extra), restored, details


def _measure(work: _Job, run, weights, plan, restored, ref: _Reference, layout, fused, details: dict):
    """The compressed model run on the calibration feeds against the reference: (weight rows, routing agreement
    per MoE layer, next-token agreement)."""
    t0 = time.perf_counter()
    work.log("measuring the error: weights, heads, routing, next-token distributions")
    outputs = [run(feeds) for feeds in ref.feeds]
    weight_rows = _weight_rows(weights, plan, restored, ref.rows, layout) + \
        fused_moe.weight_rows(ref.expert_jobs, fused, work.policy.precision)
    if ref.statistics is not None:
        details["fused_experts"] = fused_moe.data_aware_counts(ref.expert_jobs)
    routing = []
    for layer, name in sorted(ref.routers.items()):
        agreement, tokens = metrics.routing_agreement(ref.routing[layer], [o[name] for o in outputs])
        routing.append({"layer": layer, "agreement": agreement, "tokens": tokens})
    model_metrics = metrics.distribution_agreement(ref.logits, [o["logits"][0] for o in outputs])
    work.timings["measure_s"] = time.perf_counter() - t0
    return weight_rows, routing, model_metrics


def _shipped(model, found, weights, reader, target, tmp, routers, log):
    """The shipped scheme on the whole model (toolchain/compress/shipped.py): the graph rewritten and saved for
    ``target``, the weights read from the checkpoint as it is written; (graph, files, a runner of it,
    details)."""
    details, _ = shipped.rewrite(model, found, weights, reader, log)
    if target == "onnxruntime":
        files = save_graph(model, tmp / "model.onnx")
        loaded = load_graph(tmp / "model.onnx")
        return loaded, files, GraphRunner(loaded, "onnxruntime", extra_outputs=list(routers.values())), details
    import openvino as ov

    path = tmp / "pre-openvino.onnx"
    save_graph(model, path)
    converted = ov.convert_model(str(path))
    path.unlink()
    ov.save_model(converted, tmp / OPENVINO_XML, compress_to_fp16=False)
    files = [OPENVINO_XML, OPENVINO_XML.replace(".xml", ".bin")]
    return converted, files, GraphRunner(converted, "openvino", extra_outputs=list(routers.values())), details


def _shipped_streaming(work: _Job, model: ir.Model, weights, t0: float) -> dict:
    """The shipped scheme one weight at a time: the graph rewritten as on the whole-model path, each weight's codes
    and scales read from the checkpoint as they are written and its DequantizeLinear compared with the export's
    weight on the way; every other weight written as the export stored it. Nothing runs the model, as for the
    other streamed schemes."""
    with open_checkpoint(work.source) as reader:
        found = shipped.sources(model, weights, reader)
        details, jobs = shipped.rewrite(model, found, weights, reader, work.log, measure=True)
        work.timings["plan_s"] = time.perf_counter() - t0
        with atomic_output_dir(work.out_dir) as tmp:
            t0 = time.perf_counter()
            files = save_graph(model, tmp / "model.onnx", external=True, workers=2)
            del model
            work.timings["compress_s"] = time.perf_counter() - t0
            shutil.copyfile(work.in_dir / "export.json", tmp / "export.json")
            files += ["export.json", *carry_mtp(work.in_dir, tmp)]
            weight_rows = []
            for w in weights:
                job = jobs.get(w.name)
                stored_bits = job.bits_per_weight() if job else 16.0 if w.storage == "bfloat16" else 32.0
                weight_rows.append({
                    "weight": w.name, "node": w.node, "role": w.role, "layer": w.layer, "shape": list(w.shape),
                    "planned": shipped.PRECISION if job else "fp32",
                    "precision": job.precision if job else {"bfloat16": "bf16"}.get(w.storage, "fp32"),
                    "bits_per_weight": round(stored_bits, 4),
                    "weight_error": job.weight_error if job else 0.0, "output_error": None})
            typed = _streamed_report(_head(work, tmp, files, weight_rows), weight_rows, None, details, work.timings)
            typed.write(tmp / "compression.json")
    return typed.dump()


def _streamed_report(head: dict, weight_rows: list[dict], calibration: dict | None, details: dict,
                     timings: dict[str, float]) -> CompressionReport:
    """compression.json of a streamed compression: weight errors only, the model not run on calibration text."""
    unmeasured = "not measured: the model is compressed one weight at a time, without running it"
    return CompressionReport(
        **head, streaming=True, calibration=calibration,
        model={"tokens": 0, "top1_agreement": None, "kl_mean": None, "kl_max": None, "note": unmeasured},
        routing=[], routing_agreement_min=None, layers=_layer_summary(weight_rows), per_weight=weight_rows,
        details=details, timings={k: round(v, 3) for k, v in timings.items()})


def _refuse_lost_weights(weight_rows: list[dict], limit: float) -> None:
    """CompressionError when a compressed weight's relative error is above ``limit`` (recipe max_weight_error):
    a weight written as zeros measures 1.0, and the model's metrics need not see it (an expert no eval token
    reaches)."""
    def lost(row: dict) -> float:
        return lost_share(row["weight_error"], row.get("rescaled_error"))

    above = sorted((r for r in weight_rows if lost(r) > limit), key=lambda r: -lost(r))
    if above:
        worst = above[0]
        raise CompressionError(
            f"{len(above)} compressed weight(s) with a relative error above max_weight_error {limit}, the worst "
            f"{worst['weight']} ({worst['precision']}) at {lost(worst):.3g}: the compression lost them "
            f"(1.0 is a weight of zeros); raise compress.max_weight_error only if that is meant")


def _head(work: _Job, tmp: Path, files: list[str], weight_rows: list[dict]) -> dict:
    """The fields of compression.json both forms of compression write alike, once no weight is lost
    (_refuse_lost_weights)."""
    target, options, report = work.target, work.options, work.report
    _refuse_lost_weights(weight_rows, options.max_weight_error)
    params = sum(int(np.prod(r["shape"])) for r in weight_rows)
    stored_bits = sum(r["bits_per_weight"] * int(np.prod(r["shape"])) for r in weight_rows)
    return {
        "dstc_version": __version__,
        "target": target,
        "scheme": options.scheme,
        # the report's fields are the section's, by name (tests/report/test_typed_reports.py holds them so)
        "options": {**{name: getattr(options, name) for name in CompressionOptions.model_fields},
                    "accuracy_level": options.accuracy_level if target == "onnxruntime" else None},
        "policy": work.policy.as_dict(),
        "source": {"export": str(work.in_dir), **report["source"]},
        "files": sorted([*files, "compression.json"]),
        "size_bytes": sum((tmp / f).stat().st_size for f in files if f != "export.json"),
        "file_sizes": {f: (tmp / f).stat().st_size for f in files if f != "export.json"},
        "input_size_bytes": report.get("graph", {}).get("size_bytes"),
        "weights": {"parameters": params, "bits_per_weight": stored_bits / params if params else None,
                    "precisions": dict(Counter(r["precision"] for r in weight_rows))},
    }


def _float_weight(model: ir.Model, name: str) -> np.ndarray:
    """An export weight in float32, read whole (its external pages released after)."""
    tensor = model.graph.initializers[name].const_value
    assert tensor is not None  # a planned weight is an initializer with data
    array = np.array(tensor.numpy(), np.float32)
    if isinstance(tensor, ir.ExternalTensor):
        tensor.release()
    return array


@dataclass
class _Planned:
    """A streamed compression planned: ``model`` rewritten with lazy tensors, computed as they are written."""

    model: ir.Model
    weights: list
    plan: dict[str, str]
    specs: list[stream.Spec]
    jobs: dict[str, stream.Job]
    expert_jobs: list
    details: dict
    calibration: dict | None


def _plan_streaming(work: _Job, model: ir.Model, fused) -> _Planned:
    """Everything before the weights are written: the plan, each weight's lazy tensors and the ORT kernels' forms
    (a part's task does it again, and gets the same graph)."""
    target, options, policy, log = work.target, work.options, work.policy, work.log
    weights = engine.graph_weights(model, with_arrays=False)
    plan = policy.plan(weights)
    specs = stream.plan_specs(weights, plan, options, target)
    calibration_report, data_aware = None, {}
    expert_statistics = None
    if options.scale_estimation or options.awq:
        int4 = {s.weight.name: s for s in specs if s.bits == 4 and s.form in ("nbits", "dq-blocked")}
        experts = fused_moe.int4_names(fused, policy.precision)
        if not int4 and not experts:
            raise InputError("awq and scale estimation apply to INT4 weights, and this plan has none")
        texts = calibration.load_texts(options.dataset, CALIBRATION_SEQUENCES)
        sequences, tokenization = calibration.token_sequences(texts, work.source, work.config["vocab_size"])
        log(f"calibration statistics layer by layer on {len(sequences)} sequences ({tokenization})")
        t1 = time.perf_counter()
        widths = {name: spec.weight.shape[0] for name, spec in int4.items()}  # [K, N] MatMul weights
        widths |= {name: s.shape[2] for layer in fused for s in layer.weights for _, _, name in layer.names(s)
                   if name in experts}  # [E, out, in]
        statistics = linear_statistics(work.source, sequences, widths, log)
        expert_statistics = {name: statistics.pop(name) for name in experts if name in statistics}
        work.timings["statistics_s"] = time.perf_counter() - t1
        calibration_report = {"sequences": len(sequences), "tokens": int(sum(len(s) for s in sequences)),
                              "tokenization": tokenization}
        if options.awq:
            t1 = time.perf_counter()
            data_aware["awq"] = streamed_awq.apply(int4, statistics, partial(_float_weight, model))
            work.timings["awq_s"] = time.perf_counter() - t1
            log(f"AWQ on {len(data_aware['awq'])} up_proj -> down_proj pairs")
        if options.scale_estimation:
            for name, stat in statistics.items():
                int4[name].statistics = stat
            data_aware["scale_estimation"] = sorted(statistics)
            log(f"scale estimation on {len(statistics)} of {len(int4)} INT4 weights (the others, routed experts "
                f"no calibration token reached and weights the checkpoint's layers do not compute as such, take "
                f"NNCF's data-free scales)")
    jobs = stream.compress_streaming(model, specs, log, keep=target == "onnxruntime")
    expert_jobs = fused_moe.compress_experts(
        model, fused, policy.precision, options, options.accuracy_level,
        statistics=None if expert_statistics is None else
        lambda layer, e, p: expert_statistics.get(f"{layer.scope}/{e}/{p}/weight"))
    details = {"demoted_3d": [s.weight.name for s in specs if s.form == "stacked" and plan[s.weight.name] == "int4"],
               "per_head": {}, **data_aware}
    if target == "onnxruntime":
        details["ort_rewrites"] = engine.to_ort_kernels(model, options.accuracy_level, options.prefill_int8)
    return _Planned(model, weights, plan, specs, jobs, expert_jobs, details, calibration_report)


def _split(parts: PartRunner | None, options: engine.Options, log) -> PartRunner | None:
    """``parts`` where a streamed compression can be split: one of more than one part, without calibration (its
    statistics run the checkpoint's layers on calibration text: each part would run them again, and another
    node's float kernels may round them otherwise)."""
    if parts is None or parts.count < 2:
        return None
    if options.awq or options.scale_estimation:
        log("the streamed compression is not split into parts: awq and scale estimation take statistics of the "
            "whole model, which each part would compute again")
        return None
    if options.scheme == "shipped":
        log("the streamed compression is not split into parts: the shipped scheme copies the checkpoint's codes, "
            "reading and writing with no computation to share out")
        return None
    return parts


@one_blas_thread()
def compress_part(task: PartTask, log: Callable[[str], None] = lambda _: None) -> PartFile:
    """One part of a split streamed compression (toolchain/stages/compress_parts.py), in its own process: the
    compression planned as the stage plans it, and the part's tensors written to ``task.path``."""
    t0 = time.perf_counter()
    report, source = read_export(task.export_dir, task.source)
    config = json.loads((source / "config.json").read_text())
    model, _, opts, fused = _load(task.export_dir, task.section, task.target)
    recomputed_weights(model, task.export_dir, source, lambda _: None)
    work = _Job(task.export_dir, task.path, task.target, task.section, opts, Policy.of(task.section), report, source,
               config, lambda _: None)
    planned = _plan_streaming(work, model, fused)
    log(f"{task.part.title}: {len(task.part.names)} tensors")
    size, digest = compress_parts.write_part(planned.model, task.part, task.path, log)
    stats = {name: job.stats for name, job in planned.jobs.items() if job.stats}
    expert_stats = {job.stacked.name: job.stats for job in planned.expert_jobs if job.stats}
    return PartFile(task.path, size, digest, round(time.perf_counter() - t0, 3), stats, expert_stats)


def _write_parts(work: _Job, planned: _Planned, places, runner: PartRunner, tmp: Path) -> list[str]:
    """The weights written in parts by ``runner``'s tasks into TMP/parts, assembled into TMP/model.onnx(.data) and
    deleted; each job's stats are the ones its part's task measured, and the details list the parts."""
    parts = compress_parts.plan_parts(places, compress_parts.written_names(planned.model), runner.count)
    work.log(f"writing the compressed weights in {len(parts)} parts: " + "; ".join(p.title for p in parts))
    tasks = [PartTask(work.in_dir, work.source, work.section, work.target, part,
                      tmp / "parts" / f"part-{part.index}.data") for part in parts]
    files = runner.run(compress_part, tasks, work.log)
    expert_stats = {name: stats for file in files for name, stats in file.expert_stats.items()}
    for name, stats in (item for file in files for item in file.stats.items()):
        planned.jobs[name].stats = stats
    for job in planned.expert_jobs:
        job.stats = expert_stats.get(job.stacked.name, job.stats)
    written = compress_parts.assemble(planned.model, parts, files, tmp / "model.onnx")
    shutil.rmtree(tmp / "parts")
    planned.details["parts"] = [{"part": part.title, "tensors": len(part.names), "bytes": file.size,
                                 "seconds": file.seconds} for part, file in zip(parts, files)]
    return written


def _compress_streaming(work: _Job, model: ir.Model, fused, parts: PartRunner | None, t0: float) -> dict:
    """One weight at a time (toolchain/compress/streaming.py): the weight errors are measured as each weight is
    compressed; what needs the whole model run on calibration text (activations, next-token agreement,
    routing) is not measured, and compression.json says so. Scale estimation takes its statistics from the
    checkpoint's layers run one at a time on the calibration text (toolchain/compress/layer_statistics.py).
    ``parts``: the weights are written in parts by its tasks, which plan from the job's section."""
    if work.options.scheme == "shipped":
        return _shipped_streaming(work, model, engine.graph_weights(model, with_arrays=False), t0)
    places = compress_parts.weight_places(model) if parts else {}
    planned = _plan_streaming(work, model, fused)
    rows = partial(_streamed_rows, planned.weights, planned.plan, planned.specs, planned.jobs)
    expert_jobs, details, calibration_report = planned.expert_jobs, planned.details, planned.calibration
    work.timings["plan_s"] = time.perf_counter() - t0
    with atomic_output_dir(work.out_dir) as tmp:
        t0 = time.perf_counter()
        if parts:
            files = _write_parts(work, planned, places, parts, tmp)
        else:
            # each weight computed as it is written, two at a time (NNCF's inference on one, the other's numpy and
            # writing beside it: 2 cores here)
            files = save_graph(model, tmp / "model.onnx", external=True, workers=2)
        del model, planned
        work.timings["compress_s"] = time.perf_counter() - t0
        if expert_jobs and (work.options.awq or work.options.scale_estimation):
            details["fused_experts"] = fused_moe.data_aware_counts(expert_jobs)
        shutil.copyfile(work.in_dir / "export.json", tmp / "export.json")
        files += ["export.json", *carry_mtp(work.in_dir, tmp)]
        weight_rows = rows() + fused_moe.weight_rows(expert_jobs, fused, work.policy.precision)
        typed = _streamed_report(_head(work, tmp, files, weight_rows), weight_rows, calibration_report, details,
                                 work.timings)
        typed.write(tmp / "compression.json")
    return typed.dump()


def _streamed_rows(weights, plan: dict[str, str], specs: list[stream.Spec], jobs: dict[str, stream.Job]) -> list[dict]:
    """compression.json's row of each weight of a streamed compression: the errors its job measured."""
    by_name = {s.weight.name: s for s in specs}
    weight_rows = []
    for w in weights:
        spec = by_name.get(w.name)
        size = int(np.prod(w.shape))
        weight_rows.append({
            "weight": w.name, "node": w.node, "role": w.role,
            "layer": w.layer,
            "shape": list(w.shape), "planned": plan[w.name],
            # a weight left uncompressed keeps its storage: bf16 where the export stored it so
            "precision": spec.precision if spec else {"bfloat16": "bf16"}.get(w.storage, "fp32"),
            "bits_per_weight": round(stream.stored_bits(spec) / size, 4) if spec else
            16.0 if w.storage == "bfloat16" else 32.0,
            "weight_error": jobs[w.name].stats["weight_error"] if spec else 0.0,
            "output_error": None})
        if spec and spec.form == "stacked":  # MLA's absorbed kv_b_proj: a head per index of axis 0
            weight_rows[-1]["head_side"] = "stacked"
            weight_rows[-1]["heads"] = [{"head": h, "weight_error": e, "output_error": None}
                                        for h, e in enumerate(jobs[w.name].stats["head_errors"])]
    return weight_rows
