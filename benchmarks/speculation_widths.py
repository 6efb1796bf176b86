"""Speculative decoding at real widths: the measured cost of a verify step of k + 1 tokens and of the draft steps,
combined with the acceptance measured on the trained embedded models (issue #26's real-width target: greedy
tokens/s >= 1.6x the same artifact without speculation).

Model of one verify step with k drafts (toolchain/runtime/speculative.py, greedy): the main model runs once over
k + 1 tokens (the last accepted token and the k drafts) and the drafter proposes k tokens; the step yields
E_k = 1 + (drafts accepted per step) tokens, so

    speed-up(k) = E_k * t_main(1) / (t_main(k + 1) + k * t_draft(1))

(prompt lookup: t_draft = 0; its Python lookup is not counted). t(T) is the time of one forward of T tokens after
a cache of ``--context`` positions at the real depth, put together from graphs of a few layers of the same widths,
since a real-depth checkpoint does not fit this machine (a layer's time is a few ms, about this machine's noise, so
the graphs of a model differ by several layers):

* DeepSeek-V3 (61 layers: 3 dense, 58 MoE of 256 experts, 8 routed + 1 shared per token): graphs of 1 and 3 dense
  layers and of a dense and a MoE layer; t = t(3 dense) + 58 (t(dense + MoE) - t(1 dense)). FP8 hub layout,
  exported with the lowering a build of it picks (dispatch: its bf16 storage), compressed streamed (the MoE graph
  is the `dstc build` artifact of its checkpoint). Random weights route T tokens to about as many distinct
  experts as uniform routing (256 (1 - (248/256)^T): 8, 16, 23, 31, 38 at T = 1..5), where trained routers, whose
  neighbouring tokens share experts more often, touch fewer: the MoE verify cost here is the pessimistic one. The
  MTP drafter (one MoE decoder layer, eh_proj 14336 x 7168 and the shared lm_head) is t_moe(1) + t_rest(1) +
  eh_proj's share of a dense layer by its weights (103 M of 583 M parameters), t_rest the 1-dense graph less a layer.
* R1-Distill-Qwen-7B (28 layers) with R1-Distill-Qwen-1.5B (28 layers) as the draft model: graphs of 1 and 8
  layers each; t = t(1) + 27 (t(8) - t(1)) / 7.

Graphs: `dstc models shape-faithful`-style random checkpoints, exported (latent MLA cache for V3) and compressed
int4-grouped (g128, asymmetric, INT8 embeddings and lm_head) per backend, run stateless (dstc's GraphRunner,
--threads, OpenVINO at its deployment numerics) in a child process per backend and model family that holds the
benchmark lock; each T is the median of --rounds rounds of --repeats forwards, rounds alternating the graphs.

Acceptance: the embedded trained models built INT4 for ONNX Runtime (deepseek-v3-tiny, deepseek-v32-tiny and
deepseek-v4-tiny with their MTP layers, export.mtp; r1-distill-qwen-tiny drafted by r1-distill-llama-tiny, the
embedded pair of one tokenizer), greedy over benchmarks/speculative.py's few-shot held-out arithmetic prompts, for
each k: E_k = 1 + accepted / verify steps (``--acceptance-only``: these alone, of the pairs ``--methods`` names).

    .venv/bin/python benchmarks/speculation_widths.py --workdir /tmp/spec-widths --json speculation_widths.json
    .venv/bin/python benchmarks/speculation_widths.py --workdir /tmp/spec-widths --acceptance-only \
        --methods "mtp,mtp (v32-tiny)" --json acceptance.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.modules["openvino_telemetry"] = None  # it forks per event; see tests/conftest.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script: the harness is imported from the repo
from benchmarks import harness  # noqa: E402

BACKENDS = ("onnxruntime", "openvino")
# graph name -> (reference, layers, first_k_dense_replace override or None, fp8); `dstc models shape-faithful`
# keeps a MoE layer at two layers or more: "v3-dm" is its cut (1 dense + 1 MoE), "v3-dense3" overrides it. The
# graphs of a model differ by several layers: one layer's time is a few ms, about the noise of this machine
GRAPHS = {"v3-dense1": ("deepseek-v3", 1, None, True), "v3-dense3": ("deepseek-v3", 3, 3, True),
          "v3-dm": ("deepseek-v3", 2, None, True),
          "qwen7b-1": ("deepseek-r1-distill-qwen-7b", 1, None, False),
          "qwen7b-8": ("deepseek-r1-distill-qwen-7b", 8, None, False),
          "qwen1.5b-1": ("deepseek-r1-distill-qwen-1.5b", 1, None, False),
          "qwen1.5b-8": ("deepseek-r1-distill-qwen-1.5b", 8, None, False)}
V3_MOE, QWEN_LAYERS = 58, 28
EH_PROJ_SHARE = 2 * 7168 * 7168 / 583e6  # eh_proj's weights over a V3 dense layer's (attention + MLP)
# embedded pairs for acceptance: method -> (main model, recipe export extras, draft model or None)
ACCEPTANCE = {"mtp": ("deepseek-v3-tiny", {"mtp": True}, None),
              "mtp (v32-tiny)": ("deepseek-v32-tiny", {"mtp": True}, None),
              "mtp (v4-tiny)": ("deepseek-v4-tiny", {"mtp": True}, None),
              "draft": ("r1-distill-qwen-tiny", {}, "r1-distill-llama-tiny"),
              "prompt-lookup (v3-tiny)": ("deepseek-v3-tiny", {}, None),
              "prompt-lookup (qwen-tiny)": ("r1-distill-qwen-tiny", {}, None)}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- graphs at real widths ----------------------------------------------------------------------------------------

def checkpoint(work: Path, name: str) -> Path:
    from toolchain.models.registry import reference_config
    from toolchain.models.shape_faithful import reference_to_config, write_random_checkpoint

    reference, layers, first_dense, fp8 = GRAPHS[name]
    out = work / f"{name}-ckpt"
    if not (out / "config.json").is_file():
        raw = reference_config(reference)
        scale_fmt = (raw.get("quantization_config") or {}).get("scale_fmt", "float")
        log(f"shape-faithful {reference}: {layers} layers")
        if first_dense is None:
            config = reference_to_config(raw, layers)
        else:  # not cut by reference_to_config, which would keep a MoE layer
            config = reference_to_config({**raw, "num_hidden_layers": layers, "first_k_dense_replace": first_dense})
        write_random_checkpoint(config, out, 0, fp8, scale_fmt)
    return out


def build_graphs(work: Path, names: list[str], backends: list[str]) -> dict[tuple[str, str], Path]:
    """(graph name, backend) -> the INT4 graph file that backend runs; each built once and kept in ``work``."""
    from toolchain.recipe import CompressSection
    from toolchain.stages.alone import compress, export

    files = {}
    for name in names:
        exported = work / f"{name}-export"
        # V3's graphs hold more than 2 GiB of float weights: their compression streams them from the checkpoint, so
        # the export writes none (dstc build's streamed path; the bf16 weights of one MoE layer are 22 GB)
        large = GRAPHS[name][3]
        if not (exported / "export.json").is_file():
            ckpt = checkpoint(work, name)
            log(f"export {name}")
            export(str(ckpt), exported, parity=(), defer_weights=large)
        for backend in backends:
            out = work / f"{name}-int4-{backend}"
            if not (out / "compression.json").is_file():
                log(f"compress {name} INT4 for {backend}")
                compress(exported, out, CompressSection(scheme="int4-grouped", backup="int8",
                                                        streaming="always" if large else "auto"), target=backend)
            xml = out / "openvino_model.xml"
            files[(name, backend)] = xml if xml.is_file() else out / "model.onnx"
            gc.collect()
    return files


def forward_ms(runner, specs: dict, vocab: int, context: int, tokens: int, repeats: int, rng) -> float:
    """Median ms of a forward of ``tokens`` tokens after a cache of ``context`` random positions (batch 1)."""
    past = {name: rng.standard_normal((1, h, context, d)).astype(np.float32) for name, (h, d) in specs.items()}
    feeds = {"input_ids": rng.integers(0, vocab, (1, tokens)).astype(np.int64),
             "attention_mask": np.ones((1, context + tokens), np.int64),
             "position_ids": np.arange(context, context + tokens, dtype=np.int64)[None], **past}
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner(feeds)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure_child(args) -> None:
    """One backend: every graph loaded, each T in turn, rounds alternating the graphs."""
    from toolchain.interface.graph import graph_cache_spec
    from toolchain.runtime.engines import GraphRunner

    graphs = json.loads(args.graph_files)  # name -> [graph file, vocabulary size]
    numerics = "exact" if args.measure == "onnxruntime" else "deployment"
    runners, specs, vocab = {}, {}, {}
    for name, (graph, size) in graphs.items():
        runners[name] = GraphRunner(Path(graph), args.measure, numerics=numerics, threads=args.threads)
        specs[name] = graph_cache_spec(Path(graph))
        vocab[name] = size
    rng = np.random.default_rng(0)
    for name in runners:  # the weights' pages read in, the kernels' first runs
        for tokens in range(1, args.max_tokens + 1):
            forward_ms(runners[name], specs[name], vocab[name], args.context, tokens, 1, rng)
    rows = []
    for tokens in range(1, args.max_tokens + 1):
        rounds: dict[str, list[float]] = {name: [] for name in runners}
        for _, name in harness.alternation(list(runners), args.rounds):
            rounds[name].append(forward_ms(runners[name], specs[name], vocab[name], args.context, tokens,
                                           args.repeats, rng))
        for name, times in rounds.items():
            rows.append({"backend": args.measure, "graph": name, "tokens": tokens, "ms": statistics.median(times),
                         "rounds_ms": times})
        log(f"{args.measure} T={tokens}: " + ", ".join(f"{n} {statistics.median(t):.1f} ms"
                                                       for n, t in rounds.items()))
    print(json.dumps(rows))


def measure(files: dict, args) -> list[dict]:
    """Each backend and model family (the graphs one real-depth figure is put together from) in a child of its own:
    the V3 graphs alone take ~13 GB."""
    rows = []
    for backend in args.backends:
        for family in ("v3", "qwen"):
            graphs = {name: [str(files[(name, backend)]),
                             json.loads((args.workdir / f"{name}-ckpt" / "config.json").read_text())["vocab_size"]]
                      for name in args.graphs if name.startswith(family)}
            if not graphs:
                continue
            command = [sys.executable, __file__, "--measure", backend, "--graph-files", json.dumps(graphs),
                       "--context", str(args.context), "--max-tokens", str(args.max_tokens),
                       "--rounds", str(args.rounds), "--repeats", str(args.repeats), "--threads", str(args.threads)]
            log(f"measuring {family} on {backend}")
            with harness.one_at_a_time():
                out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows += json.loads(out.strip().splitlines()[-1])
    return rows


def real_depth(rows: list[dict], backend: str) -> dict[str, dict[int, float]]:
    """Per real model, {T: ms of a forward of T tokens at its real depth}, from the few-layer graphs' times."""
    t = {(r["graph"], r["tokens"]): r["ms"] for r in rows if r["backend"] == backend}
    tokens = sorted({r["tokens"] for r in rows if r["backend"] == backend})
    out: dict[str, dict[int, float]] = {}
    if all((g, 1) in t for g in ("v3-dense1", "v3-dense3", "v3-dm")):
        v3, mtp = {}, {}
        for n in tokens:
            dense = (t["v3-dense3", n] - t["v3-dense1", n]) / 2
            rest = t["v3-dense1", n] - dense
            moe = t["v3-dm", n] - t["v3-dense1", n]
            v3[n] = t["v3-dense3", n] + V3_MOE * moe  # the real model's 3 dense layers are the graph's
            mtp[n] = rest + moe + EH_PROJ_SHARE * dense
        out["deepseek-v3"], out["deepseek-v3 mtp"] = v3, mtp
    for model, prefix in (("r1-distill-qwen-7b", "qwen7b"), ("r1-distill-qwen-1.5b", "qwen1.5b")):
        if (f"{prefix}-1", 1) in t:
            layer = {n: (t[f"{prefix}-8", n] - t[f"{prefix}-1", n]) / 7 for n in tokens}
            out[model] = {n: t[f"{prefix}-1", n] + (QWEN_LAYERS - 1) * layer[n] for n in tokens}
    return out


# -- acceptance on the trained embedded models --------------------------------------------------------------------

def acceptance(work: Path, ks: list[int], args) -> dict[str, dict[int, dict]]:
    """method -> {k: {"tokens_per_step": E_k, "acceptance_per_position": [...]}} on the embedded INT4 models."""
    import yaml

    from benchmarks.speculative import prompts
    from toolchain.build import build
    from toolchain.interface.graph import HIDDEN_STATES
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.mtp_drafter import open_mtp_drafter
    from toolchain.runtime.speculative import Acceptance, DraftModel, PromptLookup, speculative_steps

    def artifact(model: str, export: dict):
        out = work / f"acceptance-{model}{'-mtp' if export else ''}"
        if not (out / "manifest.json").is_file():
            recipe = out.with_suffix(".yaml")
            recipe.write_text(yaml.safe_dump({
                "name": out.name, "model": model, "export": {"parity": [], **export},
                "compress": {"scheme": "int4-grouped", "group_size": 128, "sym": False, "backup": "int8"},
                "compile": {"backend": "onnxruntime", "verify": False}}))
            log(f"building {out.name}")
            build(recipe, out)
        return open_artifact(out)

    result: dict[str, dict[int, dict]] = {}
    for method in args.methods:
        model, export, draft = ACCEPTANCE[method]
        art = artifact(model, export)
        mtp = method.startswith("mtp")
        decoder = open_decoder(art, threads=args.threads, extra_outputs=(HIDDEN_STATES,) if mtp else ())
        prompt_ids = prompts(art.tokenizer(), args.prompts, args.shots)
        result[method] = {}
        for k in ks:
            if mtp:
                drafter = open_mtp_drafter(art, threads=args.threads)
            elif draft:
                drafter = DraftModel(open_decoder(artifact(draft, {}), threads=args.threads))
            else:
                drafter = PromptLookup()
            counted = Acceptance()
            for prompt in prompt_ids:
                for _ in speculative_steps(decoder, drafter, prompt, max_new_tokens=args.tokens, stop_ids=set(),
                                           draft_tokens=k, acceptance=counted):
                    pass
            summary = counted.summary()
            result[method][k] = {
                "tokens_per_step": 1 + sum(summary["accepted_per_position"]) / summary["verify_steps"],
                "acceptance_per_position": summary["acceptance_per_position"]}
            log(f"acceptance {method} k={k}: {result[method][k]['tokens_per_step']:.3f} tokens per verify step")
    return result


# -- the table ------------------------------------------------------------------------------------------------------

CONTENDERS = {"deepseek-v3": (("mtp", "deepseek-v3 mtp"), ("prompt-lookup (v3-tiny)", None)),
              "r1-distill-qwen-7b": (("draft", "r1-distill-qwen-1.5b"), ("prompt-lookup (qwen-tiny)", None))}


def speedups(depth: dict[str, dict[int, float]], accepted: dict[str, dict[int, dict]], ks: list[int]) -> list[dict]:
    rows = []
    for model, contenders in CONTENDERS.items():
        if model not in depth:
            continue
        plain = depth[model][1]
        for method, drafter in contenders:
            if drafter is not None and drafter not in depth:
                continue
            for k in ks:
                draft_ms = k * depth[drafter][1] if drafter else 0.0
                step_ms = depth[model][k + 1] + draft_ms
                tokens = accepted[method][k]["tokens_per_step"]
                rows.append({"model": model, "method": method.split(" (")[0], "k": k, "plain_ms": plain,
                             "verify_ms": depth[model][k + 1], "draft_ms": draft_ms, "tokens_per_step": tokens,
                             "ms_per_token": step_ms / tokens, "speedup": tokens * plain / step_ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="checkpoints, graphs and artifacts (reused; required)")
    parser.add_argument("--json", type=Path, default=Path("speculation_widths.json"))
    parser.add_argument("--graphs", default=",".join(GRAPHS), type=lambda s: s.split(","))
    parser.add_argument("--backends", default=",".join(BACKENDS), type=lambda s: s.split(","))
    parser.add_argument("--ks", default="1,2,3,4", type=lambda s: [int(k) for k in s.split(",")])
    parser.add_argument("--context", type=int, default=1024, help="cache positions before the step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="forwards per round (their median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--shots", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt for acceptance")
    parser.add_argument("--build-only", action="store_true", help="build the graphs, measure nothing")
    parser.add_argument("--methods", default=",".join(ACCEPTANCE), type=lambda s: s.split(","),
                        help="the embedded pairs whose acceptance is measured")
    parser.add_argument("--acceptance-only", action="store_true",
                        help="measure the embedded pairs' acceptance alone (no graphs at real widths)")
    parser.add_argument("--measure", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--graph-files", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child of measure
        measure_child(args)
        return
    if args.workdir is None:
        parser.error("--workdir is required")
    args.max_tokens = max(args.ks) + 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.acceptance_only:
        accepted = acceptance(args.workdir, args.ks, args)
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "acceptance": accepted}, indent=1) + "\n")
        print(harness.markdown_table(["method", *(f"k = {k}" for k in args.ks)],
                                     [[m, *(accepted[m][k]["tokens_per_step"] for k in args.ks)] for m in accepted]))
        return
    files = build_graphs(args.workdir, args.graphs, args.backends)
    if args.build_only:
        return
    accepted = acceptance(args.workdir, args.ks, args)
    rows = measure(files, args)
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "forwards": rows, "acceptance": accepted,
              "backends": {}}
    for backend in args.backends:
        depth = real_depth(rows, backend)
        table = speedups(depth, accepted, args.ks)
        result["backends"][backend] = {"real_depth_ms": depth, "speedups": table}
        print(f"\n{backend}, context {args.context}, {args.threads} threads")
        print(harness.markdown_table(
            ["model", "method", "k", "plain ms/token", "verify k+1 ms", "drafts ms", "tokens/step", "ms/token",
             "speed-up"],
            [[r["model"], r["method"], r["k"], r["plain_ms"], r["verify_ms"], r["draft_ms"], r["tokens_per_step"],
              r["ms_per_token"], r["speedup"]] for r in table]))
    args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
