"""Stage: an export directory (model.onnx + export.json) -> a compiled artifact for one runtime.

- ``openvino``: a stateful OpenVINO IR with tokenizer/detokenizer IR, for openvino_genai's LLMPipeline and
  optimum-intel's OVModelForCausalLM (toolchain/compile/openvino_ir.py);
- ``onnxruntime``: the graph with ORT's portable offline optimisations and external weights, plus
  genai_config.json for onnxruntime-genai where it can describe the model (toolchain/compile/onnxruntime_artifact.py).

Both copy the checkpoint's config, generation config and tokenizer files beside the graph, and write
compile.json. Unless ``verify=False``, the compiled artifact then runs the export's parity prompts (short,
long, a left-padded batch of two) through prefill and greedy decode against PyTorch fp32 on the source
checkpoint: the greedy tokens must be identical and the logits within the export's tolerance for that
runtime, or a ParityError is raised (the artifact is kept for inspection).

Before that, unless ``smoke=False``, the artifact runs at its runtime's deployment defaults (OpenVINO's bf16 where
the CPU has it and the artifact's f16 KV cache, which the f32 verification does not exercise) in a child process
(toolchain/verify/smoke.py): prompts of 1, 2, 7 and 16 tokens and a left-padded batch of two, prefill and a
few decode steps, every logit finite. A crash, a hang or non-finite logits raise RuntimeCrashError naming the
signal and the prompt, and nothing is written. compile.json records the result under ``smoke``.

Both run the artifact, which takes about RUN_MEMORY_FACTOR times its weight bytes of RAM: an artifact too large to
run on the building machine (DeepSeek-V3 at 61 layers is ~350 GB in INT4) is built without them, and compile.json
says why under ``smoke`` and ``verification`` (``skipped``), instead of the build running out of memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from toolchain import __version__, source as sources
from toolchain.atomic import atomic_output_dir
from toolchain.compile import copy_checkpoint_files, onnxruntime_artifact, openvino_ir
from toolchain.errors import ParityError
from toolchain.hardware import memory_bytes
from toolchain.interface.files import (
    COMPILE_REPORT,
    COMPRESSION_REPORT,
    CONFIG,
    GENERATION_CONFIG,
    MODEL_XML,
    MTP_DIR,
    ONNX_MODEL,
    ONNX_WEIGHTS,
    TOKENIZER,
    weights_of,
)
from toolchain.interface.graph import cache_dtype, graph_metadata
from toolchain.interface.reports import CompileReport, read_json
from toolchain.recipe import CompileSection
from toolchain.runtime.decoder import Decoder, OnnxRuntimeDecoder, OpenVINODecoder
from toolchain.stages.context import StageContext
from toolchain.stages.inputs import check_weights_written, read_export
from toolchain.verify import smoke as smoke_test
from toolchain.verify.parity import compare_decoders, graph_decoder, parity_cases, tolerance, too_large_for_end_to_end

VERIFY_TOKENS = 8


# RSS of running an artifact over its weight bytes: OpenVINO maps the .bin and repacks the weights into its own
# buffers (7.95 GiB measured for the 4.3 GB INT4 IR of R1-Distill-Qwen-7B widths after a prefill); the compressed
# reference of a verification runs after the artifact, not beside it.
RUN_MEMORY_FACTOR = 2.0
WEIGHT_FILES = (weights_of(MODEL_XML), ONNX_MODEL, ONNX_WEIGHTS)


def too_large_to_run(artifact: Path) -> str | None:
    """Why the artifact is not run on this machine (smoke test, verification), or None."""
    weights = sum((artifact / name).stat().st_size for name in WEIGHT_FILES if (artifact / name).is_file())
    need, ram = RUN_MEMORY_FACTOR * weights, memory_bytes()
    if need <= ram:
        return None
    return (f"running the artifact takes about {need / 2**30:.1f} GiB ({RUN_MEMORY_FACTOR:g}x its "
            f"{weights / 2**30:.1f} GiB of weights), more than this machine's {ram / 2**30:.1f} GiB")


def _verify(backend: str, artifact: Path, input_dir: Path, source: Path, new_tokens: int,
            log: Callable[[str], None]) -> dict:
    """Greedy tokens and logits of the compiled artifact (its runtime's decoder, at exact numerics) against a
    reference, on the export's parity prompts.

    The reference is PyTorch fp32 on the source checkpoint, except for a compressed input: its weights differ
    from the checkpoint's by design (compression.json measures by how much), so compiling is checked against
    the compressed graph itself, run stateless on the same runtime.
    """
    # torch loads only where the verification runs
    from toolchain.reference.whole import TorchDecoder

    config = read_json(source / CONFIG)
    cases = parity_cases(source, config["vocab_size"])
    ref_decoder: Decoder | Callable[[], Decoder]
    decoder: Callable[[], Decoder]
    if (input_dir / COMPRESSION_REPORT).is_file():
        input_graph = input_dir / MODEL_XML
        if backend == "onnxruntime" or not input_graph.is_file():  # compressed in ONNX (ORT, or streamed)
            input_graph = input_dir / ONNX_MODEL
        reference, ref_decoder = "compressed input graph", lambda: graph_decoder(input_graph, backend)
    else:
        skipped = too_large_for_end_to_end(source)
        if skipped:
            log(f"verification skipped: {skipped}")
            return {"passed": True, "skipped": skipped, "reference": "none", "new_tokens": 0}
        reference, ref_decoder = "pytorch fp32", TorchDecoder(sources.resolve(str(source)))
    log(f"verifying the {backend} artifact against {reference}: {len(cases)} cases, {new_tokens} greedy tokens")
    if backend == "openvino":
        decoder = lambda: OpenVINODecoder(artifact / MODEL_XML, None, (), "exact")  # noqa: E731
    else:
        decoder = lambda: OnnxRuntimeDecoder(artifact / ONNX_MODEL, None, ())  # noqa: E731
    graph = artifact / (MODEL_XML if backend == "openvino" else ONNX_MODEL)
    result = compare_decoders(ref_decoder, decoder, cases, new_tokens, config.get("pad_token_id") or 0,
                              tolerance(backend, cache_dtype(graph_metadata(graph))))
    return {**result, "reference": reference, "new_tokens": new_tokens}


def _compile_mtp(backend: str, graph: Path, out_dir: Path, config: dict, log: Callable[[str], None]) -> list[str]:
    """The export's MTP graph (toolchain/export/mtp.py), when it has one, compiled into ``out_dir`` (the artifact's
    mtp/): a stateless OpenVINO IR, or ORT's offline optimisation with external weights; its files, relative to the
    artifact."""
    if not graph.is_file():
        return []
    out_dir.mkdir()
    log(f"compiling the MTP layer's graph for {backend}")
    if backend == "openvino":
        import openvino as ov

        # Stateless: OpenVINO 2026.4's CPU plugin moves the one-layer graph's cache initializers into its ReadValues
        # (nothing else reads them, unlike the main graph's) and then mis-sizes the state once a longer sequence
        # follows a shorter one ("Can not clone with new dims"; Add shapes in the attention). The cache contract is
        # the main graph's, kept by the caller (StatelessDecoder), which also cuts it back for free.
        ov.save_model(openvino_ir.stable_names(ov.convert_model(str(graph))), out_dir / MODEL_XML,
                      compress_to_fp16=False)
    else:
        onnxruntime_artifact.optimize(graph, out_dir / ONNX_MODEL)
    return sorted(f"{MTP_DIR}/{p.name}" for p in out_dir.iterdir())


def _verify_mtp(backend: str, mtp_dir: Path, source: Path, new_tokens: int, log: Callable[[str], None]) -> dict:
    """The compiled MTP layer (its runtime's decoder, exact numerics, its own cache) against its PyTorch reference
    on the export's parity prompts (toolchain/verify/mtp_parity.py)."""
    # torch loads only where the verification runs
    from toolchain.reference.whole import reference_model
    from toolchain.verify.mtp_parity import compare_mtp, reference_mtp

    config = read_json(source / CONFIG)
    cases = parity_cases(source, config["vocab_size"])
    model = reference_model(sources.resolve(str(source)))
    log(f"verifying the {backend} artifact's MTP layer against pytorch fp32: {len(cases)} cases")
    decoder: Callable[[], Decoder]
    if backend == "openvino":
        decoder = lambda: graph_decoder(mtp_dir / MODEL_XML, backend)  # noqa: E731 - a stateless IR (_compile_mtp)
    else:
        decoder = lambda: OnnxRuntimeDecoder(mtp_dir / ONNX_MODEL, None, ())  # noqa: E731
    graph = mtp_dir / (MODEL_XML if backend == "openvino" else ONNX_MODEL)
    result = compare_mtp(model, reference_mtp(model, source), {backend: decoder}, cases, new_tokens,
                         config.get("pad_token_id") or 0, cache_dtype(graph_metadata(graph)))
    return {**result[backend], "reference": "pytorch fp32"}


def compile_artifact(export_dir: Path, out_dir: Path, section: CompileSection, context: StageContext) -> dict:
    """Compile IN (an export, passes or compress output) into an artifact for the section's backend, then smoke-test
    and verify it as the section says (see the module doc). The context's ``release_input``: the input directory is
    deleted after this stage (a build that keeps no stages), so the ONNX Runtime backend may give up its weights as
    it writes the artifact's; called before they are touched."""
    export_dir, out_dir, backend, log = Path(export_dir), Path(out_dir), section.backend, context.log
    report, source = read_export(export_dir, context.source)
    check_weights_written(report, export_dir,
                          "the compile stage needs an export with its weights: run dstc export")
    config = read_json(source / CONFIG)
    has_tokenizer = (source / TOKENIZER).is_file()
    timings = {}
    with atomic_output_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        files, details = _write(export_dir, tmp, section, source, config, has_tokenizer, context)
        mtp_files = _compile_mtp(backend, export_dir / MTP_DIR / ONNX_MODEL, tmp / MTP_DIR, config, log)
        files += mtp_files
        timings["compile_s"] = time.perf_counter() - t0
        smoke_result, verification, mtp = _checks(tmp, export_dir, section, source, mtp_files, context, timings)
        typed = CompileReport(dstc_version=__version__, backend=backend,
                              export={"dir": str(export_dir), "source": report["source"]},
                              model_type=config["model_type"], tokenizer=has_tokenizer,
                              files=sorted([*files, COMPILE_REPORT]), smoke=smoke_result, verification=verification,
                              timings={k: round(v, 3) for k, v in timings.items()}, mtp=mtp, **{backend: details})
        typed.write(tmp / COMPILE_REPORT)
        manifest = typed.dump()
    mtp_check = (mtp or {}).get("verification")
    if mtp_check is not None and not mtp_check["passed"]:
        raise ParityError(f"the {backend} artifact's MTP layer disagrees with PyTorch (relative diff "
                          f"{mtp_check['max_relative_diff']:.2e}, drafts identical: {mtp_check['drafts_identical']}); "
                          f"details in {out_dir / COMPILE_REPORT}")
    if verification is not None and not verification["passed"]:
        raise ParityError(f"the {backend} artifact disagrees with {verification['reference']} (relative diff "
                          f"{verification['max_relative_diff']:.2e}, tokens identical: "
                          f"{verification['tokens_identical']}); "
                          f"details in {out_dir / COMPILE_REPORT}")
    return manifest


def _write(export_dir: Path, tmp: Path, section: CompileSection, source: Path, config: dict, has_tokenizer: bool,
           context: StageContext) -> tuple[list[str], dict]:
    """The backend's artifact and the checkpoint's config, generation config and tokenizer files, written into
    ``tmp``: the files and the backend's details for compile.json."""
    log, release_input = context.log, context.release_input
    if section.backend == "openvino":
        versions = {"transformers_version": config.get("transformers_version", ""), "dstc_version": __version__}
        graph = export_dir / MODEL_XML
        details = openvino_ir.write(graph if graph.is_file() else export_dir / ONNX_MODEL, source, tmp, versions,
                                    has_tokenizer, log)
    else:
        generation = read_json(source / GENERATION_CONFIG) if (source / GENERATION_CONFIG).is_file() else {}
        if release_input is not None and section.verify and (export_dir / COMPRESSION_REPORT).is_file():
            log("the input's weights are kept until the verification has run the compressed graph")
            release_input = None
        details = onnxruntime_artifact.write(export_dir / ONNX_MODEL, tmp, config, generation, log, release_input)
    return details.pop("files") + copy_checkpoint_files(source, tmp), details


def _checks(tmp: Path, export_dir: Path, section: CompileSection, source: Path, mtp_files: list[str],
            context: StageContext, timings: dict) -> tuple[dict | None, dict | None, dict | None]:
    """The smoke test and the verification (of the MTP layer too) the section asks for, unless the artifact is too
    large to run here: compile.json's ``smoke``, ``verification`` and ``mtp``."""
    backend, smoke, verify, log = section.backend, section.smoke, section.verify, context.log
    new_tokens = context.check_tokens or VERIFY_TOKENS
    smoke_result = verification = None
    too_large = too_large_to_run(tmp) if smoke or verify else None
    if too_large:
        log(f"smoke test and verification skipped: {too_large}")
        smoke_result = {"passed": True, "skipped": too_large} if smoke else None
        verification = {"passed": True, "skipped": too_large, "reference": "none", "new_tokens": 0} \
            if verify else None
    if smoke and not too_large:  # first: a crash in the in-process verification would take this process down
        t0 = time.perf_counter()
        smoke_result = smoke_test.run_smoke(tmp, backend, log)
        timings["smoke_s"] = time.perf_counter() - t0
    if verify and not too_large:
        t0 = time.perf_counter()
        verification = _verify(backend, tmp, export_dir, source, new_tokens, log)
        timings["verify_s"] = time.perf_counter() - t0
    mtp: dict | None = None
    if mtp_files:
        mtp = {"files": mtp_files, "verification": None}
        if verify and not too_large:
            t0 = time.perf_counter()
            mtp["verification"] = _verify_mtp(backend, tmp / MTP_DIR, source, new_tokens, log)
            timings["verify_mtp_s"] = time.perf_counter() - t0
    return smoke_result, verification, mtp
