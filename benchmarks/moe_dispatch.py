"""MoE lowering cost: dstc's sparse expert dispatch on ONNX Runtime vs PyTorch eager on the same checkpoint.

A shape-faithful model (real widths, few layers, random weights) is exported with `dstc export`, then decode
latency after a short prompt and prefill latency of a long prompt are measured in one run for:
PyTorch fp32 with transformers' experts implementations (eager: loop over hit experts; grouped_mm: default)
and ONNX Runtime running the exported graph. Times are medians; compare them as ratios within one run.

    .venv/bin/python benchmarks/moe_dispatch.py --reference deepseek-v2-lite --layers 4
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from toolchain.models.shape_faithful import make_shape_faithful
from toolchain.runtime.engines import ort_options, ort_session
from toolchain.stages.alone import export

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the benchmarks' harness is imported from the repository
from benchmarks import harness  # noqa: E402


def torch_times(path: Path, impl: str, prompt: np.ndarray, long_prompt: np.ndarray, steps: int, repeats: int):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation=impl).eval()

    def decode():
        cache = DynamicCache(config=model.config)
        ids = torch.from_numpy(prompt)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        return (time.perf_counter() - t0) * 1e3 / steps

    def prefill():
        with torch.no_grad():
            model(input_ids=torch.from_numpy(long_prompt), use_cache=False)

    decode()
    result = statistics.median(decode() for _ in range(repeats)), harness.median_ms(prefill, repeats)
    del model
    gc.collect()
    return result


def ort_times(onnx_path: Path, past: dict, prompt: np.ndarray, long_prompt: np.ndarray, steps: int, repeats: int):
    session = ort_session(onnx_path, ort_options(threads=torch.get_num_threads()))
    names = [o.name for o in session.get_outputs()]

    def run(ids, cache):
        total = ids.shape[1] + (next(iter(cache.values())).shape[2] if cache else 0)
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64),
                 "position_ids": np.arange(total - ids.shape[1], total, dtype=np.int64)[None]}
        for name, (heads, dim) in past.items():
            feeds[name] = cache.get(name, np.zeros((1, heads, 0, dim), np.float32))
        out = dict(zip(names, session.run(names, feeds)))
        return out["logits"], {n: out[n.replace("past_key_values.", "present.")] for n in past}

    def decode():
        logits, cache = run(prompt, {})
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = run(logits[:, -1:].argmax(-1), cache)
        return (time.perf_counter() - t0) * 1e3 / steps

    decode()
    return statistics.median(decode() for _ in range(repeats)), harness.median_ms(lambda: run(long_prompt, {}), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default="deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and export here")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-bench-"))
    ckpt, out = work / "checkpoint", work / "export"
    if not ckpt.exists():
        make_shape_faithful(args.reference, ckpt, num_layers=args.layers, num_experts=args.experts)
    if (out / "export.json").is_file():
        report = json.loads((out / "export.json").read_text())
    else:
        report = export(str(ckpt), out, parity=("onnxruntime",), new_tokens=4)
    gc.collect()  # the export's PyTorch model: a second full copy would not fit beside the next one
    config = json.loads((ckpt / "config.json").read_text())
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config["vocab_size"], (1, args.prompt))
    long_prompt = rng.integers(0, config["vocab_size"], (1, args.prefill))
    heads = config["num_attention_heads"]
    key_dim = config.get("qk_nope_head_dim", 0) + config.get("qk_rope_head_dim", 0)
    past = {n: (heads, key_dim if n.endswith(".key") else config["v_head_dim"])
            for n in report["graph"]["inputs"] if n.startswith("past_key_values.")}
    rows = {}
    for impl in ("eager", "grouped_mm"):
        rows[f"pytorch fp32, experts={impl}"] = torch_times(ckpt, impl, prompt, long_prompt, args.steps, args.repeats)
    rows["onnxruntime fp32, dstc sparse dispatch"] = ort_times(out / "model.onnx", past, prompt, long_prompt,
                                                              args.steps, args.repeats)
    base = rows["pytorch fp32, experts=eager"]
    print(f"{args.reference}, {args.layers} layers, {torch.get_num_threads()} threads, parity (ORT) "
          f"{report['parity']['onnxruntime']['max_relative_diff']:.1e}, {report['graph']['nodes']} nodes")
    print(f"{'':44} {'decode ms/token':>16} {'prefill ' + str(args.prefill) + ' ms':>16} {'ratio vs eager':>16}")
    for name, (dec, pre) in rows.items():
        print(f"{name:44} {dec:16.1f} {pre:16.1f} {dec / base[0]:8.2f} / {pre / base[1]:5.2f}")


if __name__ == "__main__":
    main()
