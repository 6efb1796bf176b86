"""Smoke inference of a compiled artifact at its runtime's deployment defaults, in a child process.

The compile stage's verification runs OpenVINO at exact numerics (``engines.NUMERICS``), to compare numbers with
PyTorch; users run the CPU plugin's defaults (bf16 compute where the CPU has bf16 instructions, the plugin's own
thread count) with the settings the artifact records (an f16 KV cache, toolchain/compile/openvino_ir.py), which take
other kernels. Those crashed: on a 3-head, hidden-96 DeepSeek-V2 the
2026.4 CPU plugin segfaulted at bf16 for prompts of 1 to 16 tokens, and an f32-only check shipped that artifact
as verified. So the stage also runs the artifact as deployed, through dstc's runtime decoders
(``toolchain.runtime.decoder``: OpenVINO's stateful request with no properties set, ONNX Runtime's session with
its defaults and IO binding), one request for all: a prefill of a left-padded batch of two and of each of
``PROMPT_LENGTHS`` at batch 1, each followed by ``DECODE_STEPS`` greedy steps, every logit finite. A crash kills
the process it happens in, so this runs in a fresh child (``python -m toolchain.verify.smoke``, not a fork of a
process that has loaded torch and the runtimes); the parent reads which step the child had started from its
progress lines and raises :class:`RuntimeCrashError` naming the signal and the prompt. ONNX Runtime runs fp32
with the kernels the verification runs too, so there it mostly guards the parent (the in-process verification
comes after it); it costs a process start and 25 small steps, so both backends get it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from toolchain.errors import RuntimeCrashError
from toolchain.interface.files import CONFIG, GENERATION_CONFIG
from toolchain.interface.reports import read_json
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.generate import greedy_loop

PROMPT_LENGTHS = (1, 2, 7, 16)
PADDED_BATCH = (16, 7)  # a batch of two prompts, the shorter left-padded to the longer
PAD_ID = 0  # any id: padded positions are masked
DECODE_STEPS = 4
TIMEOUT_S = 3600  # a hang; compiling and 25 steps of a 671B model take minutes, not an hour
PROGRESS = "dstc-smoke "  # prefix of the child's progress lines on stdout (a runtime may print there too)
# Test hook: "SIGSEGV@7" makes the child send itself that signal as it starts the prefill of a 7-token prompt,
# to test this mechanism on a CPU where the runtime does not crash by itself.
RAISE_ENV = "DSTC_SMOKE_RAISE"


def cases() -> list[dict]:
    """The left-padded batch first. OpenVINO 2026.4's CPU plugin with its u8 KV cache returns NaN logits in 10 to
    60 % of runs when a request that ran batch 1 runs batch 2 after reset_state, for every model tried (Qwen2,
    Llama, DeepSeek; never with an f32 cache, never when the batch shrinks or stays): a runtime bug no artifact
    can avoid, which would fail builds at random. What this check is for, the artifact's own kernels, it finds
    in either order."""
    return [{"batch": len(PADDED_BATCH), "prompt_lengths": list(PADDED_BATCH)}] + \
        [{"batch": 1, "prompt_lengths": [n]} for n in PROMPT_LENGTHS]


def describe(event: dict) -> str:
    """'the prefill of a 7-token prompt (batch 1)', 'decode step 2 after a 16-token prompt (batch 1)'."""
    lengths = event["prompt_lengths"]
    prompt = f"a {lengths[0]}-token prompt" if len(lengths) == 1 else \
        f"prompts of {' and '.join(map(str, lengths))} tokens, left-padded"
    where = "the prefill of" if event["phase"] == "prefill" else f"decode step {event['step']} after"
    return f"{where} {prompt} (batch {event['batch']})"


def run_smoke(artifact_dir: Path, backend: str, log=lambda _: None) -> dict:
    """Run the child on ``artifact_dir``; its report, or RuntimeCrashError naming the signal (or error) and the
    step it happened in."""
    log(f"smoke inference of the {backend} artifact at the runtime's deployment defaults, in a child process")
    command = [sys.executable, "-m", __name__, backend, str(artifact_dir)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stderr, code = _text(e.stdout), _text(e.stderr), None
    events = [json.loads(line[len(PROGRESS):]) for line in stdout.splitlines() if line.startswith(PROGRESS)]
    started_steps = [e for e in events if "phase" in e]
    where = describe(started_steps[-1]) if started_steps else "loading the model"
    prefix = f"the {backend} artifact at the runtime's deployment defaults"
    if code is None:
        raise RuntimeCrashError(f"{prefix} hung: no result after {TIMEOUT_S} s, in {where}")
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        raise RuntimeCrashError(f"{prefix} crashed with {name} in {where} (smoke inference in a child process; "
                                f"the f32 verification does not run these kernels)", signal=name, where=where)
    result = next((e for e in reversed(events) if "result" in e), None)
    if code != 0 or result is None:
        error = next((e["error"] for e in reversed(events) if "error" in e), None)
        last = error or (stderr.strip().splitlines() or [f"exit code {code}"])[-1]
        raise RuntimeCrashError(f"{prefix} failed in {where}: {last}", where=where)
    return {"passed": True, **result["result"], "seconds": round(time.perf_counter() - started, 3)}


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _report(event: dict) -> None:
    print(PROGRESS + json.dumps(event), flush=True)  # flushed: the next call may be the one that crashes


def _raise_requested(length: int) -> None:
    name, _, at = os.environ.get(RAISE_ENV, "").partition("@")
    if name and at == str(length):
        os.kill(os.getpid(), getattr(signal, name))


def _child(backend: str, path: str) -> int:
    # Artifact by hand: the stage has not written compile.json yet, which open_artifact requires.
    generation = Path(path) / GENERATION_CONFIG
    artifact = Artifact(Path(path), backend, None, read_json(Path(path) / CONFIG),
                        read_json(generation) if generation.is_file() else {})
    try:
        decoder = open_decoder(artifact)  # no threads, no f32: the runtime's defaults
        vocab = int(artifact.config["vocab_size"])
        done = []
        for case in cases():
            lengths = case["prompt_lengths"]
            prompts = [[int(t) for t in (np.arange(n) * 7 + 3 + 11 * row) % vocab]  # distinct tokens per row
                       for row, n in enumerate(lengths)]
            # the one greedy loop, stepped by hand: each step is announced before it runs, so that a crash names it
            steps = greedy_loop(decoder, prompts, set(), PAD_ID, ignore_stop=True, all_prefill_logits=True)
            _report({**case, "phase": "prefill"})
            _raise_requested(max(lengths))
            _finite(next(steps)[1], case, "prefill")
            for step in range(1, DECODE_STEPS + 1):
                _report({**case, "phase": "decode", "step": step})
                _finite(next(steps)[1], case, f"decode step {step}")
            done.append({**case, "decode_steps": DECODE_STEPS})
    except Exception as e:  # reported to the parent, which raises it as one line
        _report({"error": f"{type(e).__name__}: {e}"})
        return 1
    _report({"result": {"threads": decoder.threads, "runtime_config": decoder.runtime_config, "cases": done}})
    return 0


def _finite(logits: np.ndarray, case: dict, phase: str) -> None:
    if not np.isfinite(logits).all():
        bad = int((~np.isfinite(logits)).sum())
        raise FloatingPointError(f"{bad} of {logits.size} logits are not finite ({phase}, prompts of "
                                 f"{case['prompt_lengths']} tokens)")


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:]))
