"""What weight compression costs in accuracy and buys in size, per model and scheme, against the fp32 export.

For each model (the embedded models that exist, else random stand-ins with the embedded configs and tokenizer)
the fp32 export and each compressed variant (``dstc compress`` via toolchain.stages.compress) are evaluated the
same way, on the graph the runtime runs (ONNX Runtime for the onnxruntime target, OpenVINO CPU f32 for openvino):

* size of the weights' files and bits per weight (from compression.json);
* KL(fp32 || compressed) and top-1 agreement of next-token distributions over every position of held-out text;
* task exact-match on held-out arithmetic problems (greedy on the KV cache) and held-out text perplexity, as
  deltas to the fp32 graph (helpers in toolchain/models/train.py, the same as the models' training.json);
* routing agreement (the lowest MoE layer's, on calibration text, from compression.json).

Then: per-tensor vs per-head vs per-channel INT8 on the attention projections (same quantizer, the
int8-per-head pass's ``granularity``), o_proj's input-side head blocks vs per output channel (numpy), the ORT
kernels' speed on a decode-sized MatMul, and the peer comparison with ``optimum-cli export openvino
--weight-format int4`` on r1-distill-qwen-tiny.

    .venv/bin/python benchmarks/compression.py [--models NAME ...] [--problems 500] [--texts 200]
        [--skip-peer] [--skip-speed] [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

from toolchain.compress import metrics
from toolchain.verify.parity import graph_decoder
from toolchain.interface.graph import cache_spec
from toolchain.models.registry import EMBEDDED, embedded_path
from toolchain.recipe import CompressSection
from toolchain.runtime.engines import openvino_compile, ort_options, ort_session
from toolchain.runtime.generate import greedy_logits
from toolchain.stages.alone import compress, export

END_OF_LINE = "\n"
NEW_TOKENS = 6  # four answer digits, the newline, one spare
# name, target, options
VARIANTS = [
    ("int4 g128 asym", "onnxruntime", dict(scheme="int4-grouped")),
    ("int4 g128 asym", "openvino", dict(scheme="int4-grouped")),
    ("int4 g128 sym", "onnxruntime", dict(scheme="int4-grouped", sym=True)),
    ("int8 per-channel", "onnxruntime", dict(scheme="int8-per-channel")),
    ("int8 per-channel", "openvino", dict(scheme="int8-per-channel")),
    ("int8 per-head", "onnxruntime", dict(scheme="int8-per-head")),
    ("int4 + lm_head int4", "onnxruntime", dict(scheme="int4-grouped", lm_head="int4")),
    ("int4 + embeddings int4", "openvino", dict(scheme="int4-grouped", embeddings="int4")),
    ("int4 g128 asym acc0", "onnxruntime", dict(scheme="int4-grouped", accuracy_level=0)),
    ("int8 per-channel acc0", "onnxruntime", dict(scheme="int8-per-channel", accuracy_level=0)),
    ("int8 per-head acc0", "onnxruntime", dict(scheme="int8-per-head", accuracy_level=0)),
]
MOE_VARIANTS = [
    ("int4 + router int4", "onnxruntime", dict(scheme="int4-grouped", router="scheme")),
    ("int4 + shared experts int8", "onnxruntime", dict(scheme="int4-grouped", shared_experts="int8")),
]


def checkpoints(root: Path, names: list[str] | None) -> dict[str, tuple[Path, bool]]:
    """name -> (checkpoint, trained). Missing embedded models are stood in for by random weights with the same
    config and tokenizer (so every code path runs; exact-match is then ~0 for every variant)."""
    out = {}
    for name in names or list(EMBEDDED):
        path = embedded_path(name)
        if (path / "model.safetensors").is_file():
            out[name] = (path, True)
            continue
        import torch
        from transformers import AutoModelForCausalLM

        from toolchain.models.configs import build_config
        from toolchain.models.tokenizer import build_tokenizer, save_tokenizer

        torch.manual_seed(0)
        stand_in = root / "random" / name
        AutoModelForCausalLM.from_config(build_config(name)).save_pretrained(stand_in)
        save_tokenizer(build_tokenizer(), stand_in)
        out[name] = (stand_in, False)
    return out


class Graph:
    """Prefill/decode steps of an exported or compressed graph on its runtime at exact numerics (batch, KV cache
    from the graph), as a Decoder of the runtime layer."""

    def __init__(self, directory: Path) -> None:
        xml = directory / "openvino_model.xml"
        self.decoder = graph_decoder(xml, "openvino") if xml.is_file() else \
            graph_decoder(directory / "model.onnx", "onnxruntime")

    def logits(self, ids: list[int]) -> np.ndarray:
        self.decoder.reset()
        return self.decoder.forward(np.asarray([ids]), np.ones((1, len(ids)), np.int64))[0]

    def generate(self, tokenizer, prompts: list[str]) -> list[str]:
        stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(tokenizer.tokenize(END_OF_LINE))[0]}
        encoded = [tokenizer(p)["input_ids"] for p in prompts]
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        out = [""] * len(prompts)
        for indices in by_length.values():
            tokens, _ = greedy_logits(self.decoder, [encoded[i] for i in indices], NEW_TOKENS, 0)
            for i, row in zip(indices, tokens.tolist()):
                end = next((j for j, t in enumerate(row) if t in stop), len(row))  # the line ends at a stop token
                out[i] = tokenizer.decode(row[:end])
        return out


def evaluate(graph: Graph, tokenizer, problems, texts) -> dict:
    from toolchain.models.train import exact_match

    logits = [graph.logits(ids) for ids in texts]
    nll = []
    for ids, lg in zip(texts, logits):
        lg = lg[:-1].astype(np.float64)
        log_p = lg - np.logaddexp.reduce(lg, -1, keepdims=True)
        nll.append(-log_p[np.arange(len(ids) - 1), np.asarray(ids[1:])])
    return {"exact_match": exact_match(lambda p: graph.generate(tokenizer, p), problems),
            "perplexity": float(np.exp(np.concatenate(nll).mean())), "logits": logits}


def compare(reference: dict, result: dict) -> dict:
    agreement = metrics.distribution_agreement(reference["logits"], result["logits"])
    return {"kl": agreement["kl_mean"], "top1": agreement["top1_agreement"],
            "exact_match": result["exact_match"], "em_delta_points": 100 * (result["exact_match"] - reference["exact_match"]),
            "perplexity": result["perplexity"], "ppl_delta": result["perplexity"] - reference["perplexity"]}


def granularity_rows(export_dir: Path, tokenizer, problems, texts, reference, head_width) -> list[dict]:
    """INT8 with per-tensor / per-head / per-channel scales on the attention head projections, everything else
    per channel: weight and output error of those projections, and the model-level metrics."""
    from passes.quantize.int8_per_head import HEAD_PROJECTIONS, Int8PerHead, projection_of
    from toolchain.compress import calibration, engine

    base = ir.load(export_dir / "model.onnx")
    weights = engine.graph_weights(base)
    specs = cache_spec((v.name, v.shape) for v in base.graph.inputs)
    feeds = [calibration.feeds(ids, specs) for ids in texts[:16]]
    rows_x, _, _ = metrics.capture(base, weights, feeds, {})
    heads = [w for w in weights if projection_of(w.name) in HEAD_PROJECTIONS]
    out = []
    for granularity in ("tensor", "head", "channel"):
        model = ir.load(export_dir / "model.onnx")
        Int8PerHead(granularity=granularity)(model)
        restored = metrics.restored_onnx(model, weights)
        directory = export_dir.parent / f"{export_dir.name}-int8-{granularity}"
        directory.mkdir(exist_ok=True)
        ir.save(model, directory / "model.onnx")
        result = evaluate(Graph(directory), tokenizer, problems, texts)
        werr = [metrics.relative_error(w.array, restored[w.name].array) for w in heads]
        oerr = [metrics.output_error(rows_x[w.name], w.array, restored[w.name].array) for w in heads]
        out.append({"granularity": granularity, "head_weight_error": float(np.mean(werr)),
                    "head_output_error": float(np.mean(oerr)), **compare(reference, result)})
    # o_proj: one scale per head's block of input rows vs one per output channel (numpy only)
    from passes.quantize._weights import quantize_int8

    o_rows = []
    for w in (w for w in weights if projection_of(w.name) == "o_proj"):
        x = rows_x[w.name]
        per_out = quantize_int8(w.array, 1).dequantize()
        per_in_head = quantize_int8(w.array.T, head_width(w.name)).dequantize().T
        o_rows.append((metrics.relative_error(w.array, per_out), metrics.output_error(x, w.array, per_out),
                       metrics.relative_error(w.array, per_in_head), metrics.output_error(x, w.array, per_in_head)))
    o = np.mean(o_rows, axis=0)
    out.append({"granularity": "o_proj per output channel vs per input-head block",
                "o_proj_per_channel": {"weight_error": o[0], "output_error": o[1]},
                "o_proj_per_input_head": {"weight_error": o[2], "output_error": o[3]}})
    return out


def kernel_speed(k: int = 2048, n: int = 2048, repeats: int = 200) -> list[dict]:
    """ms per call of a [1, K] x [K, N] weight MatMul on ORT in each form the stage can write."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from passes.quantize.int8_per_head import Int8PerHead
    from passes.quantize.matmul_nbits import ToMatMulNBits
    from toolchain.compress import engine

    rng = np.random.default_rng(0)
    w = rng.normal(size=(k, n)).astype(np.float32)
    x = rng.normal(size=(1, k)).astype(np.float32)

    def graph():
        proto = helper.make_model(helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
            [helper.make_tensor("w", TensorProto.FLOAT, [k, n], w.tobytes(), raw=True)]),
            opset_imports=[helper.make_opsetid("", 18)])
        return ir.serde.deserialize_model(proto)

    forms = {"fp32 MatMul": graph()}
    dq = graph()
    Int8PerHead(granularity="channel")(dq)
    forms["int8 DequantizeLinear->MatMul"] = dq
    for level in (0, 4):
        m = graph()
        Int8PerHead(granularity="channel")(m)
        ToMatMulNBits(level)(m)
        forms[f"int8 MatMulNBits acc{level}"] = m
        m4, _ = engine.compress_onnx(graph(), {"w": "int4"}, engine.Options(scheme="int4-grouped"), None, lambda _: None)
        ToMatMulNBits(level)(m4)
        forms[f"int4 g128 MatMulNBits acc{level}"] = m4
    rows = []
    for name, model in forms.items():
        for opt in ("default", "disabled"):
            options = ort_options(threads=2, level="all" if opt == "default" else None)
            if opt == "disabled":
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            session = ort_session(ir.serde.serialize_model(model).SerializeToString(), options)
            for _ in range(20):
                session.run(None, {"x": x})
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(repeats // 5):
                    session.run(None, {"x": x})
                samples.append((time.perf_counter() - t0) / (repeats // 5) * 1e3)
            rows.append({"form": name, "ort_optimizations": opt, "ms": float(np.median(samples))})
    return rows


def peer(checkpoint: Path, work: Path, tokenizer, texts, reference, ours: dict) -> dict:
    """optimum-cli export openvino --weight-format int4 (its defaults) on the same checkpoint: KL vs fp32."""
    out = work / "optimum-int4"
    from optimum_intel_env import OPTIMUM_CLI  # benchmarks/, this script's directory

    command = [str(OPTIMUM_CLI), "export", "openvino", "-m", str(checkpoint),
               "--weight-format", "int4", "--task", "text-generation-with-past", str(out)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    result = {"command": " ".join(command[1:]), "returncode": done.returncode,
              "seconds": round(time.perf_counter() - started, 1)}
    if done.returncode != 0:
        result["error"] = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return result
    log = done.stdout + done.stderr
    result["nncf_log"] = [line for line in log.splitlines() if "│" in line or "int4" in line.lower()][:12]
    compiled = openvino_compile(out / "openvino_model.xml", "exact")
    logits = []
    for ids in texts:
        request = compiled.create_infer_request()
        n = len(ids)
        feeds = {"input_ids": np.asarray([ids]), "attention_mask": np.ones((1, n), np.int64),
                 "position_ids": np.arange(n)[None], "beam_idx": np.zeros(1, np.int32)}
        feeds = {k: v for k, v in feeds.items() if k in {p.get_any_name() for p in compiled.inputs}}
        logits.append(np.array(request.infer(feeds)[compiled.output("logits")])[0])
    agreement = metrics.distribution_agreement(reference["logits"], logits)
    result.update({"optimum_kl": agreement["kl_mean"], "optimum_top1": agreement["top1_agreement"],
                   "ours_kl": ours["kl"], "ours_top1": ours["top1"],
                   "optimum_bin_bytes": (out / "openvino_model.bin").stat().st_size})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--problems", type=int, default=500)
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from toolchain.models import corpus

    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-compression-"))
    problems = corpus.task_examples("heldout", args.problems)
    results: dict = {"models": {}}
    for name, (checkpoint, trained) in checkpoints(work, args.models).items():
        print(f"== {name} ({'trained' if trained else 'random stand-in'})", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        texts = [tokenizer(t)["input_ids"] for t in corpus.text_samples("heldout", args.texts)]
        export_dir = work / name / "export"
        if not (export_dir / "export.json").is_file():
            export(str(checkpoint), export_dir, parity=())
        reference = evaluate(Graph(export_dir), tokenizer, problems, texts)
        rows = [{"variant": "fp32", "target": "onnxruntime", "size_bytes": (export_dir / "model.onnx").stat().st_size,
                 "bits_per_weight": 32.0, "exact_match": reference["exact_match"], "perplexity": reference["perplexity"]}]
        config = json.loads((checkpoint / "config.json").read_text())
        variants = VARIANTS + (MOE_VARIANTS if config["model_type"].startswith("deepseek") else [])
        for label, target, options in variants:
            out = work / name / f"{label.replace(' ', '_')}-{target}"
            t0 = time.perf_counter()
            report = compress(export_dir, out, CompressSection(**options), target=target)
            seconds = time.perf_counter() - t0
            weights_bytes = sum(v for f, v in report["file_sizes"].items() if not f.endswith(".xml"))
            row = {"variant": label, "target": target, "size_bytes": weights_bytes,
                   "bits_per_weight": report["weights"]["bits_per_weight"],
                   "routing_agreement_min": report["routing_agreement_min"], "compress_s": round(seconds, 1),
                   **compare(reference, evaluate(Graph(out), tokenizer, problems, texts))}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if name == "r1-distill-qwen-tiny" and label == "int4 g128 asym" and target == "openvino":
                ours_ov = row
        layout = json.loads((checkpoint / "config.json").read_text())
        width = (layout.get("v_head_dim") if "v_head_dim" in layout
                 else layout["hidden_size"] // layout["num_attention_heads"])
        granularity = granularity_rows(export_dir, tokenizer, problems, texts, reference, lambda _: width)
        for row in granularity:
            print(json.dumps(row, default=float), flush=True)
        results["models"][name] = {"trained": trained, "rows": rows, "granularity": granularity}
        if name == "r1-distill-qwen-tiny" and not args.skip_peer:
            results["peer"] = peer(checkpoint, work / name, tokenizer, texts, reference, ours_ov)
            print(json.dumps(results["peer"], default=str), flush=True)
    if not args.skip_speed:
        results["kernel_speed"] = kernel_speed()
        for row in results["kernel_speed"]:
            print(json.dumps(row), flush=True)
    print_tables(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=float) + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


def print_tables(results: dict) -> None:
    print("\n| model | variant | target | size KiB | bits/w | KL | top-1 | EM | ΔEM pts | ppl | Δppl | routing |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, model in results["models"].items():
        tag = name if model["trained"] else f"{name} (random)"
        for r in model["rows"]:
            routing = r.get("routing_agreement_min")
            print(f"| {tag} | {r['variant']} | {r['target']} | {r['size_bytes'] / 1024:.0f} | "
                  f"{r['bits_per_weight']:.2f} | {r.get('kl', 0):.2e} | {r.get('top1', 1):.4f} | "
                  f"{r['exact_match']:.3f} | {r.get('em_delta_points', 0):+.1f} | {r['perplexity']:.4f} | "
                  f"{r.get('ppl_delta', 0):+.4f} | {'' if routing is None else f'{routing:.4f}'} |")
    print("\n| model | int8 scales on q/k/v (MLA q_b/kv_b) | weight err | output err | KL | top-1 | ΔEM pts |")
    print("|---|---|---|---|---|---|---|")
    for name, model in results["models"].items():
        for r in model["granularity"]:
            if "head_weight_error" in r:
                print(f"| {name} | per-{r['granularity']} | {r['head_weight_error']:.2e} | "
                      f"{r['head_output_error']:.2e} | {r['kl']:.2e} | {r['top1']:.4f} | {r['em_delta_points']:+.1f} |")
            else:
                a, b = r["o_proj_per_channel"], r["o_proj_per_input_head"]
                print(f"| {name} | o_proj: per output channel / per input-head block | {a['weight_error']:.2e} / "
                      f"{b['weight_error']:.2e} | {a['output_error']:.2e} / {b['output_error']:.2e} | | | |")


if __name__ == "__main__":
    main()
