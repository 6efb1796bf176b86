"""Long-context cases at real widths: decode ms/token of DeepSeek-V3 and V3.2 (issue #37) by context, on ONNX
Runtime and OpenVINO, with each measuring process tree's peak RSS.

Shape-faithful checkpoints (`dstc models shape-faithful`: real widths and vocabulary, V3 and V3.2 in their hubs'
FP8 layout; --layers decoder layers, --experts routed experts) are exported with the default latent MLA cache and
compressed int4-grouped (g128, asym) for each backend (above 2 GiB of float weights the compress stage streams
and writes ONNX for both). A case is one function, ``CASES[name](files, args, log) -> rows``, run per backend in
a child process (``--measure CASE BACKEND``) holding the benchmark lock, its process tree's peak RSS sampled
(harness.run_measured); ``table(case, rows)`` prints it. Another long-context case (prefill time at 4k / 16k, V4)
is another entry in MODELS and CASES.

decode: both graphs loaded (dstc's GraphRunner, stateless, --threads, exact numerics) and, per context C, each
decodes --steps tokens after a cache of C - 1 positions of random values (benchmarks/mla_cache.py's loop: an
unmeasured round, a warm-up at each context, --rounds rounds alternating the models); ms/token is the median over
rounds. The runner appends each step's new cache entries itself where the graph's present outputs allow it
(toolchain/runtime/appending_cache.py: V3.2's latent graph; V3's dense attention reads the grown cache), as
dstc's StatelessDecoder does; --before WORKDIR adds the V3.2 graphs another checkout built to the same rounds.
V3.2's indexer picks its top 2048 of whatever the random keys score: the time of a step does not depend on which.

    PYTHONPATH=. .venv/bin/python benchmarks/long_context.py --workdir /tmp/long-context --json long_context.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

sys.modules["openvino_telemetry"] = None  # it forks per event; see tests/conftest.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script: the harness is imported from the repo
from benchmarks import harness  # noqa: E402
from benchmarks.mla_cache import measure_graphs  # noqa: E402

MODELS = {"v3": ("deepseek-v3", True), "v3.2": ("deepseek-v3.2", False)}  # reference, --fp8 (V3.2: always FP8)
BEFORE = "v3.2-before"  # --before: the V3.2 graphs another checkout built, measured in the same rounds
BACKENDS = ("onnxruntime", "openvino")


def build(work: Path, args, log) -> dict[tuple[str, str], Path]:
    """(model, backend) -> the INT4 graph file that backend runs."""
    from toolchain.models.shape_faithful import make_shape_faithful
    from toolchain.recipe import CompressSection
    from toolchain.stages.alone import compress, export

    files = {}
    for model in args.models:
        reference, fp8 = MODELS[model]
        ckpt = work / f"{model}-ckpt"
        if not (ckpt / "config.json").is_file():
            log(f"shape-faithful {reference}: {args.layers} layers, {args.experts} experts")
            make_shape_faithful(reference, ckpt, num_layers=args.layers, num_experts=args.experts, fp8=fp8)
        exported = work / f"{model}-export"
        if not (exported / "export.json").is_file():
            log(f"export {model}")
            export(str(ckpt), exported, parity=())
        for backend in args.backends:
            out = work / f"{model}-int4-{backend}"
            if not (out / "compression.json").is_file():
                log(f"compress {model} INT4 for {backend}")
                compress(exported, out, CompressSection(scheme="int4-grouped"), target=backend)
            xml = out / "openvino_model.xml"
            files[(model, backend)] = xml if xml.is_file() else out / "model.onnx"
            gc.collect()
    return files


# -- cases: each measures one backend in a child process and prints its rows as the last line ----------------------

def decode_child(args) -> list[dict]:
    """decode: every model loaded, contexts in turn, rounds alternating the models."""
    args.appending = True  # as dstc's StatelessDecoder: the runner appends the new entries where the graph allows
    return measure_graphs(json.loads(args.graphs), args.measure[1], args)


def decode_table(rows: list[dict], args) -> str:
    """Per backend and context: each model's ms/token, V3.2 / V3 and each model's ms at C over its own at the first
    context; with --before, the earlier V3.2 graph's ms/token and its ratio to its own first context beside."""
    get = {(r["backend"], r["model"], r["context"]): r["decode_ms_per_token"] for r in rows}
    peak = {r["backend"]: r["peak_rss_gib"] for r in rows}
    first = args.contexts[0]
    before = BEFORE in {r["model"] for r in rows}
    lines = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for context in args.contexts:
            v3, v32 = get.get((backend, "v3", context)), get.get((backend, "v3.2", context))
            if v3 is None or v32 is None:
                continue
            earlier = get.get((backend, BEFORE, context))
            lines.append([backend, context, v3, *([earlier, earlier / get[(backend, BEFORE, first)]] if before else []),
                          v32, v32 / v3, v3 / get[(backend, "v3", first)], v32 / get[(backend, "v3.2", first)],
                          peak[backend]])
    return harness.markdown_table(["backend", "context", "V3 ms/tok",
                                   *(["V3.2 before ms/tok", f"before / own {first}"] if before else []),
                                   "V3.2 ms/tok", "V3.2 / V3", f"V3 / own {first}", f"V3.2 / own {first}",
                                   "peak RSS GiB"], lines)


CASES = {"decode": (decode_child, decode_table)}


def measure(case: str, files: dict, args, log) -> list[dict]:
    """The case on each backend, a child process each, with its tree's peak RSS; rows written to --json as they
    come."""
    done = json.loads(args.json.read_text()) if args.json.is_file() else {}
    rows = [r for r in done.get(case, []) if r["backend"] in args.backends and args.resume]
    for backend in args.backends:
        if any(r["backend"] == backend for r in rows):
            continue
        graphs = {model: str(files[(model, backend)]) for model in args.models}
        command = [sys.executable, __file__, "--measure", case, backend, "--graphs", json.dumps(graphs),
                   "--contexts", ",".join(map(str, args.contexts)), "--steps", str(args.steps),
                   "--rounds", str(args.rounds), "--threads", str(args.threads), "--vocab", str(args.vocab)]
        log(f"{case} on {backend}")
        with harness.one_at_a_time():
            run = harness.run_measured(command)
        if run.returncode != 0:
            raise SystemExit(f"{case} on {backend} failed: {run.output[-3000:]}")
        measured = json.loads(run.output.strip().splitlines()[-1])
        rows += [{**r, "backend": backend, "peak_rss_gib": round(run.peak_bytes / harness.GIB, 2)} for r in measured]
        done[case] = rows
        args.json.write_text(json.dumps({**done, "settings": {
            "layers": args.layers, "experts": args.experts, "threads": args.threads, "steps": args.steps,
            "rounds": args.rounds, "contexts": args.contexts, "graphs": {f"{m} {b}": str(p) for (m, b), p
                                                                           in files.items()}}}, indent=1) + "\n")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="decode", type=lambda s: s.split(","), help=f"of {', '.join(CASES)}")
    parser.add_argument("--models", default=",".join(MODELS), type=lambda s: s.split(","))
    parser.add_argument("--backends", default=",".join(BACKENDS), type=lambda s: s.split(","))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--contexts", default="1024,8192,32768,65536", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--steps", type=int, default=4, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoints and graphs here (reused)")
    parser.add_argument("--json", type=Path, default=Path("long_context.json"))
    parser.add_argument("--resume", action="store_true", help="keep the backends already in --json")
    parser.add_argument("--before", type=Path, default=None,
                        help="another --workdir whose V3.2 graphs (an earlier export) run in the same rounds")
    parser.add_argument("--build-only", action="store_true", help="make the graphs and stop")
    parser.add_argument("--measure", nargs=2, metavar=("CASE", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--graphs", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child of measure
        print(json.dumps(CASES[args.measure[0]][0](args)))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-long-context-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    files = build(work, args, log)
    if args.build_only:
        return
    if args.before:
        for backend in args.backends:
            out = args.before / f"v3.2-int4-{backend}"
            files[(BEFORE, backend)] = out / "openvino_model.xml" if backend == "openvino" else out / "model.onnx"
        args.models = [*args.models, BEFORE]
    args.vocab = json.loads((work / f"{args.models[0]}-ckpt" / "config.json").read_text())["vocab_size"]
    for case in args.cases:
        print(CASES[case][1](measure(case, files, args, log), args))


if __name__ == "__main__":
    main()
