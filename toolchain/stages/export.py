"""Stage 1: checkpoint -> DIR/model.onnx (+ external data when large) and DIR/export.json with parity figures."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx_ir as ir

from toolchain import __version__
from toolchain.atomic import atomic_output_dir
from toolchain.errors import ParityError
from toolchain.export.architectures import architecture_for
from toolchain.export.decoder import build_decoder
from toolchain.export.parity import Case, compare
from toolchain import source as sources

# Above this many bytes of weights the graph keeps them in model.onnx.data (protobuf's 2 GB limit, and a
# graph file that tools can open quickly).
EXTERNAL_DATA_BYTES = 1 << 30
PARITY_BACKENDS = ("onnxruntime", "openvino")
PROMPTS = (
    "12+345=",
    "the old man walked to the market with a basket of apples, and the children followed him along the river "
    "because they wanted to see the boats. 607+58=",
    "where is the red book?",
)


def parity_cases(source_path: Path, vocab_size: int) -> list[Case]:
    """Prompts of several lengths, alone and as a left-padded batch of two; text when the checkpoint has a
    tokenizer, seeded random ids otherwise."""
    prompts = []
    if (source_path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source_path)
        prompts = [[t for t in tok(p, add_special_tokens=False)["input_ids"] if t < vocab_size] for p in PROMPTS]
    if not prompts or not all(prompts):
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, vocab_size, n).tolist() for n in (5, 48, 11)]
    short, long, other = prompts
    return [Case("short", [short]), Case("long", [long]), Case("batch2-left-padded", [other, short])]


def save_graph(model: ir.Model, path: Path) -> list[str]:
    weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values())
    if weight_bytes > EXTERNAL_DATA_BYTES:
        ir.save(model, path, external_data=path.name + ".data")
        return [path.name, path.name + ".data"]
    ir.save(model, path)
    return [path.name]


def export(spec: str, out_dir: Path, *, trust_remote_code: bool = False, parity: tuple[str, ...] = PARITY_BACKENDS,
           new_tokens: int = 16, revision: str | None = None, log: Callable[[str], None] = lambda _: None) -> dict:
    source = sources.resolve(spec, revision)
    arch = architecture_for(source.config["model_type"])
    timings = {}
    t0 = time.perf_counter()
    log(f"loading {source.spec} ({source.config['model_type']}) from {source.path}")
    model = sources.load(source, trust_remote_code)
    timings["load_s"] = time.perf_counter() - t0
    with atomic_output_dir(out_dir) as tmp:
        t0 = time.perf_counter()
        log("building the ONNX graph")
        graph = build_decoder(model, arch, on_layer=lambda i, n: log(f"built layer {i}/{n}") if n > 8 else None)
        files = save_graph(graph, tmp / "model.onnx")
        graph_info = {"files": files, "opset": graph.opset_imports[""], "nodes": len(graph.graph),
                      "inputs": [v.name for v in graph.graph.inputs],
                      "outputs": [v.name for v in graph.graph.outputs],
                      "kv_cache": graph.metadata_props["dstc.kv_cache"],
                      "size_bytes": sum((tmp / f).stat().st_size for f in files)}
        del graph  # its weight copies; the backends load the saved file
        timings["build_s"] = time.perf_counter() - t0
        cached_heads, key_dim, value_dim = arch.cache_dims(model.config)
        past_specs = {name: (cached_heads, key_dim if name.endswith(".key") else value_dim)
                      for name in graph_info["inputs"] if name.startswith("past_key_values.")}
        cases = parity_cases(source.path, model.config.vocab_size)
        pad_id = model.config.pad_token_id or 0
        results = {}
        for backend in parity:
            t0 = time.perf_counter()
            log(f"parity: {backend} vs PyTorch fp32, {len(cases)} cases, prefill + {new_tokens} greedy tokens")
            results[backend] = compare(model, tmp / "model.onnx", backend, cases, past_specs, new_tokens, pad_id)
            timings[f"parity_{backend}_s"] = time.perf_counter() - t0
        report = {
            "dstc_version": __version__,
            "source": {"spec": source.spec, "kind": source.kind, "path": str(source.path),
                       "model_type": model.config.model_type,
                       "parameters": sum(p.numel() for p in model.parameters())},
            "graph": graph_info,
            "parity": results,
            "timings": {k: round(v, 3) for k, v in timings.items()},
        }
        (tmp / "export.json").write_text(json.dumps(report, indent=2) + "\n")
    del model
    gc.collect()  # transformers models hold reference cycles; the next stage may load another full copy
    failed = [b for b, r in results.items() if not r["passed"]]
    if failed:
        worst = {b: f"{results[b]['max_relative_diff']:.2e}" for b in failed}
        raise ParityError(f"exported graph disagrees with PyTorch on {', '.join(failed)} (relative diff {worst}); "
                          f"details in {out_dir / 'export.json'}")
    return report
