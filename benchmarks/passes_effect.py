"""What the onnxruntime pass pipeline buys: node counts and ONNX Runtime latency before vs after, in one run.

For each model: export (``dstc export``, no parity), optimise for onnxruntime (``dstc optimize``, no parity: the
tests check it), then time both graphs on ORT's CPU provider with default session options (ORT's own graph
optimisations on, as a user runs them): prefill of a PROMPT-token prompt (batch 1, empty cache) and decode
steps after it (one token at a time on the growing cache), and decode steps after a random cache of CONTEXT
positions, where attention's share of the work is larger. Each sample averages back-to-back runs over a time
budget; the two graphs' samples alternate and the medians are compared as ratios (after / before), so a change
in the machine's load shifts both alike.

Models: the embedded tiny models that are present, the test suite's tiny random checkpoints for the model types
they do not cover, and a shape-faithful DeepSeek-R1-Distill-Qwen-1.5B with 4 layers (real widths, random
weights).

    .venv/bin/python benchmarks/passes_effect.py [--prompt 128] [--steps 16] [--context 2048] [--repeats 7]
        [--budget 0.3] [--skip-large] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from toolchain.models.registry import EMBEDDED, embedded_path
from toolchain.models.shape_faithful import make_shape_faithful
from toolchain.stages.export import export
from toolchain.stages.optimize import optimize

LARGE = "deepseek-r1-distill-qwen-1.5b"


def tiny_checkpoints(root: Path) -> dict[str, Path]:
    """The embedded models that are present, and the test suite's tiny random checkpoints for every model type
    none of them covers."""
    models = {name: embedded_path(name) for name in EMBEDDED if (embedded_path(name) / "config.json").is_file()}
    covered = {EMBEDDED[name] for name in models}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import make_checkpoint, tiny_configs

    for name, config in tiny_configs().items():
        if config.model_type not in covered:
            models[name] = make_checkpoint(config, root / name)
    return models


class Runner:
    """A graph on ORT (default session options) with its own KV cache: prefill, then decode steps."""

    def __init__(self, path: Path) -> None:
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.past = {}
        for value in self.session.get_inputs():
            if value.name.startswith("past_key_values."):
                self.past[value.name] = (value.shape[1], value.shape[3])

    def step(self, ids: np.ndarray, cache: dict) -> tuple[np.ndarray, dict]:
        past_len = next(iter(cache.values())).shape[2] if cache else 0
        total = past_len + ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64),
                 "position_ids": np.arange(past_len, total, dtype=np.int64)[None]}
        for name, (heads, dim) in self.past.items():
            feeds[name] = cache.get(name, np.zeros((1, heads, 0, dim), np.float32))
        out = dict(zip(self.names, self.session.run(self.names, feeds)))
        return out["logits"], {n: out[n.replace("past_key_values.", "present.")] for n in self.past}

    def decode(self, token: np.ndarray, cache: dict, steps: int) -> None:
        logits = None
        for _ in range(steps):
            logits, cache = self.step(token if logits is None else logits[:, -1:].argmax(-1), cache)


def per_run_ms(fn, budget_s: float) -> float:
    """Mean ms of ``fn`` over as many back-to-back runs as fill ``budget_s`` (at least one): on a shared
    machine, one sample of a millisecond-long run is mostly the scheduler's noise."""
    runs, t0 = 0, time.perf_counter()
    while runs == 0 or time.perf_counter() - t0 < budget_s:
        fn()
        runs += 1
    return (time.perf_counter() - t0) * 1e3 / runs


def measure(before: Path, after: Path, vocab: int, prompt_len: int, steps: int, context: int, repeats: int,
            budget_s: float) -> dict:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, (1, prompt_len))
    token = prompt[:, -1:]
    runners = {"before": Runner(before), "after": Runner(after)}
    work = {}
    for key, runner in runners.items():
        _, after_prompt = runner.step(prompt, {})  # also a warm-up
        long_cache = {n: rng.standard_normal((1, h, context, d), dtype=np.float32) for n, (h, d) in runner.past.items()}
        work[key] = {"prefill": (lambda r=runner: r.step(prompt, {}), 1),
                     "decode": (lambda r=runner, c=after_prompt: r.decode(token, c, steps), steps),
                     "long": (lambda r=runner, c=long_cache: r.decode(token, c, steps), steps)}
    times = {key: {kind: [] for kind in work[key]} for key in runners}
    for _ in range(repeats):  # before and after alternate, so a change in the machine's load hits both
        for kind in ("prefill", "decode", "long"):
            for key in runners:
                fn, tokens = work[key][kind]
                times[key][kind].append(per_run_ms(fn, budget_s) / tokens)
    return {key: {kind: statistics.median(values) for kind, values in kinds.items()} for key, kinds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048, help="past length of the long-context decode column")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of back-to-back runs per sample")
    parser.add_argument("--skip-large", action="store_true", help=f"leave out the shape-faithful {LARGE}")
    parser.add_argument("--workdir", type=Path, default=None, help="keep checkpoints and graphs here")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-passes-bench-"))
    models = tiny_checkpoints(work / "tiny")
    if not args.skip_large:
        large = work / f"{LARGE}-4l"
        if not (large / "config.json").is_file():
            try:
                make_shape_faithful(LARGE, large, num_layers=4)
            except FileNotFoundError as e:  # the embedded tokenizer it copies; token ids are random here
                if not list(large.glob("*.safetensors")):
                    raise
                print(f"shape-faithful checkpoint written without a tokenizer ({e.filename} missing)", file=sys.stderr)
        models[f"{LARGE} (4 layers)"] = large
    rows = []
    for name, checkpoint in models.items():
        slug = name.split()[0]
        exported, optimised = work / "export" / slug, work / "onnxruntime" / slug
        if not (exported / "export.json").is_file():  # an earlier run's export in --workdir is reused
            export(str(checkpoint), exported, parity=())
        passes = optimize(exported, optimised, "onnxruntime", parity=False)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        t = measure(exported / "model.onnx", optimised / "model.onnx", vocab, args.prompt, args.steps, args.context,
                    args.repeats, args.budget)
        rows.append((name, passes["input"]["nodes"], passes["output"]["nodes"], t))
        print(f"measured {name}", file=sys.stderr)
    print(f"ONNX Runtime {ort.__version__}, CPU, default session options; ms per run (decode: per token, "
          f"{args.steps}-step runs); medians of {args.repeats} alternating samples of >= {args.budget} s each; "
          f"ratio = after / before")
    print(f"| model | nodes before -> after | prefill {args.prompt} tokens | decode after the prompt "
          f"| decode at past {args.context} |")
    print("|---|---|---|---|---|")
    for name, nodes_before, nodes_after, t in rows:
        cells = [f"{t['before'][k]:.2f} -> {t['after'][k]:.2f} ({t['after'][k] / t['before'][k]:.2f})"
                 for k in ("prefill", "decode", "long")]
        print(f"| {name} | {nodes_before} -> {nodes_after} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
