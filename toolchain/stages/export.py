"""Stage 1: checkpoint -> DIR/model.onnx (+ external data when large) and DIR/export.json with parity figures.

The graph is built from a meta-device skeleton of the transformers model and the checkpoint reader
(toolchain/checkpoint/reader.py): each weight is read from the checkpoint when the graph is saved and written
to model.onnx.data at once, so exporting holds a few tensors, not the model. The fp32 PyTorch reference is loaded
whole only for the end-to-end parity check, and only for models whose fp32 weights fit its budget
(parity.FULL_PARITY_BYTES); above it, each layer is checked against its transformers module
(toolchain/verify/layer_parity.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from toolchain import __version__, source as sources
from toolchain.atomic import atomic_output_dir, check_writable_target
from toolchain.build_plan import BuildPlan
from toolchain.checkpoint.reader import open_checkpoint
from toolchain.errors import InputError, ParityError
from toolchain.export import moe as moe_lowering
from toolchain.export.architectures import ARCHITECTURES, architecture_for
from toolchain.export.cache_precision import with_cache_dtype
from toolchain.export.decoder import build_decoder
from toolchain.export.deepseek import with_mla_cache
from toolchain.export.deepseek_v4 import with_v4_cache
from toolchain.export.graph import save_graph, save_graph_deferred
from toolchain.export.mtp import build_mtp_graph
from toolchain.export.mtp_reference import exports_mtp, mtp_layer_indices
from toolchain.export.reference import layer_too_large, shared_decoder_layers
from toolchain.export.weights import storage_for
from toolchain.interface.files import EXPORT_REPORT, MTP_DIR, ONNX_MODEL, ONNX_WEIGHTS
from toolchain.interface.graph import KV_CACHE, PER_HEAD, cache_bytes_per_token, cache_lengths
from toolchain.interface.reports import DeferredWeights, ExportReport, ExportSource
from toolchain.models.parameters import parameter_count
from toolchain.recipe import ExportSection
from toolchain.reference.whole import TorchDecoder
from toolchain.stages.context import StageContext
from toolchain.verify.layer_parity import MEMORY_FACTOR, compare_layers_on
from toolchain.verify.mtp_parity import compare_mtp_graph
from toolchain.verify.parity import compare, parity_cases, too_large_for_end_to_end

# Decode steps of the layer-by-layer check: each step of each layer is checked on the reference's inputs (errors do
# not compound as they do over greedy steps end to end), and 4 go through a growing KV cache as 16 do.
LAYER_STEPS = 4


# A per-head cache is read by the runtimes' fused attention, which takes it in its compute type: measured on
# deepseek-v3-tiny with mla_cache per-head, OpenVINO's CPU plugin runs no ScaledDotProductAttention for a float16 one
# (the Converts stop its fusion) and keeps a per-head cache in its KV_CACHE_PRECISION (the artifact's runtime option,
# f16) already; ONNX Runtime's Attention fails once the passes have fused it ("does not support past_key provided and
# present_key being null")
PER_HEAD_NARROW_CACHE = ("cache_dtype: a per-head KV cache stays float32 in the graph (OpenVINO keeps it in its "
                         "KV_CACHE_PRECISION, f16, already; the runtimes' fused attention reads it in float32); "
                         "a narrower cache applies to MLA's latent and DeepSeek-V4's per-token caches")


def export(input_dir: Path | None, out_dir: Path, section: ExportSection, context: StageContext) -> dict:
    """Export the plan's checkpoint as ``section`` says (toolchain/recipe.py ExportSection, where each field is
    described; its ``moe`` resolved by the plan, toolchain/stages/choices.py) into ``out_dir``; returns export.json's
    content. ``input_dir``: none, the first stage reads the checkpoint. The plan's ``defer_weights`` (a build whose
    next stage is a streamed compression, which recomputes them: recomputed_weights): model.onnx.data is not
    written, unless the export's own parity check runs the graph; ``weights_read_by``: why a later stage needs the
    weights file, said when a large one is written."""
    plan, log = context.plan, context.log
    assert plan.model is not None  # every plan with an export names its checkpoint
    source = sources.resolve(plan.model, plan.revision)
    arch, parity = _architecture(source, section)
    check_writable_target(out_dir)
    timings = {}
    t0 = time.perf_counter()
    log(f"reading {source.spec} ({source.config['model_type']}) from {source.path}")
    reader = open_checkpoint(source.path)
    storage = storage_for(section.weights, reader)
    skeleton = sources.skeleton(source, reader)
    parameters = parameter_count(skeleton)
    mtp_layer = _mtp_layer(source) if section.mtp else None
    timings["load_s"] = time.perf_counter() - t0
    with atomic_output_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        log("building the ONNX graph")
        graph = build_decoder(skeleton, arch, reader,
                              on_layer=lambda i, n: log(f"built layer {i}/{n}") if n > 8 else None, weights=storage,
                              hidden_output=section.mtp)
        with_cache_dtype(graph, section.cache_dtype)
        config = skeleton.config
        too_large, skipped = _too_large(source.path, config.model_type) if parity else (None, None)
        if skipped:
            parity = ()
        graph_info = _save_graph(graph, tmp, section, plan, storage, parameters,
                                 getattr(config, "layer_types", None), bool(parity), log)
        del graph
        mtp_info = _save_mtp(source.path, skeleton, arch, mtp_layer, storage, section.cache_dtype, tmp, log) \
            if mtp_layer is not None else None
        timings["build_s"] = time.perf_counter() - t0
        results = _parity(source, config, tmp, section, parity, too_large, skipped, mtp_info, timings, log)
        typed = ExportReport(
            dstc_version=__version__,
            source=ExportSource(spec=source.spec, kind=source.kind, path=str(source.path),
                                model_type=config.model_type, parameters=parameters,
                                skipped_layers=list(reader.skipped_layers), tied_embeddings=bool(reader.tied)),
            graph=graph_info, parity=results, parity_mode="layer by layer" if too_large else "end-to-end",
            parity_skipped=f"{too_large}, and {skipped}" if skipped else None, mtp=mtp_info,
            timings={k: round(v, 3) for k, v in timings.items()})
        typed.write(tmp / "export.json")
        report = typed.dump()
    _refuse_failed_parity(results, mtp_info, out_dir)
    return report


def _architecture(source, section: ExportSection):
    """The checkpoint's architecture lowered and with the section's cache layouts, and the parity backends; an
    InputError for a combination the export refuses, before anything is read."""
    arch, parity = moe_lowering.lower(architecture_for(source.config["model_type"]), section.moe,
                                      tuple(section.parity))
    arch = with_v4_cache(with_mla_cache(arch, section.mla_cache), section.v4_cache)
    if section.cache_dtype != "float32" and arch.kv_cache == PER_HEAD:
        raise InputError(PER_HEAD_NARROW_CACHE)
    return arch, parity


def _too_large(source: Path, model_type: str) -> tuple[str | None, str | None]:
    """Why the model is checked layer by layer rather than end to end (None: it is not), and why it is not checked
    at all (None: it is)."""
    too_large = too_large_for_end_to_end(source)
    if too_large and not shared_decoder_layers(model_type):
        return too_large, f"parity layer by layer runs the shared decoder's layers, not {model_type}'s"
    if too_large:
        return too_large, layer_too_large(source, MEMORY_FACTOR, "parity layer by layer")
    return None, None


def _save_graph(graph: ir.Model, tmp: Path, section: ExportSection, plan: BuildPlan, storage: str, parameters: int,
                layer_types, parity: bool, log: Callable[[str], None]) -> dict:
    """The main graph written into ``tmp`` (its weights too, unless the plan defers them and no parity check runs
    the graph); export.json's ``graph``."""
    deferred_bytes = save_graph_deferred(graph, tmp / ONNX_MODEL) if plan.defer_weights and not parity else None
    deferred = None
    if deferred_bytes is not None:
        log(f"{parameters:,} parameters left in the checkpoint: the streamed compression reads them from it, so "
            f"the export's weights file ({deferred_bytes / 1e9:.1f} GB) is not written")
        files = [ONNX_MODEL]
        deferred = DeferredWeights(file=ONNX_WEIGHTS, bytes=deferred_bytes, moe=section.moe,
                                   mla_cache=section.mla_cache, v4_cache=section.v4_cache, mtp=section.mtp)
    else:
        log(f"writing {parameters:,} parameters, one tensor at a time ({storage})")
        # two weights read, converted and written at once (the reader takes turns on its shard)
        files = save_graph(graph, tmp / ONNX_MODEL, workers=2)
        why = plan.weights_read_by or ("the export's parity check runs the graph" if plan.defer_weights else None)
        if why and ONNX_WEIGHTS in files:
            log(f"disk: the export's weights file ({(tmp / ONNX_WEIGHTS).stat().st_size / 1e9:.1f} GB) is "
                f"written whole, {why}")
    cache_bytes = cache_bytes_per_token([(v.name, v.shape, v.dtype.itemsize if v.dtype else 0)
                                         for v in graph.graph.inputs], layer_types,
                                        cache_lengths(graph.metadata_props))
    return {"files": files, "opset": graph.opset_imports[""], "nodes": len(graph.graph),
            "inputs": [v.name for v in graph.graph.inputs],
            "outputs": [v.name for v in graph.graph.outputs],
            "kv_cache": graph.metadata_props[KV_CACHE], "cache_dtype": section.cache_dtype,
            # a deferred weights file counts: the size of the model (compression's input size)
            "size_bytes": sum((tmp / f).stat().st_size for f in files) + (deferred_bytes or 0),
            "weights": storage,
            "cache_bytes_per_token": cache_bytes, "deferred": deferred}


def _save_mtp(source: Path, skeleton, arch, layer: int, storage: str, dtype: str, tmp: Path,
              log: Callable[[str], None]) -> dict:
    """The checkpoint's MTP layer's graph written into TMP/mtp/; export.json's ``mtp``."""
    log(f"building the MTP layer {layer}'s graph")
    (tmp / MTP_DIR).mkdir()
    with open_checkpoint(source, mtp=True) as mtp_reader:
        mtp_graph = build_mtp_graph(skeleton, arch, mtp_reader, layer, weights=storage)
        with_cache_dtype(mtp_graph, dtype)
        mtp_files = save_graph(mtp_graph, tmp / MTP_DIR / ONNX_MODEL, workers=2)
    return {"layer": layer, "files": [f"{MTP_DIR}/{f}" for f in mtp_files],
            "inputs": [v.name for v in mtp_graph.graph.inputs],
            "outputs": [v.name for v in mtp_graph.graph.outputs],
            "size_bytes": sum((tmp / MTP_DIR / f).stat().st_size for f in mtp_files)}


def _parity(source, config, tmp: Path, section: ExportSection, parity: tuple[str, ...], too_large: str | None,
            skipped: str | None, mtp_info: dict | None, timings: dict, log: Callable[[str], None]) -> dict:
    """The written graph (and MTP layer) against PyTorch fp32 on ``parity``: end to end, or layer by layer for a
    model too large for it; the results by backend (the MTP layer's go into ``mtp_info``)."""
    cases = parity_cases(source.path, config.vocab_size)
    pad_id = config.pad_token_id or 0
    new_tokens = section.new_tokens
    results: dict = {}
    if skipped:
        log(f"parity skipped: {too_large}, and {skipped}")
    elif too_large:
        log(f"parity layer by layer: {too_large}")
    if skipped or not parity:
        return results
    if too_large:  # every backend's pieces against one run of the reference
        t0 = time.perf_counter()
        steps = min(new_tokens, LAYER_STEPS)
        log(f"parity: {', '.join(parity)}, each layer vs its PyTorch module, {len(cases)} cases, prefill + "
            f"{steps} steps")
        results = compare_layers_on(tmp / "model.onnx", source.path, parity, cases, steps, pad_id, log)
        timings["parity_layers_s"] = time.perf_counter() - t0
        if mtp_info is not None:
            mtp_info["parity_skipped"] = "the MTP layer is checked end to end only"
        return results
    model = TorchDecoder(source)
    for backend in parity:
        t0 = time.perf_counter()
        log(f"parity: {backend} vs PyTorch fp32, {len(cases)} cases, prefill + {new_tokens} greedy tokens")
        results[backend] = compare(model, tmp / "model.onnx", backend, cases, new_tokens, pad_id)
        timings[f"parity_{backend}_s"] = time.perf_counter() - t0
    if mtp_info is not None:
        t0 = time.perf_counter()
        log(f"MTP parity: {', '.join(parity)} vs PyTorch fp32, {len(cases)} cases")
        mtp_info["parity"] = compare_mtp_graph(model.model, source.path, tmp / MTP_DIR / ONNX_MODEL,
                                               tuple(parity), cases, new_tokens, pad_id)
        timings["parity_mtp_s"] = time.perf_counter() - t0
    return results


def _refuse_failed_parity(results: dict, mtp_info: dict | None, out_dir: Path) -> None:
    """A ParityError naming each backend (and MTP layer) whose check failed; the output is kept for inspection."""
    mtp_results = (mtp_info or {}).get("parity") or {}
    failed = [b for b, r in results.items() if not r["passed"]]
    failed += [f"{b} (MTP layer)" for b, r in mtp_results.items() if not r["passed"]]
    if failed:
        worst = {b: f"{r['max_relative_diff']:.2e}" for b, r in
                 {**results, **{f"{b} (MTP layer)": r for b, r in mtp_results.items()}}.items() if b in failed}
        raise ParityError(f"exported graph disagrees with PyTorch on {', '.join(failed)} (relative diff {worst}); "
                          f"details in {out_dir / 'export.json'}")


def _mtp_layer(source) -> int:
    """The checkpoint's first MTP layer (toolchain/export/mtp_reference.py); an InputError for a model without one."""
    model_type = source.config["model_type"]
    if not exports_mtp(model_type):
        supported = sorted(t for t, arch in ARCHITECTURES.items() if arch.exports_mtp)
        raise InputError(f"mtp: the MTP layer is exported for {', '.join(supported)}, not {model_type}")
    with open_checkpoint(source.path, mtp=True) as reader:
        layers = mtp_layer_indices(reader.names(), reader.config)
    if not layers:
        raise InputError(f"mtp: {source.spec} has no MTP layer (no model.layers.N.eh_proj.weight, or DeepSeek-V4's "
                         f"mtp.N.e_proj.weight, from num_hidden_layers on)")
    return layers[0]


def recomputed_weights(model: ir.Model, export_dir: Path, source: Path, log: Callable[[str], None]) -> None:
    """The weights of an export whose weights file was not written (export.json ``graph.deferred``), recomputed
    from its source checkpoint by the exporter with the settings it ran with, in place of the references
    model.onnx holds: each is read from the checkpoint when a stage reads it, as the export reads it to write it,
    so its values are the bytes the weights file would hold. Each reference must name a weight of the graph
    recomputed, with its type and shape; the checkpoint is the one the build hashed (the stage ids chain)."""
    graph_info = ExportReport.read(export_dir / EXPORT_REPORT).graph
    deferred = graph_info.deferred
    if deferred is None:
        return
    spec = sources.resolve(str(source))
    arch = moe_lowering.with_lowering(architecture_for(spec.config["model_type"]), deferred.moe)
    reader = open_checkpoint(spec.path)  # open while the weights are read, as the export's is
    arch = with_v4_cache(with_mla_cache(arch, deferred.mla_cache), deferred.v4_cache)
    graph = build_decoder(sources.skeleton(spec, reader), arch, reader,
                          weights=storage_for(graph_info.weights, reader),
                          hidden_output=deferred.mtp)
    recomputed = graph.graph.initializers
    count = 0
    for name, value in model.graph.initializers.items():
        reference = value.const_value
        if not isinstance(reference, ir.ExternalTensor) or reference.location != deferred.file:
            continue
        tensor = recomputed[name].const_value if name in recomputed else None
        if tensor is None or tensor.dtype != reference.dtype or tensor.shape != reference.shape:
            raise InputError(f"{export_dir / ONNX_MODEL}: its weight {name} is not what the exporter makes of {source} "
                             f"(its weights file {deferred.file} was left to be recomputed from that checkpoint)")
        tensor.metadata_props.clear()  # the graph file's, which compression reads
        tensor.metadata_props.update(reference.metadata_props)
        value.const_value = tensor
        count += 1
    log(f"{count} weights read from {source} as they are compressed (the export left them there)")
