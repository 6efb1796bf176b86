"""Speculative decoding beside the peers, in one run: tokens/s with speculation on and off, dstc's artifacts and the
peers' exports of the same embedded trained tiny models (where drafts are accepted: peers.py's random-weight
checkpoints accept none), greedy, batch 1.

Contenders, RUNNER/METHOD (each skipped, the reason in its table row, where it does not build, install or run):

* ``dstc-ort``, ``dstc-ov``: dstc's fp32 artifacts (as benchmarks/speculative.py builds them; DeepSeek-V3's with
  ``export.mtp``) on dstc's runner (toolchain/runtime/speculative.py), OpenVINO at its deployment defaults:
  ``plain``, ``prompt-lookup``, ``mtp`` (the artifact's trained MTP layer) and ``draft`` (another embedded model of
  the tokenizer, speculative.py's ``draft_model``, built alike);
* ``optimum-ov-genai``: ``optimum-cli export openvino --weight-format fp32`` on openvino_genai.LLMPipeline:
  ``plain`` (its stateful SDPA pipeline, as peers.py), ``prompt-lookup`` (``prompt_lookup=True``) and ``draft``
  (``draft_model=openvino_genai.draft_model(...)``, the draft model exported alike); the speculative pipelines
  run on its paged (continuous batching) backend only, prefix caching off, so ``plain-paged`` is that backend
  without speculation;
* ``llamacpp-f32``: llama.cpp's GGUF converter at f32 on llama-cpp-python's Llama: ``plain`` and ``prompt-lookup``
  (``llama_cpp.llama_speculative.LlamaPromptLookupDecoding`` as its draft_model: llama-cpp-python has no
  draft-model speculation of its own). llama_cpp is found as peers.py finds it (PYTHONPATH=SDIST:SDIST/vendor/
  llama.cpp/gguf-py and LLAMA_CPP_LIB_PATH=its built libraries, for instance);
* ``ortgenai-builder``: onnxruntime-genai's model builder at fp32 on its generator: ``plain`` and
  ``prompt-lookup`` (its n-gram speculation, ``set_speculative_options(max_draft_tokens, ngram_size)``).

Workload: benchmarks/speculative.py's (``--prompts`` few-shot held-out arithmetic prompts, ``--shots`` solved
problems each), the same token ids for every contender, ``--tokens`` new tokens each, the end of sequence made and
ignored (the embedded models end every answer with it): openvino_genai by ``ignore_eos`` alone (a minimum length
keeps it from being made), onnxruntime-genai by its padding id standing for it (its n-gram speculation drafts
nothing while a minimum length is pending), the others by their own loops; the tokens made per prompt are in the
table. ``--draft-tokens`` per verify step, n-grams of up to 3 for prompt lookup, ``--threads`` threads. Each
measurement is a child process of its own (peers.py's ``child_json``), warmed up by a generation of another prompt
and of each timed one, then ``--passes`` passes over the prompts one after another; a measurement's tokens/s is all
their tokens over all their seconds (prefill included, as speculative.py) in its fastest pass (the machine is
shared: its other work only slows a pass down). Contenders alternate for ``--rounds`` rounds in an order rotated every
round (harness.alternation), under the benchmark lock; medians are kept.

Reported per contender: tokens/s (the median, and the best round's: on a shared machine a measurement is slowed,
never sped up, by the others' work), the speed-up over its runner's ``plain``, the ratio to the best peer's
``plain``, tokens per main-model forward (prefill and verify steps; where the runner counts them), the draft
acceptance (accepted over proposed draft tokens, where it counts them), and the greedy-match rate: the mean share
of its runner's plain tokens that its tokens repeat before the first difference (1.0: the same tokens).

    .venv/bin/python benchmarks/peers_speculative.py --models deepseek-v3-tiny,r1-distill-qwen-tiny \\
        --work /work/peers-work/speculative --json peers-speculative.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import harness, optimum_intel_env, peers  # noqa: E402
from benchmarks.speculative import common_prefix, draft_model, prompts  # noqa: E402
from toolchain.hardware import cpu_line, describe_cpu  # noqa: E402
from toolchain.models.make import MTP_MODELS  # noqa: E402  (the embedded models trained with an MTP layer)
from toolchain.models.registry import embedded_path  # noqa: E402
from toolchain.tokenizer_loading import load_tokenizer  # noqa: E402

MODELS = ("deepseek-v3-tiny", "r1-distill-qwen-tiny")
DSTC_METHODS = ("plain", "prompt-lookup", "mtp", "draft")
RUNNERS = {"dstc-ort": DSTC_METHODS, "dstc-ov": DSTC_METHODS,
           "optimum-ov-genai": ("plain", "plain-paged", "prompt-lookup", "draft"),
           "llamacpp-f32": ("plain", "prompt-lookup"), "ortgenai-builder": ("plain", "prompt-lookup")}
MAX_NGRAM = 3  # prompt lookup's longest n-gram, every runner (dstc's PromptLookup default)


# ---------------------------------------------------------------------------------------------------------------
# Building: every runner's export of a model (and of its draft model), peers.py's builders at fp32.

def builds_of(model: str, work: Path, max_rss: int) -> dict:
    """{source: (out, build)}: the builds a model's contenders use, peers.py's builders at fp32."""
    checkpoint, out = embedded_path(model), work / model
    mtp = model in MTP_MODELS
    return {
        "dstc-ort": (out / "dstc-ort", lambda o: peers.build_dstc(checkpoint, "onnxruntime", o, out, max_rss,
                                                                   scheme=None, mtp=mtp)),
        "dstc-ov": (out / "dstc-ov", lambda o: peers.build_dstc(checkpoint, "openvino", o, out, max_rss,
                                                                 scheme=None, mtp=mtp)),
        "optimum-ov-genai": (out / "optimum", lambda o: peers.build_optimum(checkpoint, o, max_rss, "fp32")),
        "llamacpp-f32": (out / "llamacpp", lambda o: build_llamacpp_f32(checkpoint, o, max_rss)),
        "ortgenai-builder": (out / "builder", lambda o: peers.build_ortgenai(checkpoint, o, out, max_rss, "fp32")),
    }


F32_GGUF = "model-f32.gguf"


def build_llamacpp_f32(checkpoint: Path, out: Path, max_rss: int) -> dict:
    """llama.cpp's converter to an f32 GGUF, as benchmarks/peer_fidelity.py converts the embedded models
    (peer_worker.py's convert-gguf), in optimum-intel's environment: dstc's transformers (5.24) gives the embedded
    tokenizer an <|endoftext|> past the model's vocabulary, which the converter refuses; 5.5's does not."""
    try:
        converter = peers.llamacpp_converter()
    except ImportError as e:
        raise peers.Failed(f"{e.name} is not installed (llama-cpp-python's source tree on PYTHONPATH)") from None
    out.mkdir(parents=True, exist_ok=True)
    gguf_py = converter.parent / "gguf-py"  # the gguf package of the converter's own tree
    return peers.run_measured([str(optimum_intel_env.PYTHON), str(REPO / "benchmarks" / "peer_worker.py"),
                               "convert-gguf", str(converter), str(checkpoint), str(out / F32_GGUF)],
                              env={"PYTHONPATH": str(gguf_py)}, max_rss=max_rss)


def prepare(model: str, runners: list[str], work: Path, max_rss: int, rebuild: bool) -> tuple[dict, dict, dict]:
    """({contender: {"path", "draft"}}, {model/source: build}, {contender: why skipped}) for a model's contenders,
    each built once (peers.build_once), the draft model's builds too where a contender drafts with it."""
    built: dict = {}
    failed: dict = {}

    def path(of: str, source: str) -> Path | None:
        if (of, source) not in built and (of, source) not in failed:
            out, build = builds_of(of, work, max_rss)[source]
            (work / of).mkdir(parents=True, exist_ok=True)
            try:
                built[of, source] = (out, peers.build_once(of, source, out, build, rebuild))
            except peers.Failed as e:
                failed[of, source] = str(e)
        return built[of, source][0] if (of, source) in built else None

    contenders, skipped = {}, {}
    draft = draft_model(model)
    for runner in runners:
        main = path(model, runner)
        for method in RUNNERS[runner]:
            name = f"{runner}/{method}"
            if main is None:
                skipped[name] = failed[model, runner]
            elif method == "mtp" and model not in MTP_MODELS:
                continue  # no MTP layer to draft with: not a contender
            elif method == "draft":
                draft_path = path(draft, runner)
                if draft_path is None:
                    skipped[name] = f"the draft model {draft} did not build: {failed[draft, runner]}"
                else:
                    contenders[name] = {"path": str(main), "draft": str(draft_path), "draft_model": draft}
            else:
                contenders[name] = {"path": str(main)}
    return contenders, {f"{of}/{source}": b for (of, source), (_, b) in built.items()}, skipped


# ---------------------------------------------------------------------------------------------------------------
# Running: one child process per measurement (``--worker SPEC_JSON``), printing one JSON line.
# A runner's opener returns generate(prompt, new) -> (tokens, counts): counts has "forwards" (main-model forwards,
# the prefill's included), "proposed" and "accepted" (draft tokens), each where the runner exposes it.

def _dstc(spec: dict):
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.generate import greedy_generate
    from toolchain.runtime.speculative import Acceptance, open_speculation
    from toolchain.settings.speculation import DRAFT_PREFIX, SpeculationSettings

    method, threads = spec["method"], spec["threads"]
    speculate = {"plain": None, "draft": DRAFT_PREFIX + spec.get("draft", "")}.get(method, method)
    art = open_artifact(Path(spec["path"]))
    speculation = open_speculation(SpeculationSettings(speculate=speculate, draft_tokens=spec["draft_tokens"]), art,
                                   threads=threads)
    decoder = open_decoder(art, threads=threads, extra_outputs=speculation.main_outputs if speculation else ())

    def generate(prompt, new):
        if speculation is None:
            tokens = greedy_generate(decoder, [prompt], new, set(), 0, ignore_stop=True).tokens[0]
            return tokens, {"forwards": len(tokens)}
        speculation.acceptance = Acceptance()
        tokens = [t for step in speculation.steps(decoder, prompt, max_new_tokens=new, stop_ids=set()) for t in step]
        counted = speculation.acceptance
        return tokens, {"forwards": 1 + counted.steps, "proposed": sum(counted.proposed),
                        "accepted": sum(counted.accepted)}
    return generate


def _ovgenai(spec: dict):
    import openvino as ov
    import openvino_genai as ov_genai

    method, threads, path = spec["method"], spec["threads"], spec["path"]
    speculative = method not in ("plain", "plain-paged")
    if method == "plain":  # peers.py's pipeline: stateful, no prefix cache
        pipe = ov_genai.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads, ATTENTION_BACKEND="SDPA")
    else:  # speculation runs on the paged backend only: its prefix cache off, the prompts measured anew
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        extra: dict = {}
        if method == "prompt-lookup":
            extra["prompt_lookup"] = True
        elif method == "draft":
            extra["draft_model"] = ov_genai.draft_model(spec["draft"], "CPU", INFERENCE_NUM_THREADS=threads)
        pipe = ov_genai.LLMPipeline(path, "CPU", scheduler_config=scheduler, INFERENCE_NUM_THREADS=threads, **extra)

    def generate(prompt, new):
        config = ov_genai.GenerationConfig()
        # no min_new_tokens: it keeps the end of sequence from being made, where the other runners make and ignore it
        config.max_new_tokens, config.ignore_eos, config.do_sample = new, True, False
        if speculative:
            config.num_assistant_tokens = spec["draft_tokens"]
        if method == "prompt-lookup":
            config.max_ngram_size = MAX_NGRAM
        ids = np.array([prompt], np.int64)
        result = pipe.generate(ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), config)
        tokens = [int(t) for t in result.tokens[0]]
        counts: dict = {} if speculative else {"forwards": len(tokens)}
        metrics = result.extended_perf_metrics
        if hasattr(metrics, "get_num_accepted_tokens"):  # the speculative pipelines' (SDPerModelsPerfMetrics)
            counts = {"forwards": len(metrics.main_model_metrics.raw_metrics.m_durations),
                      "proposed": metrics.get_num_draft_tokens(), "accepted": metrics.get_num_accepted_tokens()}
        return tokens, counts
    return generate


def _llamacpp(spec: dict):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    new, k = spec["new_tokens"], spec["draft_tokens"]
    n_ctx = max(map(len, spec["prompts"] + [spec["warmup"]])) + new + k + 8
    draft = LlamaPromptLookupDecoding(max_ngram_size=MAX_NGRAM, num_pred_tokens=k) \
        if spec["method"] == "prompt-lookup" else None
    llm = peers.llama(Path(spec["path"]) / F32_GGUF, spec["threads"], n_ctx, draft_model=draft)
    evals = [0]
    evaluate = llm.eval

    def counted_eval(tokens):  # one call per forward of the main model: the prompt, then each (verify) step
        evals[0] += 1
        return evaluate(tokens)
    llm.eval = counted_eval

    def generate(prompt, new):
        llm.reset()
        evals[0] = 0
        tokens = []
        # Llama.generate samples greedily at temp 0 and stops only where its caller does: end of sequence ignored
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if len(tokens) == new:
                break
        return tokens, {"forwards": evals[0]}
    return generate


def _ortgenai(spec: dict):
    import onnxruntime_genai as og

    # onnxruntime-genai drafts nothing while a minimum length is pending (min_length is how peers.py ignores the
    # end of sequence): its end-of-sequence id is set to the padding id instead, which the model never makes
    pad = json.loads((Path(spec["path"]) / "genai_config.json").read_text())["model"]["pad_token_id"]
    model = peers.ortgenai_model(Path(spec["path"]), spec["threads"], {"model": {"eos_token_id": pad}})
    method = spec["method"]

    def generate(prompt, new):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new, do_sample=False, batch_size=1)
        if method == "prompt-lookup":
            params.set_speculative_options(max_draft_tokens=spec["draft_tokens"], ngram_size=MAX_NGRAM)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([prompt], np.int32))
        forwards = 0
        while not generator.is_done():
            generator.generate_next_token()
            forwards += 1
        tokens = [int(t) for t in generator.get_sequence(0)[len(prompt):]]
        counts = {"forwards": forwards}
        if method == "prompt-lookup":
            stats = generator.get_speculative_stats()
            # a call of generate_next_token is a verify round or a plain step (a "standard fallback" where the
            # n-gram lookup found nothing); drafts it looked up but did not verify are not counted as proposed
            counts = {"forwards": int(stats["target_forward_passes"]) + int(stats["standard_fallback_steps"]),
                      "proposed": int(stats["draft_tokens_evaluated"]),
                      "accepted": int(stats["draft_tokens_accepted"])}
        return tokens, counts
    return generate


OPENERS = {"dstc-ort": _dstc, "dstc-ov": _dstc, "optimum-ov-genai": _ovgenai, "llamacpp-f32": _llamacpp,
           "ortgenai-builder": _ortgenai}


def worker(spec: dict) -> dict:
    """One measurement: load, warm up, then ``passes`` timed passes over the prompts; the fastest pass's seconds
    per prompt (the others' work on a shared machine only slows a pass down), the first pass's tokens and counts,
    and every pass's total seconds."""
    started = time.perf_counter()
    generate = OPENERS[spec["runner"]](spec)
    load_s = time.perf_counter() - started
    # every prompt once before the timed runs: a runtime's first run of a prompt length builds its kernels for that
    # shape (seconds on OpenVINO); no contender caches a prompt from one run to the next (peers.py)
    for prompt in [spec["warmup"], *spec["prompts"]]:
        generate(prompt, spec["new_tokens"])
    out: dict = {"load_s": load_s, "tokens": [], "counts": []}
    passes = []
    for _ in range(spec["passes"]):
        seconds = []
        for prompt in spec["prompts"]:
            started = time.perf_counter()
            tokens, counts = generate(prompt, spec["new_tokens"])
            seconds.append(time.perf_counter() - started)
            if not passes:
                out["tokens"].append(tokens)
                out["counts"].append(counts)
        passes.append(seconds)
    out["seconds"] = min(passes, key=sum)
    out["pass_seconds"] = [sum(p) for p in passes]
    return out


def measure(contender: str, entry: dict, workload: dict, spec_dir: Path) -> dict:
    runner, method = contender.split("/")
    spec = spec_dir / f"{contender.replace('/', '-')}.json"
    spec.write_text(json.dumps({"runner": runner, "method": method, **entry, **workload}))
    return peers.child_json([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)])


# ---------------------------------------------------------------------------------------------------------------
# The table.

def _sum(counts: list[dict], key: str) -> int | None:
    return sum(c[key] for c in counts) if all(key in c for c in counts) else None


def rows_for(samples: dict[str, list[dict]]) -> list[dict]:
    """One row per contender RUNNER/METHOD: the median tokens/s over its samples (each sample: all its tokens over
    all its seconds), the speed-up over RUNNER/plain's, the ratio to the best peer's plain tokens/s, tokens per
    main-model forward and the draft acceptance (over all samples, where counted), the mean tokens made per prompt,
    and the greedy-match rate against RUNNER/plain's tokens (each sample's prompts against plain's first sample)."""
    rows = []
    for contender, runs in samples.items():
        counts = [c for run in runs for c in run["counts"]]
        made = sum(len(t) for run in runs for t in run["tokens"])
        forwards, proposed, accepted = (_sum(counts, k) for k in ("forwards", "proposed", "accepted"))
        rates = [sum(map(len, r["tokens"])) / sum(r["seconds"]) for r in runs]
        rows.append({"contender": contender, "runs": len(runs), "tokens_per_s": statistics.median(rates),
                     "tokens_per_s_best": max(rates),
                     "tokens_per_prompt": made / len(counts),
                     "tokens_per_forward": made / forwards if forwards else None,
                     "acceptance": accepted / proposed if proposed else None})
    by_name = {r["contender"]: r for r in rows}
    plain_peers = [r["tokens_per_s"] for r in rows
                   if peers.is_peer(r["contender"]) and r["contender"].endswith("/plain")]
    best_peer = max(plain_peers) if plain_peers else None
    for row in rows:
        runner = row["contender"].split("/")[0]
        plain = by_name.get(f"{runner}/plain")
        row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain else None
        row["to_best_peer_plain"] = row["tokens_per_s"] / best_peer if best_peer else None
        row["greedy_match"] = None
        if plain:
            reference = samples[f"{runner}/plain"][0]["tokens"]
            matches = [common_prefix(t, p) / len(p) for run in samples[row["contender"]]
                       for t, p in zip(run["tokens"], reference) if p]
            row["greedy_match"] = statistics.mean(matches) if matches else None
    return rows


HEADER = ("contender", "tokens/s", "best round", "speed-up vs own plain", "vs best peer plain", "tokens/forward",
          "acceptance", "greedy match", "tokens/prompt", "runs", "note")


def table(rows: list[dict], skipped: dict[str, str]) -> str:
    """harness.markdown_table of ``rows_for`` rows, then a row per skipped contender with its reason."""
    cells = [[r["contender"], r["tokens_per_s"], r["tokens_per_s_best"], r["speedup"], r["to_best_peer_plain"],
              r["tokens_per_forward"], r["acceptance"], r["greedy_match"], r["tokens_per_prompt"], r["runs"], ""]
             for r in rows]
    cells += [[name, *[None] * (len(HEADER) - 2), f"skipped: {why}"] for name, why in skipped.items()]
    return harness.markdown_table(HEADER, cells)


# ---------------------------------------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> None:
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker.read_text()))))
        return
    runners = peers.chosen(args.runners, RUNNERS, "runners")
    cpu = describe_cpu()
    results: dict = {"machine": {"cpu": cpu}, "versions": peers.versions(),
                     "settings": {k: str(v) for k, v in vars(args).items() if k != "worker"}, "models": {}}
    args.work.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for model in args.models.split(","):
        contenders, builds, skipped = prepare(model, runners, args.work, int(args.max_build_gib * peers.GiB),
                                              args.rebuild)
        # every contender gets the same token ids, the checkpoint's tokenizer's: one more prompt warms up
        ids = prompts(load_tokenizer(embedded_path(model)), args.prompts + 1, args.shots)
        workload = {"prompts": ids[1:], "warmup": ids[0], "new_tokens": args.tokens,
                    "draft_tokens": args.draft_tokens, "threads": args.threads, "passes": args.passes}
        prepared[model] = contenders, builds, skipped, workload
    print(cpu_line(cpu), flush=True)
    with harness.one_at_a_time(args.lock):
        for model, (contenders, builds, skipped, workload) in prepared.items():
            print(f"[{model}] timing {', '.join(contenders)}", flush=True)
            samples: dict = {c: [] for c in contenders}
            for round_, contender in harness.alternation(list(contenders), args.rounds):
                if contender in skipped:
                    continue
                load = os.getloadavg()[0]
                try:
                    sample = measure(contender, contenders[contender], workload, args.work / model)
                    samples[contender].append({**sample, "load_before": load})
                    rate = sum(map(len, sample["tokens"])) / sum(sample["seconds"])
                    print(f"  round {round_ + 1}: {contender:<30} {rate:8.1f} tokens/s (load {load:.1f})",
                          flush=True)
                except (peers.Failed, subprocess.TimeoutExpired) as e:
                    skipped[contender] = f"failed while timed: {e}"
                    print(f"  round {round_ + 1}: {contender:<30} {skipped[contender]}", flush=True)
            samples = {c: s for c, s in samples.items() if s and c not in skipped}
            rows = rows_for(samples)
            results["models"][model] = {"builds": builds, "contenders": contenders, "rows": rows,
                                        "skipped": skipped, "samples": samples,
                                        "prompt_tokens": [len(p) for p in workload["prompts"]]}
    for model, result in results["models"].items():
        lengths = result["prompt_tokens"]
        print(f"\n{model}: {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens ({args.shots}-shot held-out "
              f"arithmetic), {args.tokens} new tokens each, greedy, batch 1, {args.draft_tokens} draft tokens per "
              f"step; medians of {args.rounds} alternated rounds; {cpu_line(cpu)}, {args.threads} threads")
        print(table(result["rows"], result["skipped"]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="embedded models, comma-separated")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--shots", type=int, default=3, help="solved problems before the one to solve")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=3,
                        help="timed passes over the prompts per measurement: the fastest is its figure")
    parser.add_argument("--threads", type=int, default=2)
    peers.add_build_arguments(parser, Path("/work/peers-work/speculative"))
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
