"""Speculative decoding (toolchain/runtime/speculative.py) on the embedded models: tokens/s with and without it,
the acceptance per draft position, and whether the greedy tokens are plain decoding's.

Each embedded model is built fp32 for both backends (the stage cache, DSTC_CACHE_DIR, is reused) and run at batch
1 with 2 threads in three configurations: ONNX Runtime (fp32), OpenVINO at exact numerics (f32 compute and KV
cache) and OpenVINO at its deployment numerics (the CPU plugin's defaults: bf16 compute where the CPU has it, the
artifact's f16 KV cache). The prompts are few-shot held-out arithmetic problems (solved examples, then one to
solve), each decoded for --tokens tokens with stop tokens ignored, by three methods: plain greedy decoding, prompt
lookup and a draft model (another embedded model of the same tokenizer, r1-distill-qwen-tiny, or
r1-distill-llama-tiny for it, opened at the same numerics), --draft-tokens per verify step. Rounds alternate the
methods' order; tokens/s is the median over rounds of each round's tokens over its seconds (prefill included).
``identical``: every prompt's speculative tokens equal plain decoding's (expected at exact numerics); ``match``:
the mean fraction of the tokens up to the first difference (the greedy-match rate, for deployment numerics). Timing
holds the benchmark lock (benchmarks/harness.py's one_at_a_time): one benchmark at a time on the shared machine.

    .venv/bin/python benchmarks/speculative.py --workdir /tmp/spec-bench --json speculative.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.modules["openvino_telemetry"] = None  # it forks per event; see tests/conftest.py
from benchmarks import harness  # noqa: E402
from benchmarks.harness import one_at_a_time  # noqa: E402

MODELS = ("deepseek-v3-tiny", "deepseek-v2-lite-tiny", "r1-distill-qwen-tiny", "r1-distill-llama-tiny")
CONFIGS = {"onnxruntime": ("onnxruntime", True), "openvino-exact": ("openvino", True),
           "openvino-deployment": ("openvino", False)}  # name -> (backend, exact numerics)
METHODS = ("plain", "prompt-lookup", "draft")


def draft_model(model: str) -> str:
    return "r1-distill-llama-tiny" if model == "r1-distill-qwen-tiny" else "r1-distill-qwen-tiny"


def build_artifacts(work: Path) -> dict[tuple[str, str], Path]:
    """(model, backend) -> its fp32 artifact, built on first use."""
    import yaml

    from toolchain.build import build

    paths = {}
    for model in MODELS:
        for backend in ("onnxruntime", "openvino"):
            out = work / f"{model}-{backend}"
            if not (out / "manifest.json").is_file():
                recipe = work / f"{model}-{backend}.yaml"
                recipe.write_text(yaml.safe_dump({"name": "bench", "model": model, "export": {"parity": []},
                                                  "compile": {"backend": backend, "verify": False}}))
                print(f"building {model} for {backend}", flush=True)
                build(recipe, out)
            paths[model, backend] = out
    return paths


def prompts(tokenizer, count: int, shots: int) -> list[list[int]]:
    """``count`` prompts of ``shots`` solved held-out problems, a line each, then one to solve."""
    from toolchain.models.corpus import task_examples

    examples = task_examples("heldout", count * (shots + 1))
    out = []
    for i in range(count):
        group = examples[i * (shots + 1):(i + 1) * (shots + 1)]
        text = "".join(q + a + "\n" for q, a in group[:-1]) + group[-1][0]
        out.append(tokenizer(text)["input_ids"])
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(main, draft, prompt_ids: list[list[int]], args) -> dict:
    """Per method: tokens/s (median over rounds), and for the speculative ones the acceptance and the match with
    plain decoding's tokens."""
    from toolchain.runtime.generate import greedy_generate
    from toolchain.runtime.speculative import Acceptance, DraftModel, PromptLookup, speculative_steps

    drafters = {"prompt-lookup": PromptLookup(), "draft": DraftModel(draft)}

    def run(method: str, prompt: list[int], acceptance: Acceptance) -> list[int]:
        if method == "plain":
            return greedy_generate(main, [prompt], args.tokens, set(), 0, ignore_stop=True).tokens[0]
        return [t for step in speculative_steps(main, drafters[method], prompt, max_new_tokens=args.tokens,
                                                stop_ids=set(), draft_tokens=args.draft_tokens,
                                                acceptance=acceptance) for t in step]

    for prompt in prompt_ids[:1]:  # warm-up, unmeasured
        for method in METHODS:
            run(method, prompt, Acceptance())
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    tokens: dict[str, list[list[int]]] = {}
    acceptance = {m: Acceptance() for m in METHODS}
    for round_ in range(args.rounds):
        order = METHODS if round_ % 2 == 0 else METHODS[::-1]
        for method in order:
            outputs, started = [], time.perf_counter()
            for prompt in prompt_ids:
                outputs.append(run(method, prompt, acceptance[method] if round_ == 0 else Acceptance()))
            rates[method].append(sum(map(len, outputs)) / (time.perf_counter() - started))
            tokens.setdefault(method, outputs)
    result = {}
    for method in METHODS:
        entry: dict = {"tokens_per_second": round(statistics.median(rates[method]), 2)}
        if method != "plain":
            prefix = [common_prefix(s, p) / len(p) for s, p in zip(tokens[method], tokens["plain"])]
            entry.update(identical=tokens[method] == tokens["plain"], match=round(statistics.mean(prefix), 4),
                         speedup=round(entry["tokens_per_second"] / statistics.median(rates["plain"]), 3),
                         **acceptance[method].summary())
        result[method] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--shots", type=int, default=3, help="solved problems before the one to solve")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--lock", type=Path, default=harness.LOCK)
    args = parser.parse_args()

    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.decoder import open_decoder

    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = build_artifacts(args.workdir)
    results = []
    with one_at_a_time(args.lock):
        for model in args.models.split(","):
            for config in args.configs.split(","):
                backend, exact = CONFIGS[config]
                art = open_artifact(paths[model, backend])
                main_decoder = open_decoder(art, threads=args.threads, openvino_f32=exact)
                draft = open_decoder(open_artifact(paths[draft_model(model), backend]), threads=args.threads,
                                     openvino_f32=exact)
                row = {"model": model, "config": config, "draft_model": draft_model(model),
                       **measure(main_decoder, draft, prompts(art.tokenizer(), args.prompts, args.shots), args)}
                results.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(f"| model | config | plain tok/s | method | tok/s | speedup | identical | match | acceptance per "
          f"position (of {args.draft_tokens}) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results:
        for method in METHODS[1:]:
            entry = row[method]
            per_position = " ".join(f"{r:.2f}" for r in entry["acceptance_per_position"])
            print(f"| {row['model']} | {row['config']} | {row['plain']['tokens_per_second']} | {method} | "
                  f"{entry['tokens_per_second']} | {entry['speedup']} | {entry['identical']} | {entry['match']} | "
                  f"{per_position} |")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
