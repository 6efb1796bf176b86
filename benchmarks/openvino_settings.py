"""OpenVINO CPU settings for a dstc OpenVINO artifact, measured: KV-cache precision x dynamic quantization group
size, on openvino_genai's stateful LLMPipeline (what users run), in one run with the settings alternated.

Per setting: TTFT and decode ms/token (medians over rounds) for a prompt of ``--prompt`` random token ids and
``--new-tokens`` greedy tokens, and how many of those greedy tokens equal the ones of the exact setting (f32 KV
cache, no dynamic quantization): a speed/accuracy table from which to choose what to record in an artifact. The
settings go to the pipeline as properties; OpenVINO's core also applies them from the IR's rt_info
``runtime_options`` (checked at start: what an artifact records is what openvino_genai, optimum-intel and dstc's
runner get).

    .venv/bin/python benchmarks/openvino_settings.py ARTIFACT [--threads 2] [--rounds 3] [--prompt 128]
        [--kv u8,f16,f32] [--groups 0,32,64,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from toolchain.hardware import cpu_line  # noqa: E402

KV = ("u8", "f16", "f32")
GROUPS = (0, 32, 64, 128)  # 0: no dynamic quantization of activations


def rt_info_is_applied(xml: Path) -> bool:
    """Whether compile_model takes KV_CACHE_PRECISION from the IR's rt_info runtime_options."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(xml))
    model.set_rt_info("f16", ["runtime_options", "KV_CACHE_PRECISION"])
    return str(core.compile_model(model, "CPU").get_property("KV_CACHE_PRECISION")) in ("<Type: 'float16'>", "f16")


def generate(pipe, ids: np.ndarray, new: int) -> tuple[float, float, list[int]]:
    import openvino as ov
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens, config.min_new_tokens, config.ignore_eos, config.do_sample = new, new, True, False
    started = time.perf_counter()
    result = pipe.generate(ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), config)
    total = time.perf_counter() - started
    ttft = result.perf_metrics.get_ttft().mean / 1e3
    return ttft, (total - ttft) / (new - 1), list(result.tokens[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv", default=",".join(KV), help="KV-cache precisions, comma-separated")
    p.add_argument("--groups", default=",".join(map(str, GROUPS)), help="dynamic quantization group sizes")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    import openvino_genai as ov_genai

    config = json.loads((args.artifact / "config.json").read_text())
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (1, args.prompt), dtype=np.int64)
    warm = np.random.default_rng(1).integers(0, config["vocab_size"], (1, 16), dtype=np.int64)
    settings = list(itertools.product(args.kv.split(","), map(int, args.groups.split(","))))
    if ("f32", 0) not in settings:
        settings.append(("f32", 0))  # the exact setting the greedy tokens are compared with
    pipes = {}
    for kv, group in settings:
        pipes[kv, group] = ov_genai.LLMPipeline(str(args.artifact), "CPU", INFERENCE_NUM_THREADS=args.threads,
                                                ATTENTION_BACKEND="SDPA", KV_CACHE_PRECISION=kv,
                                                DYNAMIC_QUANTIZATION_GROUP_SIZE=group)
        generate(pipes[kv, group], warm, 4)  # a first run on another prompt: allocations, kernels
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {s: [] for s in settings}
    tokens: dict[tuple[str, int], list[int]] = {}
    for r in range(args.rounds):
        order = settings[r % len(settings):] + settings[:r % len(settings)]  # rotated every round
        for s in order:
            ttft, step, out = generate(pipes[s], ids, args.new_tokens)
            samples[s].append((ttft, step))
            tokens.setdefault(s, out)
    exact = tokens["f32", 0]
    rows = []
    for s in settings:
        ttft = statistics.median(t for t, _ in samples[s]) * 1e3
        step = statistics.median(d for _, d in samples[s]) * 1e3
        same = next((i for i, (a, b) in enumerate(zip(tokens[s], exact, strict=True)) if a != b), len(exact))
        rows.append({"kv_cache": s[0], "dq_group": s[1], "ttft_ms": round(ttft, 1), "decode_ms": round(step, 2),
                     "tokens_equal_to_exact": same, "tokens": len(exact)})
    best = min(r["decode_ms"] for r in rows)
    print(f"{cpu_line()}; {args.threads} threads; rt_info runtime_options applied by compile_model: "
          f"{rt_info_is_applied(args.artifact / 'openvino_model.xml')}")
    print("| KV cache | DQ group | TTFT ms | decode ms/token | decode / best | greedy tokens equal to f32/0 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_cache']} | {r['dq_group']} | {r['ttft_ms']} | {r['decode_ms']} | "
              f"{r['decode_ms'] / best:.2f} | {r['tokens_equal_to_exact']}/{r['tokens']} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
