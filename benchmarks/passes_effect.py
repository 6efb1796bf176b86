"""What the onnxruntime pass pipeline buys: node counts and ONNX Runtime latency before vs after, in one run.

For each model: export (``dstc export``, no parity), optimise for onnxruntime (``dstc optimize``, no parity: the
tests check it), then time both graphs on ORT's CPU provider with default session options (ORT's own graph
optimisations on, as a user runs them): prefill of a PROMPT-token prompt (batch 1, empty cache) and decode
steps after it (one token at a time on the growing cache), and decode steps after a random cache of CONTEXT
positions, where attention's share of the work is larger. Each sample averages back-to-back runs over a time
budget; the two graphs' samples alternate and the medians are compared as ratios (after / before), so a change
in the machine's load shifts both alike.

For qwen2 checkpoints the run also builds the graph that onnxruntime-genai's model builder makes of the same
checkpoint (``python -m onnxruntime_genai.models.builder -i CHECKPOINT -o OUT -p fp32 -e cpu -c CACHE``, offline)
and times it in the same alternation, with the same prompt, number of decode steps and session options. Its
interface differs from ours: no ``position_ids`` (its GroupQueryAttention takes positions from the attention mask),
the head size of its KV cache is symbolic in the graph (read from its genai_config.json; the layout, [batch, kv
heads, past, head size], is ours), and its cos/sin caches have ``context_length`` rows, so it cannot decode at a
past longer than the checkpoint's ``max_position_embeddings`` (that cell is then n/a). Its logits are compared with
our exported graph's on the prompt and on the decode steps fed the same tokens, so a mis-fed graph shows. A
second table gives its node count and times next to ours before and after the pipeline, and the ratio
builder / ours after (above 1: our optimised graph is faster).

Models: the embedded tiny models that are present, the test suite's tiny random checkpoints for the model types
they do not cover, and a shape-faithful DeepSeek-R1-Distill-Qwen-1.5B with 4 layers (real widths, random
weights).

    .venv/bin/python benchmarks/passes_effect.py [--prompt 128] [--steps 16] [--context 2048] [--repeats 7]
        [--budget 0.3] [--skip-large] [--no-builder] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from toolchain.models.registry import EMBEDDED, embedded_path
from toolchain.runtime.engines import ort_session
from toolchain.models.shape_faithful import make_shape_faithful
from toolchain.stages.alone import export, optimize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the benchmarks' harness is imported from the repository
from benchmarks import harness  # noqa: E402

LARGE = "deepseek-r1-distill-qwen-1.5b"
# Model types also built with onnxruntime-genai's model builder, for comparison.
BUILDER_TYPES = ("qwen2",)
# The names our graphs use; a model builder graph is fed only if its genai_config.json names the same.
BUILDER_NAMES = {"input_ids": "input_ids", "attention_mask": "attention_mask", "logits": "logits",
                 "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value",
                 "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}


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


def build_with_genai(checkpoint: Path, out: Path, cache: Path, log: Path) -> str | None:
    """onnxruntime-genai's model builder on ``checkpoint`` (fp32, CPU) into ``out``, offline; None when it worked
    (or an earlier run's output is there), else why not: its exit status and the last line it printed."""
    if (out / "genai_config.json").is_file() and (out / "model.onnx").is_file():
        return None
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
               "-p", "fp32", "-e", "cpu", "-c", str(cache)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if done.returncode == 0 and (out / "genai_config.json").is_file():
        return None
    lines = [line for line in log.read_text().replace("\r", "\n").splitlines() if line.strip()]
    return f"exit {done.returncode}: {lines[-1] if lines else 'no output'} (log: {log})"


class Runner:
    """A graph on ORT (default session options) with its own KV cache: prefill, then decode steps.

    Our graphs take position_ids and give heads and head size in the past inputs' shapes. A model builder graph
    (genai_config.json beside it) takes no position_ids, its head size is symbolic (heads and head size come from
    its config, whose names must be ours), and it holds at most ``context_length`` positions."""

    def __init__(self, path: Path) -> None:
        self.session = ort_session(path)
        self.names = [o.name for o in self.session.get_outputs()]
        inputs = {value.name: value.shape for value in self.session.get_inputs()}
        self.positions = "position_ids" in inputs
        self.max_positions = None
        self.past = {name: (shape[1], shape[3]) for name, shape in inputs.items()
                     if name.startswith("past_key_values.")}
        genai = path.parent / "genai_config.json"
        if genai.is_file():
            model = json.loads(genai.read_text())["model"]
            decoder = model["decoder"]
            names = {**decoder["inputs"], **decoder["outputs"]}
            layers = range(decoder["num_hidden_layers"])
            past = {t % i for t in (BUILDER_NAMES["past_key_names"], BUILDER_NAMES["past_value_names"]) for i in layers}
            if names != BUILDER_NAMES or set(inputs) - {"position_ids"} != {"input_ids", "attention_mask", *past}:
                raise RuntimeError(f"{path}: an interface this benchmark does not feed: {names}, "
                                   f"inputs {sorted(inputs)}")
            dims = (decoder["num_key_value_heads"], decoder["head_size"])
            wrong = {n: inputs[n] for n in past
                     if inputs[n][1] != dims[0] or inputs[n][3] not in (dims[1], "kv_cache_dim")}
            if wrong:
                raise RuntimeError(f"{path}: past inputs {wrong} are not [batch, {dims[0]}, past, {dims[1]}]")
            self.past = {name: dims for name in past}
            self.max_positions = model["context_length"]

    def step(self, ids: np.ndarray, cache: dict) -> tuple[np.ndarray, dict]:
        past_len = next(iter(cache.values())).shape[2] if cache else 0
        total = past_len + ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64)}
        if self.positions:
            feeds["position_ids"] = np.arange(past_len, total, dtype=np.int64)[None]
        for name, (heads, dim) in self.past.items():
            feeds[name] = cache.get(name, np.zeros((1, heads, 0, dim), np.float32))
        out = dict(zip(self.names, self.session.run(self.names, feeds)))
        return out["logits"], {n: out[n.replace("past_key_values.", "present.")] for n in self.past}

    def decode(self, token: np.ndarray, cache: dict, steps: int) -> None:
        logits = None
        for _ in range(steps):
            logits, cache = self.step(token if logits is None else logits[:, -1:].argmax(-1), cache)


def greedy_trace(runner: Runner, prompt: np.ndarray, steps: int, tokens: list | None = None) -> tuple[list, list]:
    """Logits of the prompt and of ``steps`` decode steps on the runner's own cache, fed ``tokens`` or, without
    them, its own greedy tokens; and the tokens fed."""
    logits, cache = runner.step(prompt, {})
    trace, fed = [logits], []
    for i in range(steps):
        fed.append(logits[:, -1:].argmax(-1) if tokens is None else tokens[i])
        logits, cache = runner.step(fed[-1], cache)
        trace.append(logits)
    return trace, fed


def measure(graphs: dict[str, Path], vocab: int, prompt_len: int, steps: int, context: int, repeats: int,
            budget_s: float) -> tuple[dict, dict]:
    """Median ms per run of each graph (None where its context is too short), and each graph's max relative
    logit difference from the first one."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, (1, prompt_len))
    token = prompt[:, -1:]
    runners = {key: Runner(path) for key, path in graphs.items()}
    # Max |logit difference| from the first graph / its logit range, on the prompt and the decode steps fed the
    # first graph's greedy tokens; also a warm-up of prefill and decode for every graph.
    reference, tokens = greedy_trace(next(iter(runners.values())), prompt, steps)
    differences = {}
    for key, runner in runners.items():
        trace, _ = greedy_trace(runner, prompt, steps, tokens)
        differences[key] = max(float(np.abs(a - b).max() / (b.max() - b.min())) for a, b in zip(trace, reference))
    del reference
    work = {}
    for key, runner in runners.items():
        _, after_prompt = runner.step(prompt, {})
        work[key] = {"prefill": (lambda r=runner: r.step(prompt, {}), 1),
                     "decode": (lambda r=runner, c=after_prompt: r.decode(token, c, steps), steps)}
        if runner.max_positions is None or context + steps <= runner.max_positions:
            long_cache = {n: rng.standard_normal((1, h, context, d), dtype=np.float32)
                          for n, (h, d) in runner.past.items()}
            work[key]["long"] = (lambda r=runner, c=long_cache: r.decode(token, c, steps), steps)
    times = {key: {kind: [] for kind in work[key]} for key in runners}
    for _ in range(repeats):  # the graphs alternate, so a change in the machine's load hits all alike
        for kind in ("prefill", "decode", "long"):
            for key in runners:
                if kind in work[key]:
                    fn, tokens = work[key][kind]
                    times[key][kind].append(harness.per_run_ms(fn, budget_s) / tokens)
    medians = {key: {kind: statistics.median(times[key][kind]) if kind in times[key] else None
                     for kind in ("prefill", "decode", "long")} for key in runners}
    return medians, differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048, help="past length of the long-context decode column")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of back-to-back runs per sample")
    parser.add_argument("--skip-large", action="store_true", help=f"leave out the shape-faithful {LARGE}")
    parser.add_argument("--no-builder", action="store_true",
                        help="do not build and time onnxruntime-genai's model builder graph "
                             f"({', '.join(BUILDER_TYPES)} checkpoints)")
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
    rows, builder_rows = [], []
    for name, checkpoint in models.items():
        slug = name.split()[0]
        exported, optimised = work / "export" / slug, work / "onnxruntime" / slug
        if not (exported / "export.json").is_file():  # an earlier run's export in --workdir is reused
            export(str(checkpoint), exported, parity=())
        passes = optimize(exported, optimised, "onnxruntime", parity=False)
        config = json.loads((checkpoint / "config.json").read_text())
        graphs = {"before": exported / "model.onnx", "after": optimised / "model.onnx"}
        failure, built = None, work / "onnxruntime-genai" / slug
        if not args.no_builder and config["model_type"] in BUILDER_TYPES:
            failure = build_with_genai(checkpoint, built, work / "onnxruntime-genai-cache",
                                       work / "onnxruntime-genai" / f"{slug}.log")
            if failure is None:
                graphs["builder"] = built / "model.onnx"
            else:
                print(f"model builder failed on {name}: {failure}", file=sys.stderr)
        t, differences = measure(graphs, config["vocab_size"], args.prompt, args.steps, args.context, args.repeats,
                                 args.budget)
        rows.append((name, passes["input"]["nodes"], passes["output"]["nodes"], t))
        if "builder" in graphs:
            nodes = len(onnx.load(str(graphs["builder"]), load_external_data=False).graph.node)
            builder_rows.append((name, passes["input"]["nodes"], passes["output"]["nodes"], nodes, t, differences))
        elif failure is not None:
            builder_rows.append((name, passes["input"]["nodes"], passes["output"]["nodes"], failure, None, None))
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
    if not builder_rows:
        return
    print()
    print(f"onnxruntime-genai {genai_version()} model builder (-p fp32 -e cpu) vs ours, same run and samples: "
          f"ms per run, ours before / ours after / builder (builder / ours after); logits: max |difference| from "
          f"our exported graph / its logit range, prompt and {args.steps} decode steps, ours after and builder")
    print(f"| model | nodes before / after / builder | prefill {args.prompt} tokens | decode after the prompt "
          f"| decode at past {args.context} | logits vs ours before |")
    print("|---|---|---|---|---|---|")
    for name, nodes_before, nodes_after, nodes, t, differences in builder_rows:
        if t is None:
            print(f"| {name} | {nodes_before} / {nodes_after} / - | builder failed: {nodes} | | | |")
            continue
        cells = [f"{t['before'][k]:.2f} / {t['after'][k]:.2f} / {t['builder'][k]:.2f} "
                 f"({t['builder'][k] / t['after'][k]:.2f})" if t["builder"][k] is not None else
                 f"{t['before'][k]:.2f} / {t['after'][k]:.2f} / n/a (beyond its context_length)"
                 for k in ("prefill", "decode", "long")]
        print(f"| {name} | {nodes_before} / {nodes_after} / {nodes} | " + " | ".join(cells) +
              f" | {differences['after']:.1e} / {differences['builder']:.1e} |")


def genai_version() -> str:
    from importlib.metadata import version

    return version("onnxruntime-genai")


if __name__ == "__main__":
    main()
