"""MoE decode cost against the number of idle experts: dstc's MoE lowerings on ONNX Runtime and OpenVINO.

A DeepSeek-V3-style random checkpoint (hidden 512, 4 layers: one dense and three MoE, 8 routed experts + 1 shared
active per token) is written with 16, 64 and 256 routed experts (the same active work), and with 256 experts whose
routing is held to 16 of them ("256/16": the chosen experts' weights then span what the 16-expert model's do, which
separates the lowering's cost of idle experts from the cache's), exported with each MoE lowering
(toolchain/export/moe.py: ``dispatch`` and the backend's fused form) and compressed to INT4 (int4-grouped, g128,
asymmetric). Per backend and precision, every (model, lowering) contender is loaded at once and run in turn, round
after round (alternating the order): a prompt of 32 tokens then 64 greedy tokens (batch 1, 2 threads, stateless
graphs with the KV cache fed back; decode ms/token is the median over rounds of each round's mean step), and one
prefill of 256 tokens. Session creation (ORT InferenceSession / OpenVINO read + compile) is the median of a few,
each in a fresh process. The table has the node count of the graph the runtime loads and each lowering's decode
time as a ratio to its time with 16 experts (the target: <= 1.15 at 256). Results go to the --json file.

    .venv/bin/python benchmarks/moe_decode.py --json moe_decode.json
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

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
              num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
              kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
              n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
              max_position_embeddings=2048)
FUSED = {"onnxruntime": "fused-onnxruntime", "openvino": "fused-openvino"}


def checkpoint(path: Path, spec: str) -> Path:
    """A seeded random V3-style checkpoint in bf16 (the hub's dtype), with a routing bias as a trained V3 has.
    ``spec``: the number of routed experts, or "E/P": E experts whose routing is held to the first P (their
    correction bias raised by 10, far above the sigmoid scores), so that the chosen experts' weights span what a
    P-expert model's do."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    if (path / "config.json").is_file():
        return path
    experts, _, pool = spec.partition("/")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**CONFIG, n_routed_experts=int(experts)),
                                             dtype=torch.bfloat16)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
                if pool:
                    module.e_score_correction_bias[:int(pool)] += 10.0
    model.save_pretrained(path)
    return path


def build(work: Path, spec: str, log) -> dict[tuple[str, str, str], Path]:
    """(backend, precision, lowering) -> the graph file that backend runs, for one model (see checkpoint)."""
    from toolchain.recipe import CompressSection
    from toolchain.stages.alone import compress, export

    name = spec.replace("/", "-pool")
    ckpt = checkpoint(work / f"ckpt-{name}", spec)
    files = {}
    for lowering in ("dispatch", *FUSED.values()):
        out = work / f"export-{name}-{lowering}"
        if not (out / "export.json").is_file():
            log(f"export {spec} experts, {lowering}")
            export(str(ckpt), out, parity=(), moe=lowering)
        for backend in ("onnxruntime", "openvino"):
            if lowering in ("dispatch", FUSED[backend]):
                files[(backend, "fp32", lowering)] = out / "model.onnx"
    for backend, fused in FUSED.items():
        for lowering in ("dispatch", fused):
            out = work / f"int4-{name}-{lowering}-{backend}"
            if not (out / "compression.json").is_file():
                log(f"compress {spec} experts, {lowering}, INT4 for {backend}")
                compress(work / f"export-{name}-{lowering}", out,
                         CompressSection(scheme="int4-grouped"), target=backend)
            xml = out / "openvino_model.xml"  # a streamed compression writes ONNX for both targets
            files[(backend, "int4", lowering)] = xml if xml.is_file() else out / "model.onnx"
        gc.collect()
    return files


def node_count(path: Path) -> int:
    import onnx

    if path.suffix == ".xml":
        import openvino as ov

        return sum(op.get_type_name() not in ("Constant", "Parameter", "Result")
                   for op in ov.Core().read_model(str(path)).get_ordered_ops())
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def open_graph(path: Path, backend: str, threads: int, numerics: str):
    from toolchain.interface.graph import graph_cache_spec
    from toolchain.runtime.decoder import StatelessDecoder
    from toolchain.runtime.engines import GraphRunner

    started = time.perf_counter()
    runner = GraphRunner(path, backend, numerics=numerics, threads=threads)
    return StatelessDecoder(runner, graph_cache_spec(path)), time.perf_counter() - started


def creation_seconds(path: Path, backend: str, args) -> float:
    """Session creation in a fresh process (nothing cached, and its memory gone after)."""
    out = subprocess.run([sys.executable, __file__, "--create", str(path), backend, "--threads", str(args.threads),
                          "--numerics", args.numerics], check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def measure(files: dict, experts: list[str], args, log, done: list[dict]) -> list[dict]:
    """Every (backend, precision) group not in ``done``; the JSON file is rewritten after each group."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, CONFIG["vocab_size"], (1, args.prompt)).astype(np.int64)
    long_prompt = rng.integers(0, CONFIG["vocab_size"], (1, args.prefill)).astype(np.int64)
    rows = list(done)
    for backend in ("onnxruntime", "openvino"):
        for precision in ("fp32", "int4"):
            if any(r["backend"] == backend and r["precision"] == precision for r in done):
                continue
            group = [(e, lowering) for e in experts for lowering in ("dispatch", FUSED[backend])]
            creation, decoders = {}, {}
            for key in group:
                path = files[key[0]][(backend, precision, key[1])]
                creation[key] = statistics.median(creation_seconds(path, backend, args)
                                                  for _ in range(args.creations))
                decoders[key], _ = open_graph(path, backend, args.threads, args.numerics)
                log(f"{backend} {precision} {key[0]} experts {key[1]}: created in {creation[key]:.2f} s")
            rounds: dict = {key: [] for key in group}
            prefills: dict = {key: [] for key in group}
            tokens = {}
            for _, key in harness.alternation(group, args.rounds):
                ms, tokens[key] = harness.decode_ms(decoders[key], prompt, args.new_tokens)
                rounds[key].append(ms)
                prefills[key].append(harness.prefill_ms(decoders[key], long_prompt))
            for key in group:
                e, lowering = key
                path = files[e][(backend, precision, lowering)]
                rows.append({"backend": backend, "precision": precision, "experts": e, "lowering": lowering,
                             "decode_ms_per_token": statistics.median(rounds[key]), "rounds_ms": rounds[key],
                             "prefill_ms": statistics.median(prefills[key]),
                             "creation_s": creation[key], "nodes": node_count(path), "graph": str(path),
                             "tokens_as_dispatch": tokens[key] == tokens[(e, "dispatch")]})
            del decoders
            gc.collect()
            write(args, experts, rows)
    return rows


def write(args, experts: list[str], rows: list[dict]) -> None:
    args.json.write_text(json.dumps({"config": CONFIG, "experts": experts, "threads": args.threads,
                                     "prompt": args.prompt, "new_tokens": args.new_tokens,
                                     "prefill": args.prefill, "rounds": args.rounds,
                                     "numerics": args.numerics, "rows": rows}, indent=1) + "\n")


def table(rows: list[dict], experts: list[str], prefill: int) -> str:
    """Ratios are to the first model of --experts."""
    lines = []
    for row in rows:
        base = next(r for r in rows if r["backend"] == row["backend"] and r["precision"] == row["precision"]
                    and r["lowering"] == row["lowering"] and r["experts"] == experts[0])
        lines.append([row["backend"], row["precision"], row["lowering"], row["experts"], row["nodes"],
                      row["creation_s"], row["decode_ms_per_token"],
                      row["decode_ms_per_token"] / base["decode_ms_per_token"], row["prefill_ms"],
                      "yes" if row["tokens_as_dispatch"] else "no"])
    return harness.markdown_table(["backend", "prec", "lowering", "experts", "nodes", "create s", "decode ms/tok",
                                   f"vs {experts[0]}", f"prefill {prefill} ms", "tokens = dispatch"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="16,64,256,256/16",
                        help="routed expert counts; E/P: E experts, routing held to the first P (see checkpoint)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=256, help="tokens of the prefill timed once per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--creations", type=int, default=3)
    parser.add_argument("--numerics", choices=("exact", "deployment"), default="exact",
                        help="OpenVINO: f32 compute (exact) or the CPU plugin's defaults (bf16 where it can)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep checkpoints and graphs here (reused)")
    parser.add_argument("--json", type=Path, default=Path("moe_decode.json"))
    parser.add_argument("--resume", action="store_true", help="keep the groups already in --json")
    parser.add_argument("--create", nargs=2, metavar=("GRAPH", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.create:  # a child of creation_seconds
        print(open_graph(Path(args.create[0]), args.create[1], args.threads, args.numerics)[1])
        return
    experts = args.experts.split(",")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-moe-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    files = {e: build(work, e, log) for e in experts}
    done = json.loads(args.json.read_text())["rows"] if args.resume and args.json.is_file() else []
    print(table(measure(files, experts, args, log, done), experts, args.prefill))


if __name__ == "__main__":
    main()
