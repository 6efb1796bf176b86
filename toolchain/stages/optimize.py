"""Stage: an export directory (model.onnx + export.json) -> OUT/model.onnx rewritten for one runtime, OUT/passes.json.

The target's pipeline (``passes.targets``) or a given list of registered passes runs on the graph, with the
target's default expectations per model type and depth (e.g. one GroupQueryAttention per layer for Llama/Qwen2
under ``onnxruntime``) unless others are given; a pass that misses one fails the stage with its closest
near-miss. The rewritten graph then goes through the export's parity check against the PyTorch source
(prefill + greedy decode, left-padded batch) on the target's runtime. passes.json records per-pass stats,
op-type counts before and after, the parity figures, and for ``openvino`` the fusions OpenVINO's CPU plugin
made when compiling the graph (in the stateful form the compile stage builds, and as the stateless graph).
OUT also gets the export's export.json unchanged (the graph interface does not change), so ``dstc compile``
takes an optimised directory as it takes an export.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx_ir as ir

# from the modules, not the package's lazy names: a stage id hashes the code its imports reach (source_hashes)
from passes.errors import PassError
from passes.pipeline import run_pipeline
from passes.registry import get_pass
from passes.targets import PIPELINES, expectations_for, pipeline
from toolchain import __version__, source as sources
from toolchain.atomic import atomic_output_dir
from toolchain.compile import openvino_ir
from toolchain.errors import InputError, ParityError
from toolchain.interface.reports import PassesReport
from toolchain.pass_errors import to_dstc_error
from toolchain.recipe import PassesSection
from toolchain.runtime.engines import openvino_compile
from toolchain.stages.context import StageContext
from toolchain.stages.inputs import carry_mtp, check_weights_written, read_export
from toolchain.verify.parity import compare, parity_cases, too_large_for_end_to_end

TARGETS = tuple(PIPELINES)
# Greedy steps of the parity check (the context's check_tokens: tests shorten it).
PARITY_TOKENS = 16
# OpenVINO CPU runtime layer types of the fusions the openvino target is shaped for.
OPENVINO_FUSIONS = ("ScaledDotProductAttention", "RoPE", "RMS")


def op_type_counts(model: ir.Model) -> dict[str, int]:
    """Nodes of the main graph by op type, ``domain.Op`` for non-default domains."""
    counts = Counter(f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type for n in model.graph)
    return dict(sorted(counts.items()))


def pass_names(target: str, passes: list[str] | None) -> list[str]:
    """The passes to run (the target's pipeline unless given), each checked to exist and to be for the target."""
    if target not in TARGETS:
        raise InputError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    names = pipeline(target) if passes is None else list(passes)
    if not names:
        raise InputError("the pass list is empty")
    for name in names:
        try:
            info = get_pass(name)
        except PassError as e:
            raise InputError(str(e)) from None
        if target not in info.targets and "any" not in info.targets:
            raise InputError(f"pass {name!r} is for {', '.join(info.targets)}, not for target {target!r}")
    return names


def openvino_fusions(onnx_path: Path) -> dict[str, dict[str, int]]:
    """How many SDPA, RoPE and RMS layers OpenVINO's CPU plugin makes of the graph (f32 inference precision).

    ``stateful``: the IR as the compile stage builds it (KV cache in variables, beam_idx), the form OpenVINO
    serves LLMs in and the only one in which the CPU plugin keeps SDPA (it decomposes SDPA in stateless models).
    ``stateless``: the ONNX graph converted and compiled as the parity check runs it.
    """
    import openvino as ov

    def layer_types(model) -> dict[str, int]:
        compiled = openvino_compile(model, "exact")
        counts = Counter(op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops())
        return {name: counts.get(name, 0) for name in OPENVINO_FUSIONS}

    return {"stateful": layer_types(openvino_ir.convert(onnx_path, {})),
            "stateless": layer_types(ov.convert_model(str(onnx_path)))}


def _parity(source: Path, onnx_path: Path, backend: str, new_tokens: int, log: Callable[[str], None]) -> dict:
    # torch loads only where parity runs
    from toolchain.reference.whole import TorchDecoder

    reference = TorchDecoder(sources.resolve(str(source)))
    config = reference.model.config
    cases = parity_cases(source, config.vocab_size)
    log(f"parity: optimised graph on {backend} vs PyTorch fp32, {len(cases)} cases, prefill + {new_tokens} tokens")
    return compare(reference, onnx_path, backend, cases, new_tokens, config.pad_token_id or 0)


def optimize(in_dir: Path, out_dir: Path, section: PassesSection, context: StageContext) -> dict:
    """Rewrite IN/model.onnx for the section's target ("onnxruntime" or "openvino") into OUT; returns passes.json's
    content.

    The section's ``passes``: registered pass names to run instead of the target's pipeline (each must be for the
    target or for any runtime); ``expect``: {pass: {"min"/"max"/"count": ...}} replacing the defaults, which are the
    target's per-model-type counts for the passes that run ({} checks nothing). The plan's ``passes_parity``: check
    the rewritten graph against PyTorch. Raises InputError for bad input, OptimizeError when a pass fails or misses an
    expectation (nothing is written), and ParityError when the optimised graph disagrees with PyTorch (the output is
    kept for inspection).
    """
    # torch loads only when the stage runs, not when its pass names are checked
    from toolchain.export.graph import load_graph, save_graph

    in_dir, out_dir, target, log = Path(in_dir), Path(out_dir), section.target, context.log
    names = pass_names(target, section.passes)
    export_report, source = read_export(in_dir, context.source)
    check_weights_written(export_report, in_dir,
                          "the passes stage needs an export with its weights: run dstc export")
    timings = {}
    t0 = time.perf_counter()
    model = load_graph(in_dir / "model.onnx")
    expectations = section.expect
    if expectations is None:
        expectations = expectations_for(model, target, names)
    before = {"nodes": len(model.graph), "op_types": op_type_counts(model)}
    timings["load_s"] = time.perf_counter() - t0
    log(f"running {len(names)} passes for {target}: {', '.join(names)}")
    t0 = time.perf_counter()
    try:
        stats = run_pipeline(model, names, expectations=expectations)
    except PassError as e:
        raise to_dstc_error(e) from e
    timings["passes_s"] = time.perf_counter() - t0
    with atomic_output_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        files = save_graph(model, tmp / "model.onnx") + carry_mtp(in_dir, tmp)
        after = {"nodes": len(model.graph), "op_types": op_type_counts(model),
                 "opsets": dict(sorted(model.opset_imports.items())), "files": files}
        del model  # its weight copies; the runtimes load the saved file
        shutil.copyfile(in_dir / "export.json", tmp / "export.json")
        timings["save_s"] = time.perf_counter() - t0
        report: dict[str, Any] = {
            "dstc_version": __version__,
            "target": target,
            "input": {"dir": str(in_dir), "source": export_report.get("source"), **before},
            "output": after,
            "pipeline": names,
            "expectations": expectations,
            "passes": [stat.to_dict() for stat in stats],
            "counts": _counts(stats),
        }
        _check(report, tmp, source, target, context, timings)
        report = PassesReport(**report).dump()
        (tmp / "passes.json").write_text(json.dumps(report, indent=2) + "\n")
    result = (report.get("parity") or {}).get(target)
    if result is not None and not result["passed"]:
        raise ParityError(f"the graph optimised for {target} disagrees with PyTorch (relative diff "
                          f"{result['max_relative_diff']:.2e}); details in {out_dir / 'passes.json'}")
    return report


def _counts(stats) -> dict[str, dict[str, int]]:
    """What each pass rewrote, summed over its runs (passes without a rewrite left out)."""
    fusions: dict[str, Counter] = {}
    for stat in stats:
        fusions.setdefault(stat.name, Counter()).update(stat.counts)
    return {name: dict(c) for name, c in fusions.items() if c}


def _check(report: dict, tmp: Path, source: Path, target: str, context: StageContext, timings: dict) -> None:
    """OpenVINO's fusion count and the parity check of the written graph, into ``report`` (with its timings),
    unless the model is too large to run end to end here."""
    parity, log = context.plan.passes_parity, context.log
    skipped = too_large_for_end_to_end(source)
    if target == "openvino" and not skipped:
        t0 = time.perf_counter()
        log("compiling with OpenVINO to count its SDPA / RoPE / RMS fusions")
        report["openvino_fusions"] = openvino_fusions(tmp / "model.onnx")
        timings["openvino_fusions_s"] = time.perf_counter() - t0
    if skipped and (parity or target == "openvino"):
        log(f"parity and OpenVINO's fusion count skipped: {skipped}")
        report["parity_skipped"] = skipped
    elif parity:
        t0 = time.perf_counter()
        report["parity"] = {target: _parity(source, tmp / "model.onnx", target, context.check_tokens or PARITY_TOKENS,
                                            log)}
        timings[f"parity_{target}_s"] = time.perf_counter() - t0
    report["timings"] = {k: round(v, 3) for k, v in timings.items()}
