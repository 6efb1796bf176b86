"""Latency of greedy decoding on a built artifact, measured in a fresh process so that its memory is the
runtime's own.

The child process imports the runtime and the tokenizer, notes its peak RSS (the baseline), opens the decoder
(``load_s``), then runs each (prompt length, batch) case ``warmup`` times unmeasured, then ``repetitions`` rounds
of one measured run of every case, each a ``greedy_generate(..., ignore_stop=True)`` of exactly ``new_tokens``
tokens; the parent starts each round, so that `dstc compare` alternates its artifacts' rounds, and logs the line
the child prints per case and run:

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
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from toolchain.errors import InputError
from toolchain.evaluate.spread import median_interval
from toolchain.models.corpus import text_samples
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.generate import greedy_generate
from toolchain.runtime.speculative import Acceptance, open_speculation
from toolchain.settings.speculation import SpeculationSettings

# the child's stdout: a line to log, and the end of a step (loading and warm-up, a round, the result)
PROGRESS, DONE = "progress: ", "done"


class _LatencyProcess:
    """One artifact's latency child: it loads the artifact and runs the warm-ups, then one measured repetition of
    every case per ``round()``, and the speculative cases and its result at ``finish()``. Commands go on its stdin;
    its stdout carries progress lines (``log``) and the marker that a step is done."""

    def __init__(self, settings: dict, log: Callable[[str], None]) -> None:
        self.log = log
        self._tmp = tempfile.TemporaryDirectory(prefix="dstc-latency-")
        self.out = Path(self._tmp.name) / "result.json"
        # a file, not a pipe: a child that writes much to stderr never blocks on a pipe nobody reads until it ends
        self._stderr = open(Path(self._tmp.name) / "stderr", "w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(settings), str(self.out)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     bufsize=1)
        self._until(DONE)  # loaded and warmed up

    def _until(self, marker: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line == marker:
                return
            if line.startswith(PROGRESS):
                self.log(line.removeprefix(PROGRESS))
        self._failed()

    def _failed(self) -> None:
        """The child stopped early: its error, raised here as it was there (an InputError as one)."""
        code = self.proc.wait()
        result = json.loads(self.out.read_text()) if self.out.is_file() else None
        self._stderr.seek(0)
        stderr = self._stderr.read()
        self.close()
        if result is None or "error" not in result:
            raise RuntimeError(f"the latency process exited with code {code} without a result:\n{stderr[-4000:]}")
        error = result["error"]
        if error["input_error"]:
            raise InputError(error["message"])
        raise RuntimeError(f"the latency process failed:\n{error['traceback']}")

    def _send(self, command: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self._failed()

    def round(self) -> None:
        self._send("round")
        self._until(DONE)

    def finish(self) -> dict:
        self._send("finish")
        self._until(DONE)
        self.proc.wait()
        result = json.loads(self.out.read_text())
        self.close()
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            if stream is not None:
                stream.close()
        self._tmp.cleanup()


def latency_settings(artifact_path: Path | str, *, prompt_lengths: tuple[int, ...] = (32, 128, 512),
                     batches: tuple[int, ...] = (1, 4), new_tokens: int = 32, warmup: int = 2, repetitions: int = 5,
                     threads: int | None = None, openvino_f32: bool = False, speculate: str | None = None,
                     draft_tokens: int = 4) -> dict:
    """The child's settings, checked (an InputError when they measure nothing)."""
    if new_tokens < 2 or repetitions < 1 or warmup < 0 or min(prompt_lengths, default=0) < 1 \
            or min(batches, default=0) < 1:
        raise InputError("latency needs new_tokens >= 2, repetitions >= 1, warmup >= 0 and at least one prompt "
                         "length and batch, each >= 1")
    return {"artifact": str(artifact_path), "prompt_lengths": list(prompt_lengths), "batches": list(batches),
            "new_tokens": new_tokens, "warmup": warmup, "repetitions": repetitions, "threads": threads,
            "openvino_f32": openvino_f32, "speculate": speculate, "draft_tokens": draft_tokens}


def measure_latency(artifact_path: Path | str, log: Callable[[str], None] = lambda _: None, **settings) -> dict:
    """Run the measurement in a child process and return its results (``settings``: latency_settings'), with a
    progress line per case and repetition. An InputError in the child (not an artifact, bad settings) is raised
    as one here; any other failure as a RuntimeError with the child's traceback."""
    return measure_latency_interleaved([latency_settings(artifact_path, **settings)], lambda _i, m: log(m))[0]


def measure_latency_interleaved(settings: list[dict], log: Callable[[int, str], None]) -> list[dict]:
    """Several artifacts' latency in rounds, A, B, A, B...: each round is one measured repetition of every case of
    each artifact in turn, so that a change of the machine's load during the run falls on all of them alike rather
    than on whichever ran then. Their children are all loaded at once (the caller checks that they fit); only one
    runs at a time. ``log(index, message)``."""
    processes: list[_LatencyProcess] = []
    try:
        for i, one in enumerate(settings):
            processes.append(_LatencyProcess(one, partial(log, i)))
        for _ in range(settings[0]["repetitions"]):
            for process in processes:
                process.round()
        return [process.finish() for process in processes]
    finally:
        for process in processes:
            process.close()


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


def _case_line(length: int, batch: int) -> str:
    return f"{length}×{batch}"


def _measure(settings: dict, commands: Iterator[str]) -> dict:
    """Load, warm up every case, then one measured repetition of every case per "round" read from ``commands``,
    until "finish"."""
    artifact = open_artifact(settings["artifact"])
    tokenizer = artifact.tokenizer()
    __import__("openvino" if artifact.backend == "openvino" else "onnxruntime")
    baseline = _peak_rss_mb()
    decoder = open_decoder(artifact, threads=settings["threads"], openvino_f32=settings.get("openvino_f32", False))
    new_tokens, repetitions = settings["new_tokens"], settings["repetitions"]
    _progress(f"loaded in {decoder.load_seconds:.2f} s ({decoder.threads} threads)")
    context = artifact.config.get("max_position_embeddings")
    skipped, prompts = [], {}
    for length in settings["prompt_lengths"]:
        if context is not None and length + new_tokens > context:
            skipped.append({"prompt_length": length, "new_tokens": new_tokens, "max_position_embeddings": context})
            _progress(f"prompt length {length} skipped: with {new_tokens} new tokens it passes the model's context "
                      f"({context})")
            continue
        for batch in settings["batches"]:
            prompts[length, batch] = _prompts(tokenizer, length, batch)
    runs: dict[tuple[int, int], list] = {case: [] for case in prompts}
    for shape, rows in prompts.items():
        started = time.perf_counter()
        for _ in range(settings["warmup"]):
            greedy_generate(decoder, rows, new_tokens, set(), artifact.pad_token_id, ignore_stop=True)
        warmup = settings["warmup"]
        _progress(f"{_case_line(*shape)} warm-up: {warmup} run{'' if warmup == 1 else 's'} in "
                  f"{time.perf_counter() - started:.1f} s")
    _done()
    for repetition in range(1, repetitions + 1):
        if next(commands) != "round":
            raise RuntimeError("the latency process was told to finish before its last round")
        for shape, rows in prompts.items():
            run = greedy_generate(decoder, rows, new_tokens, set(), artifact.pad_token_id, ignore_stop=True)
            runs[shape].append(run)
            _progress(f"{_case_line(*shape)} run {repetition}/{repetitions}: TTFT {run.ttft_s * 1e3:.1f} ms, ITL "
                      f"{statistics.median(run.itl_s) * 1e3:.2f} ms")
        _done()
    if next(commands) != "finish":
        raise RuntimeError("the latency process was told to run more rounds than its repetitions")
    cases = []
    for (length, batch), measured in runs.items():
        ttft, itl = [run.ttft_s * 1e3 for run in measured], [t * 1e3 for run in measured for t in run.itl_s]
        cases.append({
            "prompt_length": length, "batch": batch, "new_tokens": new_tokens, "warmup": settings["warmup"],
            "repetitions": repetitions, "ttft_ms": ttft, "itl_ms": itl,
            "tokens_per_s": statistics.median(batch * (new_tokens - 1) / sum(run.itl_s) for run in measured),
            "ttft_p50_ms": statistics.median(ttft), "ttft_p50_interval_ms": median_interval(ttft),
            "itl_p50_ms": statistics.median(itl),
            "itl_p50_interval_ms": median_interval([statistics.median(run.itl_s) * 1e3 for run in measured]),
        })
    peak = _peak_rss_mb()
    if settings.get("speculate"):
        speculation = SpeculationSettings(speculate=settings["speculate"], draft_tokens=settings["draft_tokens"])
        for case in cases:
            if case["batch"] == 1:
                key = case["prompt_length"], 1
                _progress(f"{_case_line(*key)} speculative ({speculation.speculate})")
                case["speculative"] = _speculative_case(artifact, decoder, speculation, prompts[key][0],
                                                        runs[key][0].tokens[0], settings, case["tokens_per_s"])
    return {"artifact": str(artifact.path), "backend": artifact.backend, "load_s": decoder.load_seconds,
            "peak_rss_mb": peak, "rss_increase_mb": peak - baseline, "threads": decoder.threads,
            "runtime_config": decoder.runtime_config, "cases": cases, "skipped": skipped}


def _progress(message: str) -> None:
    print(PROGRESS + message, flush=True)


def _done() -> None:
    print(DONE, flush=True)


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
    commands = (line.strip() for line in sys.stdin)
    try:
        result = _measure(json.loads(settings_json), commands)
        code = 0
    except Exception as e:  # everything goes back to the parent, which raises it there
        result = {"error": {"input_error": isinstance(e, InputError), "message": str(e),
                            "traceback": traceback.format_exc()}}
        code = 1
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    if code == 0:
        _done()
    return code


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:]))
