"""MLA KV-cache layouts at decode: the latent cache (kv_b_proj absorbed) against transformers' per-head form, on
ONNX Runtime and OpenVINO, by context length.

A shape-faithful DeepSeek-V2-Lite checkpoint (`dstc models shape-faithful deepseek-v2-lite`: the real widths,
hidden 2048, 16 heads, kv_lora_rank 512, qk_rope 64, nope 128, v 128, the real 102400 vocabulary; 2 layers, one
dense and one MoE, and 8 routed experts by default, to keep it small) is exported in both layouts
(``dstc export --mla-cache latent | per-head``), fp32, and with --int4 also compressed (int4-grouped, g128) for
each backend (above 1 GiB the compress stage streams: no calibration, ONNX for both backends). Per backend and precision, in a child process holding /work/bench.lock (the machine is shared:
one benchmark at a time), both layouts are loaded (dstc's GraphRunner, 2 threads, exact numerics, stateless with
the cache fed back as dstc's StatelessDecoder does) and, per context C, each decodes --steps tokens after a cache
of C - 1 positions (random values: the time of a step does not depend on them), after an unmeasured round and
two warm-up steps at each context, round after round alternating the layouts' order; decode ms/token is the median over rounds of each round's mean step. The table has the
cache's bytes per token and layer (from the graph's past_key_values inputs), each layout's ms/token, the
latent/per-head ratio of the whole step, and of its context-dependent part (ms/token at C minus at the first
context: what the attention and its cache cost, with the vocabulary projection, which dominates a 2-layer
model, taken out). Results go to the --json file.

    .venv/bin/python benchmarks/mla_cache.py --workdir /tmp/mla-bench --json mla_cache.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.modules["openvino_telemetry"] = None  # it forks per event; see tests/conftest.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script: the harness is imported from the repo
from benchmarks import harness  # noqa: E402

LAYOUTS = ("per-head", "latent")


def build(work: Path, args, log) -> dict[tuple[str, str, str], Path]:
    """(backend, precision, layout) -> the graph file that backend runs."""
    from toolchain.models.shape_faithful import make_shape_faithful
    from toolchain.stages.alone import export

    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        log(f"shape-faithful {args.reference}: {args.layers} layers, {args.experts} experts")
        make_shape_faithful(args.reference, ckpt, num_layers=args.layers, num_experts=args.experts)
    files = {}
    for layout in LAYOUTS:
        out = work / f"export-{layout}"
        if not (out / "export.json").is_file():
            log(f"export {layout}")
            export(str(ckpt), out, parity=(), mla_cache=layout)
        for backend in ("onnxruntime", "openvino"):
            files[(backend, "fp32", layout)] = out / "model.onnx"
    if args.int4:
        from toolchain.recipe import CompressSection
        from toolchain.stages.alone import compress

        for layout in LAYOUTS:
            for backend in ("onnxruntime", "openvino"):
                out = work / f"int4-{layout}-{backend}"
                if not (out / "compression.json").is_file():
                    log(f"compress {layout} INT4 for {backend}")
                    compress(work / f"export-{layout}", out, CompressSection(scheme="int4-grouped"), target=backend)
                xml = out / "openvino_model.xml"
                files[(backend, "int4", layout)] = xml if xml.is_file() else out / "model.onnx"
                gc.collect()
    return files


def cache_bytes_per_token_layer(path: Path) -> int:
    from toolchain.interface.graph import graph_cache_spec

    specs = graph_cache_spec(path)
    return sum(h * d * 4 for name, (h, d) in specs.items() if name.startswith("past_key_values.0."))


def decode_ms(runner, specs: dict, vocab: int, context: int, steps: int, rng, lengths: dict | None = None,
              dtype: type[np.floating] = np.float32) -> float:
    """Mean ms per decode step after a cache of ``context - 1`` positions (batch 1), the cache fed back.
    ``lengths``: the graph's cache length rules (toolchain/interface/graph.py cache_lengths; DeepSeek-V4's compressed
    cache), each tensor then as long as its rule says; ``dtype``: the graph's cache element type (export.cache_dtype),
    so that no step times a conversion of the cache made here."""
    from toolchain.interface.graph import cache_length
    from toolchain.runtime.appending_cache import AppendingCache

    held = {name: cache_length(*(lengths or {})[name], context - 1) if name in (lengths or {}) else context - 1
            for name in specs}
    past = {name: rng.standard_normal((1, h, held[name], d)).astype(dtype) for name, (h, d) in specs.items()}
    appended = AppendingCache()  # a runner that appends (runner.appends) outputs the new entries only
    if getattr(runner, "appends", False):
        appended.hold(past, steps)  # room for the measured steps: no growth among them (a copy per ROOM_STEP)
    token = np.array([[int(rng.integers(0, vocab))]], np.int64)
    total = 0.0
    for step in range(steps):
        length = context + step
        feeds = {"input_ids": token, "attention_mask": np.ones((1, length), np.int64),
                 "position_ids": np.array([[length - 1]], np.int64), **past}
        started = time.perf_counter()
        if getattr(runner, "appends", False):  # the cache's own step: its slots, the free ones masked, and the append
            feeds.update({name: appended.past(name, cache) for name, cache in past.items()},
                         attention_mask=appended.graph_mask(feeds["attention_mask"]))
            outputs = runner(feeds)
            appended.append({name: outputs["present." + name[len("past_key_values."):]] for name in specs})
        else:
            outputs = runner(feeds)
            past = {name: outputs["present." + name[len("past_key_values."):]] for name in specs}
        total += time.perf_counter() - started
        token = outputs["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
    return total * 1e3 / steps


def context_rounds(runners: dict, specs: dict, vocab: int, contexts: list[int], steps: int, rounds: int, rng,
                   report=lambda context, medians: None, lengths: dict | None = None,
                   dtypes: dict | None = None) -> dict[int, dict[str, list[float]]]:
    """{context: {contender: each round's ms/token}}: an unmeasured round first (the weights' pages read in, the
    kernels' first runs), then per context a warm-up (allocations of the new sizes) and ``rounds`` rounds
    alternating the contenders; ``report(context, {contender: median})`` after each context. ``lengths``:
    {contender: its cache length rules}, ``dtypes``: {contender: its cache element type} (decode_ms)."""
    rules, types = lengths or {}, dtypes or {}

    def run(name: str, context: int, count: int) -> float:
        return decode_ms(runners[name], specs[name], vocab, context, count, rng, rules.get(name),
                         types.get(name, np.float32))

    for name in runners:
        run(name, contexts[0], steps)
    out = {}
    for context in contexts:
        for name in runners:
            run(name, context, 2)
        out[context] = {name: [] for name in runners}
        for _, name in harness.alternation(list(runners), rounds):
            out[context][name].append(run(name, context, steps))
        report(context, {name: statistics.median(times) for name, times in out[context].items()})
    return out


def measure_graphs(graphs: dict[str, str], backend: str, args, numerics: str = "exact") -> list[dict]:
    """Each graph loaded on ``backend`` (its creation time kept), then context_rounds over ``args``' contexts, steps
    and rounds, progress on stderr: a row per (graph, context) with its median ms/token and every round's."""
    from toolchain.interface.graph import cache_dtype, cache_lengths, graph_cache_spec, graph_metadata
    from toolchain.runtime.engines import GraphRunner

    runners, specs, creation, lengths, dtypes = {}, {}, {}, {}, {}
    for name, graph in graphs.items():
        started = time.perf_counter()
        runners[name] = GraphRunner(Path(graph), backend, numerics=numerics, threads=args.threads,
                                    appending=getattr(args, "appending", False))
        creation[name] = time.perf_counter() - started
        specs[name] = graph_cache_spec(Path(graph))
        metadata = graph_metadata(Path(graph))
        lengths[name], dtypes[name] = cache_lengths(metadata), np.dtype(cache_dtype(metadata)).type

    def report(context: int, medians: dict[str, float]) -> None:
        print(f"{backend} context {context}: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in medians.items()),
              file=sys.stderr, flush=True)

    measured = context_rounds(runners, specs, args.vocab, args.contexts, args.steps, args.rounds,
                              np.random.default_rng(0), report, lengths, dtypes)
    return [{"model": name, "context": context, "decode_ms_per_token": statistics.median(rounds[name]),
             "rounds_ms": rounds[name], "creation_s": creation[name], "appends": runners[name].appends}
            for context, rounds in measured.items() for name in graphs]


def measure_child(args) -> None:
    """One (backend, precision) group: both layouts loaded, contexts in turn, rounds alternating the layouts."""
    from toolchain.interface.graph import graph_cache_spec
    from toolchain.runtime.engines import GraphRunner

    backend, precision = args.measure
    graphs = json.loads(args.graphs)
    runners, specs = {}, {}
    creation = {}
    for layout in LAYOUTS:
        started = time.perf_counter()
        runners[layout] = GraphRunner(Path(graphs[layout]), backend, numerics=args.numerics, threads=args.threads)
        creation[layout] = time.perf_counter() - started
        specs[layout] = graph_cache_spec(Path(graphs[layout]))
    def report(context: int, medians: dict[str, float]) -> None:
        print(f"{backend} {precision} context {context}: " + ", ".join(
            f"{layout} {ms:.1f} ms" for layout, ms in medians.items()), file=sys.stderr, flush=True)

    measured = context_rounds(runners, specs, args.vocab, args.contexts, args.steps, args.rounds,
                              np.random.default_rng(0), report)
    rows = [{"backend": backend, "precision": precision, "layout": layout, "context": context,
             "decode_ms_per_token": statistics.median(rounds[layout]), "rounds_ms": rounds[layout],
             "creation_s": creation[layout], "graph": graphs[layout],
             "kv_bytes_per_token_layer": cache_bytes_per_token_layer(Path(graphs[layout]))}
            for context, rounds in measured.items() for layout in LAYOUTS]
    print(json.dumps(rows))


def measure(files: dict, args, log, done: list[dict]) -> list[dict]:
    rows = list(done)
    for precision in (("fp32", "int4") if args.int4 else ("fp32",)):
        for backend in ("onnxruntime", "openvino"):
            if any(r["backend"] == backend and r["precision"] == precision for r in done):
                continue
            graphs = {layout: str(files[(backend, precision, layout)]) for layout in LAYOUTS}
            command = [sys.executable, __file__, "--measure", backend, precision, "--graphs", json.dumps(graphs),
                       "--contexts", ",".join(map(str, args.contexts)), "--steps", str(args.steps),
                       "--rounds", str(args.rounds), "--threads", str(args.threads), "--numerics", args.numerics,
                       "--vocab", str(args.vocab)]
            log(f"measuring {backend} {precision}")
            with harness.one_at_a_time():
                out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows += json.loads(out.strip().splitlines()[-1])
            write(args, rows)
    return rows


def write(args, rows: list[dict]) -> None:
    args.json.write_text(json.dumps({"reference": args.reference, "layers": args.layers, "experts": args.experts,
                                     "threads": args.threads, "steps": args.steps, "rounds": args.rounds,
                                     "contexts": args.contexts, "numerics": args.numerics, "rows": rows},
                                    indent=1) + "\n")


def table(rows: list[dict], contexts: list[int]) -> str:
    lines = []
    get = {(r["backend"], r["precision"], r["layout"], r["context"]): r for r in rows}
    for backend, precision in dict.fromkeys((r["backend"], r["precision"]) for r in rows):
        for context in contexts:
            ph, lat = (get.get((backend, precision, layout, context)) for layout in LAYOUTS)
            if ph is None or lat is None:
                continue
            base_ph, base_lat = (get[(backend, precision, layout, contexts[0])] for layout in LAYOUTS)
            part_ph = ph["decode_ms_per_token"] - base_ph["decode_ms_per_token"]
            part_lat = lat["decode_ms_per_token"] - base_lat["decode_ms_per_token"]
            part = part_lat / part_ph if context != contexts[0] and part_ph > 0 else None
            lines.append([backend, precision, context,
                          f"{ph['kv_bytes_per_token_layer']} / {lat['kv_bytes_per_token_layer']}",
                          ph["decode_ms_per_token"], lat["decode_ms_per_token"],
                          lat["decode_ms_per_token"] / ph["decode_ms_per_token"], part])
    return harness.markdown_table(["backend", "prec", "context", "KV B/tok/layer", "per-head ms/tok",
                                   "latent ms/tok", "latent/per-head", "ctx part ratio"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default="deepseek-v2-lite", help="see `dstc models list`")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--contexts", default="128,1024,4096", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--numerics", choices=("exact", "deployment"), default="exact",
                        help="OpenVINO: f32 compute (exact) or the CPU plugin's defaults (bf16 where it can)")
    parser.add_argument("--int4", action="store_true", help="also INT4 (int4-grouped) of each layout per backend")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and graphs here (reused)")
    parser.add_argument("--json", type=Path, default=Path("mla_cache.json"))
    parser.add_argument("--resume", action="store_true", help="keep the groups already in --json")
    parser.add_argument("--measure", nargs=2, metavar=("BACKEND", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--graphs", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child of measure
        measure_child(args)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-mla-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    files = build(work, args, log)
    args.vocab = json.loads((work / "ckpt" / "config.json").read_text())["vocab_size"]
    done = json.loads(args.json.read_text())["rows"] if args.resume and args.json.is_file() else []
    print(table(measure(files, args, log, done), args.contexts))


if __name__ == "__main__":
    main()
