"""Decode ms/token at long context: DeepSeek-V4-Flash's widths against DeepSeek-V3's, INT4, on ONNX Runtime and
OpenVINO (issue #24's decode table).

Two shape-faithful checkpoints as shipped (`dstc models shape-faithful`: real widths and vocabulary, FP4 / FP8
weights; --layers decoder layers and --experts routed experts each, so that both fit beside each other; V4's cut
keeps a sliding, a CSA and an HCA layer and a hash-MoE one) are exported (V3 with its default latent MLA cache, V4
twice: its per-token state and its compressed cache, export.v4_cache) and
compressed int4-grouped (g128, asym) for each backend; above 2 GiB of float weights the compress stage streams
and writes ONNX for both. Per backend, in a child process holding the benchmark lock, both graphs are loaded
(dstc's GraphRunner, stateless, --threads, exact numerics) and, per context C, each decodes --steps tokens after a
cache of C - 1 positions of random values (the time of a step does not depend on them: V4's indexer keeps its
top-k of whatever scores), after an unmeasured round and a warm-up at each context, rounds alternating the two
models; ms/token is the median over rounds (benchmarks/mla_cache.py's loop; the compressed cache's tensors as long as
their length rules say at C - 1 positions). The table also has each graph's cache bytes at C over all its layers
(from its past_key_values inputs and their length rules).

--float16-caches measures V3's latent graph and V4's compressed one with their caches stored in float32 and in
float16 (export.cache_dtype: the past read through a Cast to float32, the new positions cast once) in the same
rounds, and prints a table of float16's ms/token over float32's (issue #37: the cache dtype's default); V4's
per-token graph is left out (at 64k its process grew past 16 GiB on a shared machine and was killed).

    PYTHONPATH=. .venv/bin/python benchmarks/v4_decode.py --workdir /tmp/v4-decode --json v4_decode.json
    PYTHONPATH=. .venv/bin/python benchmarks/v4_decode.py --attention-widths --layers 3 --workdir /tmp/v4-decode
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.modules["openvino_telemetry"] = None  # it forks per event; see tests/conftest.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script: the harness is imported from the repo
from benchmarks import harness  # noqa: E402
from benchmarks.mla_cache import measure_graphs  # noqa: E402

# model -> (reference, --fp8, checkpoint, export.v4_cache); V4's two cache layouts are one checkpoint's two exports
MODELS = {"v4-flash": ("deepseek-v4-flash", False, "v4-flash", None),
          "v4-flash-compressed": ("deepseek-v4-flash", False, "v4-flash", "compressed"),
          "v3": ("deepseek-v3", True, "v3", None)}
F16 = "-f16"  # --float16-caches: these models again with export.cache_dtype float16
FLOAT16_MODELS = ("v4-flash-compressed", "v3")


def models(args) -> dict[str, tuple]:
    """The models measured: MODELS, or with --float16-caches FLOAT16_MODELS and their float16-cache exports."""
    if not args.float16_caches:
        return MODELS
    return {name: MODELS[name] for name in FLOAT16_MODELS} | {name + F16: MODELS[name] for name in FLOAT16_MODELS}
BACKENDS = ("onnxruntime", "openvino")


def build(work: Path, args, log) -> dict[tuple[str, str], Path]:
    """(model, backend) -> the INT4 graph file that backend runs."""
    from toolchain.models.shape_faithful import make_shape_faithful
    from toolchain.recipe import CompressSection
    from toolchain.stages.alone import compress, export

    files = {}
    for model, (reference, fp8, checkpoint, v4_cache) in models(args).items():
        ckpt = work / f"{checkpoint}-ckpt"
        if not (ckpt / "config.json").is_file():
            log(f"shape-faithful {reference}: {args.layers} layers, {args.experts} experts")
            make_shape_faithful(reference, ckpt, num_layers=args.layers, num_experts=args.experts, fp8=fp8)
        exported = work / f"{model}-export"
        if not (exported / "export.json").is_file():
            log(f"export {model}")
            export(str(ckpt), exported, parity=(), v4_cache=v4_cache,
                   cache_dtype="float16" if model.endswith(F16) else "float32")
        for backend in BACKENDS:
            out = work / f"{model}-int4-{backend}"
            if not (out / "compression.json").is_file():
                log(f"compress {model} INT4 for {backend}")
                compress(exported, out, CompressSection(scheme="int4-grouped"), target=backend)
            xml = out / "openvino_model.xml"
            files[(model, backend)] = xml if xml.is_file() else out / "model.onnx"
            gc.collect()
    return files


def build_attention_widths(work: Path, args, log) -> dict[tuple[str, str], Path]:
    """(model, backend) -> a float32 graph (both backends read the ONNX file) of random checkpoints with V4-Flash's
    and V3's real hidden and attention widths, rates and window, and a tiny rest (8 routed experts of 64, V3's
    layers dense with 64, a 1024-token vocabulary): --attention-widths, which times what the cache layouts change
    on a machine where the shape-faithful builds take too long. V4's --layers are sliding, CSA, HCA, CSA, ..."""
    import sys as system

    from transformers import DeepseekV3Config, DeepseekV4Config

    from toolchain import source as sources
    from toolchain.checkpoint.reader import open_checkpoint
    from toolchain.export.architectures import architecture_for
    from toolchain.export.cache_precision import with_cache_dtype
    from toolchain.export.decoder import build_decoder
    from toolchain.export.deepseek_v4 import with_v4_cache
    from toolchain.export.graph import save_graph

    system.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_checkpoint  # tests/ holds the random-checkpoint writer

    references = Path(__file__).resolve().parents[1] / "toolchain" / "models" / "reference_configs"

    def real(name: str) -> dict:
        config = json.loads((references / f"{name}.json").read_text())
        return {k: v for k, v in config.items() if k not in ("_source", "quantization_config", "compress_ratios")}

    small = dict(vocab_size=1024, num_hidden_layers=args.layers, n_routed_experts=8, moe_intermediate_size=64)
    kinds = ["sliding_attention", *(["compressed_sparse_attention", "heavily_compressed_attention"] * args.layers)]
    configs = {"v4-flash": DeepseekV4Config(**{**real("deepseek-v4-flash"), **small, "num_hash_layers": 0,
                                               "layer_types": kinds[:args.layers],
                                               "mlp_layer_types": ["moe"] * args.layers}),
               "v3": DeepseekV3Config(**{**real("deepseek-v3"), **small, "intermediate_size": 64,
                                         "first_k_dense_replace": args.layers})}
    files = {}
    for model, (_, _, checkpoint, v4_cache) in models(args).items():
        ckpt = work / f"{checkpoint}-ckpt"
        if not (ckpt / "config.json").is_file():
            log(f"random {checkpoint} at its attention widths, {args.layers} layers")
            make_checkpoint(configs[checkpoint], ckpt, 0)
        graph = work / f"{model}-fp32" / "model.onnx"
        if not graph.is_file():
            log(f"export {model} (fp32)")
            graph.parent.mkdir(parents=True, exist_ok=True)
            source = sources.resolve(str(ckpt))
            with open_checkpoint(source.path) as reader:
                arch = with_v4_cache(architecture_for(source.config["model_type"]), v4_cache)
                built = build_decoder(sources.skeleton(source, reader), arch, reader)
                if model.endswith(F16):
                    with_cache_dtype(built, "float16")
                save_graph(built, graph)
        files |= {(model, backend): graph for backend in BACKENDS}
        gc.collect()
    return files


def cache_bytes(path: Path, context: int) -> int:
    """Bytes every layer of the graph caches for one sequence of ``context`` positions, in its cache dtype, from its
    past_key_values inputs and their length rules (a compressed V4 cache's window, pooled entries and tail)."""
    import numpy as np

    from toolchain.interface.graph import cache_bytes_at, cache_dtype, graph_cache_spec, graph_metadata

    metadata = graph_metadata(path)
    size = np.dtype(cache_dtype(metadata)).itemsize
    inputs = [(name, [0, h, 0, d], size) for name, (h, d) in graph_cache_spec(path).items()]
    return cache_bytes_at(inputs, metadata, context)


def measure_child(args) -> None:
    """One backend: both models loaded, contexts in turn, rounds alternating the models."""
    graphs = json.loads(args.graphs)
    rows = [{"backend": args.measure, **row, "graph": graphs[row["model"]],
             "cache_bytes": cache_bytes(Path(graphs[row["model"]]), row["context"])}
            for row in measure_graphs(graphs, args.measure, args)]
    print(json.dumps(rows))


def measure(files: dict, args, log, done: list[dict]) -> list[dict]:
    rows = list(done)
    for backend in BACKENDS:
        if any(r["backend"] == backend for r in done):
            continue
        graphs = {model: str(files[(model, backend)]) for model in models(args)}
        command = [sys.executable, __file__, "--measure", backend, "--graphs", json.dumps(graphs),
                   "--contexts", ",".join(map(str, args.contexts)), "--steps", str(args.steps),
                   "--rounds", str(args.rounds), "--threads", str(args.threads), "--vocab", str(args.vocab)]
        log(f"measuring {backend}")
        with harness.one_at_a_time():
            out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])
        args.json.write_text(json.dumps({"layers": args.layers, "experts": args.experts, "threads": args.threads,
                                         "steps": args.steps, "rounds": args.rounds, "contexts": args.contexts,
                                         "rows": rows}, indent=1) + "\n")
    return rows


def table(rows: list[dict], contexts: list[int]) -> str:
    get = {(r["backend"], r["model"], r["context"]): r for r in rows}
    lines = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for context in contexts:
            v3 = get.get((backend, "v3", context))
            for model in ("v4-flash", "v4-flash-compressed"):
                v4 = get.get((backend, model, context))
                if v4 is None or v3 is None:
                    continue
                lines.append([backend, context, model, f"{v4['cache_bytes'] / 2**20:.1f} / "
                              f"{v3['cache_bytes'] / 2**20:.1f}", v4["decode_ms_per_token"],
                              v3["decode_ms_per_token"], v4["decode_ms_per_token"] / v3["decode_ms_per_token"]])
    return harness.markdown_table(["backend", "context", "V4 cache", "cache MiB V4 / V3", "V4-Flash ms/tok",
                                   "V3 ms/tok", "V4 / V3"], lines)


def float16_table(rows: list[dict], contexts: list[int]) -> str:
    """--float16-caches: each float16-cache model's ms/token and cache bytes against its float32 export's."""
    get = {(r["backend"], r["model"], r["context"]): r for r in rows}
    lines = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for context in contexts:
            for model in FLOAT16_MODELS:
                wide, narrow = get.get((backend, model, context)), get.get((backend, model + F16, context))
                if wide is None or narrow is None:
                    continue
                lines.append([backend, context, model, f"{wide['cache_bytes'] / 2**20:.1f} / "
                              f"{narrow['cache_bytes'] / 2**20:.1f}", wide["decode_ms_per_token"],
                              narrow["decode_ms_per_token"],
                              narrow["decode_ms_per_token"] / wide["decode_ms_per_token"]])
    return harness.markdown_table(["backend", "context", "model", "cache MiB f32 / f16", "f32 ms/tok", "f16 ms/tok",
                                   "f16 / f32"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--contexts", default="1024,8192", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoints and graphs here (reused)")
    parser.add_argument("--attention-widths", action="store_true",
                        help="float32 random models with the real hidden and attention widths and a tiny rest instead "
                             "of shape-faithful INT4 builds (build_attention_widths)")
    parser.add_argument("--float16-caches", action="store_true",
                        help="V3's and V4's compressed exports with float32 and float16 caches (export.cache_dtype)")
    parser.add_argument("--json", type=Path, default=Path("v4_decode.json"))
    parser.add_argument("--resume", action="store_true", help="keep the backends already in --json")
    parser.add_argument("--measure", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--graphs", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child of measure
        measure_child(args)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-v4-decode-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    files = (build_attention_widths if args.attention_widths else build)(work, args, log)
    args.vocab = json.loads((work / "v3-ckpt" / "config.json").read_text())["vocab_size"]
    done = json.loads(args.json.read_text())["rows"] if args.resume and args.json.is_file() else []
    rows = measure(files, args, log, done)
    print(table(rows, args.contexts))
    if args.float16_caches:
        print(float16_table(rows, args.contexts))


if __name__ == "__main__":
    main()
