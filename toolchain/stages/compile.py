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
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable


from toolchain import __version__
from toolchain.atomic import atomic_output_dir
from toolchain.compile import copy_checkpoint_files, onnxruntime_artifact, openvino_ir
from toolchain.errors import InputError, ParityError

BACKENDS = ("openvino", "onnxruntime")
VERIFY_TOKENS = 8
REQUIRED_INPUTS = ("input_ids", "attention_mask", "position_ids")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object")
    return data


def read_export(export_dir: Path) -> tuple[dict, Path]:
    """The export's report and its source checkpoint directory, checked before anything is written."""
    if not export_dir.is_dir():
        raise InputError(f"{export_dir} is not a directory (expected the output of dstc export)")
    if not (export_dir / "model.onnx").is_file() and not (export_dir / openvino_ir.MODEL_XML).is_file():
        raise InputError(f"{export_dir} has no model.onnx: run dstc export first")
    if not (export_dir / "export.json").is_file():
        raise InputError(f"{export_dir} has no export.json: not a dstc export")
    report = _read_json(export_dir / "export.json")
    try:
        source = Path(report["source"]["path"])
        inputs = report["graph"]["inputs"]
    except (KeyError, TypeError):
        raise InputError(f"{export_dir / 'export.json'} lacks source.path or graph.inputs") from None
    failed = [b for b, r in (report.get("parity") or {}).items() if isinstance(r, dict) and not r.get("passed", True)]
    if failed:
        raise InputError(f"{export_dir} failed its parity check on {', '.join(failed)} (see its export.json); "
                         f"fix the export before compiling it")
    missing = [n for n in REQUIRED_INPUTS if n not in inputs]
    if missing or not any(n.startswith("past_key_values.") for n in inputs):
        raise InputError(f"{export_dir / 'model.onnx'} is not a decoder with a KV cache (inputs {inputs})")
    if not (source / "config.json").is_file():
        raise InputError(f"the export's source checkpoint {source} is gone (no config.json); the compiled artifact "
                         f"needs its config and tokenizer files")
    return report, source


def _verify(backend: str, artifact: Path, input_dir: Path, source: Path, past_specs: dict, new_tokens: int,
            log: Callable[[str], None]) -> dict:
    """Greedy tokens and logits of the compiled artifact against a reference, on the export's parity prompts.

    The reference is PyTorch fp32 on the source checkpoint, except for a compressed input: its weights differ
    from the checkpoint's by design (compression.json measures by how much), so compiling is checked against
    the compressed graph itself, run stateless on the same runtime.
    """
    from toolchain import source as sources
    from toolchain.export.parity import (TOLERANCES, compare_steps, graph_step, onnxruntime_runner,
                                         openvino_runner, torch_step)
    from toolchain.stages.export import parity_cases

    model = sources.load(sources.resolve(str(source)), False)
    cases = parity_cases(source, model.config.vocab_size)
    compressed = (input_dir / "compression.json").is_file()
    if compressed:
        input_graph = input_dir / ("model.onnx" if backend == "onnxruntime" else openvino_ir.MODEL_XML)
        run = (onnxruntime_runner if backend == "onnxruntime" else openvino_runner)(input_graph)
        past_specs = past_specs or openvino_ir.cache_dims(input_graph)
        reference, new_reference = "compressed input graph", lambda: graph_step(run, past_specs)  # noqa: E731
    else:
        reference, new_reference = "pytorch fp32", lambda: torch_step(model)  # noqa: E731
    log(f"verifying the {backend} artifact against {reference}: {len(cases)} cases, {new_tokens} greedy tokens")
    if backend == "openvino":
        compiled = openvino_ir.compile_ir(artifact / openvino_ir.MODEL_XML)
        new_step = lambda: openvino_ir.stateful_step(compiled)  # noqa: E731
    else:
        artifact_run = onnxruntime_runner(artifact / onnxruntime_artifact.MODEL)
        new_step = lambda: graph_step(artifact_run, past_specs)  # noqa: E731
    result = compare_steps(new_reference, new_step, cases, new_tokens, model.config.pad_token_id or 0,
                           TOLERANCES[backend])
    return {**result, "reference": reference, "new_tokens": new_tokens}


def compile_artifact(export_dir: Path, out_dir: Path, backend: str, *, verify: bool = True,
                     new_tokens: int = VERIFY_TOKENS, log: Callable[[str], None] = lambda _: None) -> dict:
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    report, source = read_export(export_dir)
    config = _read_json(source / "config.json")
    generation = _read_json(source / "generation_config.json") if (source / "generation_config.json").is_file() else {}
    has_tokenizer = (source / "tokenizer.json").is_file()
    timings = {}
    with atomic_output_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        if backend == "openvino":
            versions = {"transformers_version": config.get("transformers_version", ""),
                        "dstc_version": __version__}
            graph = export_dir / openvino_ir.MODEL_XML
            details = openvino_ir.write(graph if graph.is_file() else export_dir / "model.onnx", source, tmp,
                                        versions, has_tokenizer, log)
        else:
            details = onnxruntime_artifact.write(export_dir / "model.onnx", tmp, config, generation, log)
        past_specs = details.pop("past_specs", None)
        files = details.pop("files") + copy_checkpoint_files(source, tmp)
        timings["compile_s"] = time.perf_counter() - t0
        verification = None
        if verify:
            t0 = time.perf_counter()
            verification = _verify(backend, tmp, export_dir, source, past_specs, new_tokens, log)
            timings["verify_s"] = time.perf_counter() - t0
        manifest = {
            "dstc_version": __version__,
            "backend": backend,
            "export": {"dir": str(export_dir), "source": report["source"]},
            "model_type": config["model_type"],
            "tokenizer": has_tokenizer,
            "files": sorted(files + ["compile.json"]),
            backend: details,
            "verification": verification,
            "timings": {k: round(v, 3) for k, v in timings.items()},
        }
        (tmp / "compile.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if verification is not None and not verification["passed"]:
        raise ParityError(f"the {backend} artifact disagrees with {verification['reference']} (relative diff "
                          f"{verification['max_relative_diff']:.2e}, tokens identical: "
                          f"{verification['tokens_identical']}); "
                          f"details in {out_dir / 'compile.json'}")
    return manifest
