"""Latency of greedy decoding on a built artifact, measured in a fresh process so that its memory is the
runtime's own.

The child process imports the runtime and the tokenizer, notes its peak RSS (the baseline), opens the decoder
(``load_s``), then runs each (prompt length, batch) case ``warmup`` times unmeasured and ``repetitions`` times
measured, each a ``greedy_generate(..., ignore_stop=True)`` of exactly ``new_tokens`` tokens:

- ``ttft_ms``: one per repetition, cache reset + prefill + the first token;
- ``itl_ms``: every later decode step of every repetition (``new_tokens - 1`` per repetition);
- ``ttft_p50_ms`` and ``itl_p50_ms``: their medians (ITL's over the pooled steps), each with the confidence interval
  of the median of one value per repetition (``*_p50_interval_ms``, toolchain/evaluate/spread.py): the TTFT, the
  repetition's median ITL. Per repetition, not per token: a token's ITL is correlated with its neighbours' (a run
  shares its machine's load), so pooled tokens would give an interval far too narrow for the next run;
- ``tokens_per_s``: decode throughput, the median over repetitions of batch * (new_tokens - 1) / the sum of that
  repetition's decode steps (prefill excluded);
- ``peak_rss_mb``: the child's peak resident set (VmHWM on Linux, ru_maxrss elsewhere); ``rss_increase_mb``: that
  minus the peak after imports, i.e. what loading and running the model added.

With ``speculate`` (toolchain/settings/speculation.py), each batch-1 case is then decoded again with
speculative decoding, as many runs, and its ``speculative`` entry has the same ``ttft_ms`` and ``tokens_per_s``
(a verify step's tokens each count for the step's time), their ratio to plain decoding's, the acceptance per draft
position over the measured runs, and ``greedy_match``: the share of the tokens up to the first that differs from
plain decoding's (1 at exact numerics; below where batching k positions in one forward rounds otherwise). The peak
RSS is read before the drafter is opened: it is the artifact's alone.

Prompts are held-out corpus text encoded by the artifact's tokenizer and cut to exactly the prompt length, each
row of a batch a different stretch of it. A case whose prompt length + new_tokens exceeds the model's
max_position_embeddings is skipped and listed under ``skipped``.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from toolchain.errors import InputError
from toolchain.evaluate.spread import median_interval
from toolchain.models.corpus import text_samples
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.generate import greedy_generate
from toolchain.runtime.speculative import Acceptance, open_speculation
from toolchain.settings.speculation import SpeculationSettings


def measure_latency(artifact_path: Path | str, *, prompt_lengths: tuple[int, ...] = (32, 128, 512),
                    batches: tuple[int, ...] = (1, 4), new_tokens: int = 32, warmup: int = 2, repetitions: int = 5,
                    threads: int | None = None, openvino_f32: bool = False, speculate: str | None = None,
                    draft_tokens: int = 4) -> dict:
    """Run the measurement in a child process and return its results. An InputError in the child (not an
    artifact, bad settings) is raised as one here; any other failure as a RuntimeError with the child's
    traceback."""
    if new_tokens < 2 or repetitions < 1 or warmup < 0 or min(prompt_lengths, default=0) < 1 \
            or min(batches, default=0) < 1:
        raise InputError("latency needs new_tokens >= 2, repetitions >= 1, warmup >= 0 and at least one prompt "
                         "length and batch, each >= 1")
    settings = {"artifact": str(artifact_path), "prompt_lengths": list(prompt_lengths), "batches": list(batches),
                "new_tokens": new_tokens, "warmup": warmup, "repetitions": repetitions, "threads": threads,
                "openvino_f32": openvino_f32, "speculate": speculate, "draft_tokens": draft_tokens}
    with tempfile.TemporaryDirectory(prefix="dstc-latency-") as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, "-m", __name__, json.dumps(settings), str(out)],
                              capture_output=True, text=True)
        result = json.loads(out.read_text()) if out.is_file() else None
    if result is None:
        raise RuntimeError(f"the latency process exited with code {proc.returncode} without a result:\n"
                           f"{proc.stderr[-4000:]}")
    if "error" in result:
        error = result["error"]
        if error["input_error"]:
            raise InputError(error["message"])
        raise RuntimeError(f"the latency process failed:\n{error['traceback']}")
    return result


def _peak_rss_mb() -> float:
    """This process's peak resident set. On Linux, VmHWM: ru_maxrss keeps the parent's peak across fork and exec,
    so a large parent (a test run, a report builder) would hide the child's own."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere


def _prompts(tokenizer, length: int, batch: int) -> list[list[int]]:
    """``batch`` rows of exactly ``length`` tokens: consecutive stretches of held-out corpus text."""
    n = 16
    while True:
        stream = tokenizer(" ".join(text_samples("heldout", n)), add_special_tokens=False)["input_ids"]
        if len(stream) >= length * batch:
            return [stream[r * length:(r + 1) * length] for r in range(batch)]
        n *= 2


def _measure(settings: dict) -> dict:
    artifact = open_artifact(settings["artifact"])
    tokenizer = artifact.tokenizer()
    __import__("openvino" if artifact.backend == "openvino" else "onnxruntime")
    baseline = _peak_rss_mb()
    decoder = open_decoder(artifact, threads=settings["threads"], openvino_f32=settings.get("openvino_f32", False))
    new_tokens, repetitions = settings["new_tokens"], settings["repetitions"]
    context = artifact.config.get("max_position_embeddings")
    cases, skipped = [], []
    plain: dict[tuple[int, int], tuple[list[list[int]], list[int]]] = {}  # case -> prompts, first row's tokens
    for length in settings["prompt_lengths"]:
        if context is not None and length + new_tokens > context:
            skipped.append({"prompt_length": length, "new_tokens": new_tokens, "max_position_embeddings": context})
            continue
        for batch in settings["batches"]:
            prompts = _prompts(tokenizer, length, batch)
            runs = [greedy_generate(decoder, prompts, new_tokens, set(), artifact.pad_token_id, ignore_stop=True)
                    for _ in range(settings["warmup"] + repetitions)][settings["warmup"]:]
            plain[length, batch] = prompts, runs[0].tokens[0]
            ttft, itl = [run.ttft_s * 1e3 for run in runs], [t * 1e3 for run in runs for t in run.itl_s]
            cases.append({
                "prompt_length": length, "batch": batch, "new_tokens": new_tokens, "warmup": settings["warmup"],
                "repetitions": repetitions, "ttft_ms": ttft, "itl_ms": itl,
                "tokens_per_s": statistics.median(batch * (new_tokens - 1) / sum(run.itl_s) for run in runs),
                "ttft_p50_ms": statistics.median(ttft), "ttft_p50_interval_ms": median_interval(ttft),
                "itl_p50_ms": statistics.median(itl),
                "itl_p50_interval_ms": median_interval([statistics.median(run.itl_s) * 1e3 for run in runs]),
            })
    peak = _peak_rss_mb()
    if settings.get("speculate"):
        speculation = SpeculationSettings(speculate=settings["speculate"], draft_tokens=settings["draft_tokens"])
        for case in cases:
            if case["batch"] == 1:
                prompts, tokens = plain[case["prompt_length"], 1]
                case["speculative"] = _speculative_case(artifact, decoder, speculation, prompts[0], tokens, settings,
                                                        case["tokens_per_s"])
    return {"artifact": str(artifact.path), "backend": artifact.backend, "load_s": decoder.load_seconds,
            "peak_rss_mb": peak, "rss_increase_mb": peak - baseline, "threads": decoder.threads,
            "runtime_config": decoder.runtime_config, "cases": cases, "skipped": skipped}


def _speculative_case(artifact, decoder, speculation: SpeculationSettings, prompt: list[int], plain: list[int],
                      settings: dict, plain_tokens_per_s: float) -> dict:
    """One batch-1 case decoded speculatively, with warm-up and measured runs as the plain ones; the acceptance
    is the measured runs'."""
    spec = open_speculation(speculation, artifact, threads=settings["threads"],
                            openvino_f32=settings.get("openvino_f32", False))
    assert spec is not None  # speculation.speculate is set
    if spec.main_outputs:  # the drafter reads outputs the plain runs do not ask for (the MTP layer's hidden state)
        decoder = open_decoder(artifact, threads=settings["threads"], extra_outputs=spec.main_outputs,
                               openvino_f32=settings.get("openvino_f32", False))
    new_tokens = settings["new_tokens"]
    runs = []  # (seconds to the first token, to the last, the tokens) of each measured run
    for run in range(settings["warmup"] + settings["repetitions"]):
        if run == settings["warmup"]:
            spec.acceptance = Acceptance()
        started = time.perf_counter()
        times, tokens = [], []
        for step in spec.steps(decoder, prompt, max_new_tokens=new_tokens, stop_ids=set()):
            times.append(time.perf_counter() - started)
            tokens += step
        runs.append((times[0], times[-1], tokens))
    runs = runs[settings["warmup"]:]
    match = [next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), len(plain)) / len(plain)
             for _, _, tokens in runs]
    tokens_per_s = statistics.median((new_tokens - 1) / (end - first) for first, end, _ in runs)
    return {"method": speculation.speculate, "draft_tokens": speculation.draft_tokens,
            "ttft_ms": [first * 1e3 for first, _, _ in runs], "tokens_per_s": tokens_per_s,
            "speedup": tokens_per_s / plain_tokens_per_s, "greedy_match": statistics.mean(match),
            **spec.acceptance.summary()}


def _child(settings_json: str, out: str) -> int:
    try:
        result = _measure(json.loads(settings_json))
        code = 0
    except Exception as e:  # everything goes back to the parent, which raises it there
        result = {"error": {"input_error": isinstance(e, InputError), "message": str(e),
                            "traceback": traceback.format_exc()}}
        code = 1
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:]))
