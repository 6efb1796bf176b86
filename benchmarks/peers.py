"""Decode and prefill speed of dstc's artifacts beside its peers, on the same shape-faithful checkpoints, in one run.

Contenders (each skipped, with the reason printed and in the JSON, where it does not install, refuses the model or
cannot describe it):

* ``dstc-ort``: dstc's ONNX Runtime INT4 artifact on dstc's runner (IO binding), as the recipe's defaults build it
  here: with ``compress.prefill_int8`` where this CPU has VNNI or AMX (int8 copies of the 4-bit weights that
  prompts read through DynamicQuantizeMatMul, passes/quantize/prefill_int8.py);
* ``dstc-ort-prefill8``: the same build with ``compress.prefill_int8`` on, on dstc's runner;
* ``dstc-ort-noprefill8``: the same build with it off (4-bit MatMulNBits for prompts too), on dstc's runner;
* ``dstc-ort-genai``: the same artifact on onnxruntime-genai (Qwen2 / Llama only: its config cannot describe MLA);
* ``dstc-ov``: dstc's OpenVINO INT4 artifact on dstc's runner (stateful infer request, deployment defaults);
* ``dstc-ov-genai``: the same artifact on openvino_genai.LLMPipeline;
* ``optimum-ov-genai``: ``optimum-cli export openvino --weight-format int4`` on openvino_genai.LLMPipeline;
* ``ortgenai-builder``: onnxruntime-genai's model builder (``-p int4 -e cpu``) on its own generator;
* ``llamacpp-q4km``: llama.cpp through llama-cpp-python: its GGUF converter (f16), then Q4_K_M. Its repacked (AMX /
  AVX-512) weight buffers are turned off (``use_extra_bufts=False`` on the model parameters: ``Llama()`` drops the
  keyword silently): llama.cpp crashed after repacking a Q6_K tensor for AMX on this kind of machine. The
  converter does not know a shape-faithful checkpoint's stand-in tokenizer by its hash; the model family's
  pre-tokenizer name is written instead (token ids are fed, the pre-tokenizer never runs). The converter is looked
  for beside llama_cpp (``vendor/llama.cpp/convert_hf_to_gguf.py`` of the source tree) or named by
  ``--llamacpp-converter``; gguf comes from that tree's ``gguf-py`` or pip.

Workload: a prompt of ``--prompt`` random token ids, ``--new-tokens`` greedy tokens (end of sequence ignored),
``--threads`` threads. Each contender runs in a child process of its own, started anew for every measurement (so
that no contender's thread pool spins beside another's, one model is in memory at a time, and a crash costs one
figure), warmed up by a short generation after loading; the contenders alternate for ``--rounds`` rounds, in an
order rotated every round, and medians are kept. The warm-up uses another prompt than the timed runs, and
openvino_genai's stateful pipeline is asked for (``ATTENTION_BACKEND="SDPA"``): its default on CPU, the paged
backend, caches prompt prefixes, and a repeated prompt's TTFT then measures little more than one decode step.

Reported per contender: time to first token (prefill + the first token), decode ms/token (median step), tokens/s at
batch 1 and at batch 4 (where the runner batches), the bytes of weights read per generated token (every weight but
the embedding table, of which a token reads one row), the share of the read-bandwidth limit that is (bandwidth
measured here before every measurement: a sum over 512 MB with the same threads, best of 5; the limit takes the
best of these, the least disturbed by the machine's other work; each sample keeps its own and the load average),
the peak RSS of the measuring process (the largest over rounds: the interpreter, the model, its caches and
scratch at this prompt; for long prompts with ``--prompt 4096``), KV-cache bytes per token at the precision the
runtime keeps it in (OpenVINO's u8 cache also keeps small per-group
scales, not counted), and each figure's
ratio to the best peer (non-dstc) contender. On ``qwen-1.5b:4`` the issue's targets are judged on dstc's own runner
(``dstc-ort`` or ``dstc-ort-prefill8``, whichever is better for the figure, and ``dstc-ov``): decode at >= 70 %
of the limit and <= 0.7x the best peer's ms/token on at least one backend, TTFT <= the best peer's on both. The CPU
model and its ISA extensions (toolchain/hardware.py) are printed and written with the JSON.

The timing part holds ``--lock`` (flock, harness.LOCK by default): one benchmark times on the machine at once.
The machine is shared and noisy: read ratios within one run, not figures across runs.

    .venv/bin/python benchmarks/peers.py --widths qwen-1.5b:4 --work /work/peers-work/run --json peers.json

``--widths`` takes NAME[:LAYERS[:EXPERTS]] items: qwen-1.5b, qwen-7b, llama-8b, v2-lite, v3 (R1-Distill-Qwen-1.5B /
7B, R1-Distill-Llama-8B, DeepSeek-V2-Lite, DeepSeek-V3 widths).

Speculative decoding accepts no drafts on random weights: benchmarks/peers_speculative.py times it beside the peers
on the embedded trained models, with this module's builders and child runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import harness, optimum_intel_env  # noqa: E402
from benchmarks.artifact_sizes import active_experts, footprint  # noqa: E402
from toolchain.hardware import cpu_line, describe_cpu  # noqa: E402

DSTC = [sys.executable, "-m", "toolchain"]
WIDTHS = {"qwen-1.5b": "deepseek-r1-distill-qwen-1.5b", "qwen-7b": "deepseek-r1-distill-qwen-7b",
          "llama-8b": "deepseek-r1-distill-llama-8b", "v2-lite": "deepseek-v2-lite", "v3": "deepseek-v3"}
CONTENDERS = ("dstc-ort", "dstc-ort-prefill8", "dstc-ort-noprefill8", "dstc-ort-genai", "dstc-ov", "dstc-ov-genai",
              "optimum-ov-genai", "ortgenai-builder", "llamacpp-q4km")
GiB = 1 << 30
WARMUP_TOKENS = 4


# ---------------------------------------------------------------------------------------------------------------
# Building: dstc and each peer, from the same checkpoint, with wall time and the peak RSS of the process tree.

class Failed(Exception):
    """A build or run that did not work: its one-line reason is reported and the contender skipped."""


def run_measured(cmd: list[str], *, env: dict | None = None, cwd: Path | None = None, max_rss: int) -> dict:
    """Run ``cmd``: its wall time and the peak RSS of its process tree, killed past ``max_rss`` (the machine is
    shared). Failed with the last line of its output when it fails."""
    run = harness.run_measured(cmd, env=env, cwd=cwd, max_rss=max_rss, every=0.1)
    if run.over_budget:
        raise Failed(f"killed above the memory budget of {max_rss / GiB:.1f} GiB (--max-build-gib)")
    if run.returncode != 0:
        raise Failed(f"exit {run.returncode}: {run.last_line()[:200]}")
    return {"wall_s": round(run.wall_s, 1), "peak_rss_gib": round(run.peak_bytes / GiB, 2)}


def build_dstc(checkpoint: Path, backend: str, out: Path, work: Path, max_rss: int, *,
               scheme: str | None = "int4-grouped", mtp: bool = False, **compress) -> dict:
    """dstc's artifact of ``checkpoint`` for ``backend``: compressed with ``scheme`` (None: fp32, no compress
    stage), with the MTP layer where ``mtp``."""
    recipe = work / f"{out.name}.yaml"
    sections = {"passes": {"target": backend}, "compress": {"scheme": scheme, **compress}} if scheme else {}
    recipe.write_text(yaml.safe_dump({"name": f"peers-{out.name}", "model": str(checkpoint),
                                      "export": {"parity": [], **({"mtp": True} if mtp else {})}, **sections,
                                      "compile": {"backend": backend, "verify": False}}))
    return run_measured([*DSTC, "build", str(recipe), "-o", str(out), "--no-cache"], cwd=REPO, max_rss=max_rss,
                        env={"DSTC_CACHE_DIR": str(work / "dstc-cache")})


def build_optimum(checkpoint: Path, out: Path, max_rss: int, weight_format: str = "int4") -> dict:
    cli = optimum_intel_env.OPTIMUM_CLI  # optimum-intel's own environment: it needs transformers<5.6
    if not cli.is_file():
        raise Failed(f"optimum-cli is not installed in {cli.parent.parent} (./install.sh makes it)")
    return run_measured([str(cli), "export", "openvino", "--model", str(checkpoint), "--weight-format", weight_format,
                         "--task", "text-generation-with-past", str(out)], env={"HF_HUB_OFFLINE": "1"},
                        max_rss=max_rss)


def build_ortgenai(checkpoint: Path, out: Path, work: Path, max_rss: int, precision: str = "int4") -> dict:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise Failed("onnxruntime-genai is not installed") from None
    return run_measured([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o",
                         str(out), "-p", precision, "-e", "cpu", "-c", str(work / "builder-cache")],
                        env={"HF_HUB_OFFLINE": "1"}, max_rss=max_rss)


def build_llamacpp(checkpoint: Path, out: Path, max_rss: int) -> dict:
    """GGUF f16 from llama.cpp's own converter (shipped in llama-cpp-python's source as vendor/llama.cpp), then
    Q4_K_M with llama.cpp's quantizer through llama-cpp-python."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        raise Failed(f"{e.name} is not installed (pip install llama-cpp-python gguf sentencepiece)") from None
    converter = llamacpp_converter()
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "model-f16.gguf"
    first = run_measured([sys.executable, str(Path(__file__).resolve()), "--convert-gguf", str(converter),
                          str(checkpoint), str(f16)], max_rss=max_rss)
    second = run_measured([sys.executable, str(Path(__file__).resolve()), "--quantize-gguf", str(f16),
                           str(out / "model-q4_k_m.gguf")], max_rss=max_rss)
    f16.unlink()
    return {"wall_s": first["wall_s"] + second["wall_s"],
            "peak_rss_gib": max(first["peak_rss_gib"], second["peak_rss_gib"])}


def llamacpp_converter() -> Path:
    """convert_hf_to_gguf.py: beside llama_cpp where a source install left it, else from the sdist in pip's cache
    (``--llamacpp-converter`` names it otherwise)."""
    import llama_cpp

    for base in (Path(llama_cpp.__file__).parent, Path(llama_cpp.__file__).parent.parent):
        for candidate in (base / "convert_hf_to_gguf.py", base / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"):
            if candidate.is_file():
                return candidate
    if ARGS is not None and ARGS.llamacpp_converter:  # None: imported by another benchmark
        return ARGS.llamacpp_converter
    raise Failed("llama.cpp's convert_hf_to_gguf.py was not found (--llamacpp-converter PATH: it is in "
                 "llama-cpp-python's source, vendor/llama.cpp/)")


# llama.cpp's name of the pre-tokenizer a model family uses, for a tokenizer its converter does not know by hash
PRE_TOKENIZERS = {"qwen2": "qwen2", "llama": "llama-bpe", "deepseek_v3": "deepseek-v3", "deepseek_v2": "deepseek-llm"}


def convert_gguf(converter: str, checkpoint: str, out: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py to an f16 GGUF. A shape-faithful checkpoint's tokenizer is a stand-in that
    the converter does not recognise by its hash ("BPE pre-tokenizer was not recognized"): the model family's
    pre-tokenizer name is written instead. Timing feeds token ids, so the pre-tokenizer never runs."""
    import runpy

    sys.path.insert(0, str(Path(converter).parent))
    from conversion import base  # llama.cpp's converter package, beside the script

    original = base.TextModel.get_vocab_base_pre
    model_type = json.loads((Path(checkpoint) / "config.json").read_text()).get("model_type", "")

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print(f"unknown tokenizer hash: pre-tokenizer {PRE_TOKENIZERS.get(model_type, 'default')!r} written",
                  file=sys.stderr)
            return PRE_TOKENIZERS.get(model_type, "default")
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [converter, checkpoint, "--outtype", "f16", "--outfile", out]
    runpy.run_path(converter, run_name="__main__")


def quantize_gguf(src: str, dst: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = ARGS.threads
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")


# ---------------------------------------------------------------------------------------------------------------
# Running: one child process per measurement (``--worker``), printing one JSON line.

def _prompt(vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, min(vocab, 30000), ARGS.prompt).tolist()


def worker(kind: str, path: Path, vocab: int) -> dict:
    prompt, new, threads = _prompt(vocab), ARGS.new_tokens, ARGS.threads
    started = time.perf_counter()
    run = {"dstc-ort": _dstc, "dstc-ort-prefill8": _dstc, "dstc-ort-noprefill8": _dstc, "dstc-ov": _dstc,
           "dstc-ort-genai": _ortgenai, "ortgenai-builder": _ortgenai,
           "dstc-ov-genai": _ovgenai, "optimum-ov-genai": _ovgenai, "llamacpp-q4km": _llamacpp}[kind]
    generate = run(path, threads)
    load_s = time.perf_counter() - started
    # warmed up on another prompt: a runtime that caches prefixes must not find the timed prompt's
    generate([_prompt(vocab, seed=1)], WARMUP_TOKENS)
    ttft, steps = generate([prompt], new)
    result = {"load_s": load_s, "ttft_s": ttft, "decode_s": statistics.median(steps)}
    if ARGS.batch4:
        try:
            _, steps4 = generate([prompt] * 4, new)
            result["batch4_tokens_per_s"] = 4 * len(steps4) / sum(steps4)
        except Failed as e:
            result["batch4_skipped"] = str(e)
    # the contender's whole footprint: the model, its caches and scratch at this prompt, and the interpreter
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def _dstc(path: Path, threads: int):
    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.generate import greedy_generate

    decoder = open_decoder(open_artifact(path), threads=threads)

    def generate(prompts, new):
        run = greedy_generate(decoder, prompts, new, set(), 0, ignore_stop=True)
        return run.ttft_s, run.itl_s
    return generate


def _ovgenai(path: Path, threads: int):
    import openvino as ov
    import openvino_genai as ov_genai

    # openvino_genai 2026.4's default on CPU is its paged-attention (continuous batching) backend, with prefix
    # caching: a repeated prompt's prefill is served from the cache (measured: 128 tokens, 44-95 ms repeated
    # against 150-240 ms new). SDPA is the stateful pipeline, the same stateful IR as dstc's runner drives.
    pipe = ov_genai.LLMPipeline(str(path), "CPU", INFERENCE_NUM_THREADS=threads, ATTENTION_BACKEND="SDPA")

    def generate(prompts, new):
        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.min_new_tokens, config.ignore_eos, config.do_sample = new, new, True, False
        ids = np.array(prompts, np.int64)
        started = time.perf_counter()
        result = pipe.generate(ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), config)
        total = time.perf_counter() - started
        ttft = result.perf_metrics.get_ttft().mean / 1e3
        # per step: the wall time after the first token over the later steps (genai's TPOT divides by the batch)
        return ttft, [(total - ttft) / (new - 1)] * (new - 1)
    return generate


def ortgenai_model(path: Path, threads: int, overlay: dict | None = None):
    """onnxruntime-genai's Model of the folder (its genai_config.json) on the CPU with ``threads`` threads, the
    config ``overlay`` laid over it."""
    import onnxruntime_genai as og

    config = og.Config(str(path))
    config.clear_providers()
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    if overlay:
        config.overlay(json.dumps(overlay))
    return og.Model(config)


def _ortgenai(path: Path, threads: int):
    import onnxruntime_genai as og

    model = ortgenai_model(path, threads)

    def generate(prompts, new):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompts[0]) + new, min_length=len(prompts[0]) + new,
                                  do_sample=False, batch_size=len(prompts))
        generator = og.Generator(model, params)
        started = time.perf_counter()
        generator.append_tokens(np.array(prompts, np.int32))
        generator.generate_next_token()
        ttft = time.perf_counter() - started
        steps = []
        for _ in range(new - 1):
            started = time.perf_counter()
            generator.generate_next_token()
            steps.append(time.perf_counter() - started)
        return ttft, steps
    return generate


def llama(gguf: Path, threads: int, n_ctx: int, **kwargs):
    """llama-cpp-python's Llama on ``gguf`` without repacked weight buffers (see the module doc)."""
    import llama_cpp

    # Llama() takes unknown keywords silently (**kwargs): use_extra_bufts must be set on the model parameters
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = False
        return params
    llama_cpp.llama_cpp.llama_model_default_params = model_params
    return llama_cpp.Llama(str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                           verbose=False, **kwargs)


def _llamacpp(path: Path, threads: int):
    llm = llama(path / "model-q4_k_m.gguf", threads, ARGS.prompt + ARGS.new_tokens + 8, logits_all=False)

    def generate(prompts, new):
        if len(prompts) > 1:
            raise Failed("llama-cpp-python's Llama decodes one sequence")
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompts[0])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ttft = time.perf_counter() - started
        steps = []
        for _ in range(new - 1):
            started = time.perf_counter()
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            steps.append(time.perf_counter() - started)
        return ttft, steps
    return generate


def measure(kind: str, path: Path, vocab: int) -> dict:
    """One measurement of a contender in a fresh child process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(path), str(vocab),
           "--threads", str(ARGS.threads), "--prompt", str(ARGS.prompt), "--new-tokens", str(ARGS.new_tokens)]
    if not ARGS.batch4:
        cmd.append("--no-batch4")
    return child_json(cmd)


def child_json(cmd: list[str], timeout: float = 1800) -> dict:
    """Run a measurement's child process: the JSON object of its last line of output; Failed with its last line
    of error output when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
        raise Failed(f"exit {done.returncode}: {(lines or ['no output'])[-1].strip()[:200]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------

def bandwidth(threads: int) -> float:
    """Read bandwidth in bytes/s: torch's sum over 512 MB, best of 5."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(1 << 27, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        float(data.sum())
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def prepare(width: str, work: Path, wanted: list[str]) -> tuple[dict, dict, dict, Path, dict]:
    """The checkpoint and every wanted contender's build: ({contender: path}, builds, skipped, checkpoint,
    config)."""
    name, *rest = width.split(":")
    if name not in WIDTHS:
        raise SystemExit(f"unknown width {name!r}: one of {', '.join(WIDTHS)}")
    layers = int(rest[0]) if rest else 4
    experts = int(rest[1]) if len(rest) > 1 else None
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").is_file():
        print(f"[{width}] shape-faithful checkpoint", flush=True)
        subprocess.run([*DSTC, "models", "shape-faithful", WIDTHS[name], "-o", str(checkpoint), "--layers",
                        str(layers), *(["--experts", str(experts)] if experts else [])],
                       cwd=REPO, check=True, capture_output=True)
    config = json.loads((checkpoint / "config.json").read_text())
    max_rss = int(ARGS.max_build_gib * GiB)
    paths, builds, skipped = {}, {}, {}
    steps = {
        "dstc-ort": (work / "dstc-ort", lambda out: build_dstc(checkpoint, "onnxruntime", out, work, max_rss)),
        "dstc-ort-prefill8": (work / "dstc-ort-prefill8",
                              lambda out: build_dstc(checkpoint, "onnxruntime", out, work, max_rss, prefill_int8=True)),
        "dstc-ort-noprefill8": (work / "dstc-ort-noprefill8",
                                lambda out: build_dstc(checkpoint, "onnxruntime", out, work, max_rss,
                                                       prefill_int8=False)),
        "dstc-ov": (work / "dstc-ov", lambda out: build_dstc(checkpoint, "openvino", out, work, max_rss)),
        "optimum-ov-genai": (work / "optimum", lambda out: build_optimum(checkpoint, out, max_rss)),
        "ortgenai-builder": (work / "builder", lambda out: build_ortgenai(checkpoint, out, work, max_rss)),
        "llamacpp-q4km": (work / "llamacpp", lambda out: build_llamacpp(checkpoint, out, max_rss)),
    }
    uses = {"dstc-ort-genai": "dstc-ort", "dstc-ov-genai": "dstc-ov"}
    for contender in wanted:
        source = uses.get(contender, contender)
        if source not in paths and source not in skipped:
            out, build = steps[source]
            try:
                builds[source] = build_once(width, source, out, build, ARGS.rebuild)
                paths[source] = out
            except Failed as e:
                skipped[source] = str(e)
        if source in skipped:
            skipped[contender] = skipped[source] if contender == source else f"{source} did not build"
        elif contender == "dstc-ort-genai" and not (paths[source] / "genai_config.json").is_file():
            skipped[contender] = "the artifact has no genai_config.json (onnxruntime-genai cannot describe its " \
                                 "KV cache: MLA's keys and values differ in size)"
        else:
            paths[contender] = paths[source]
    return {c: paths[c] for c in wanted if c in paths and c not in skipped}, builds, skipped, checkpoint, config


def build_once(label: str, source: str, out: Path, build, rebuild: bool) -> dict:
    """``build(out)``'s wall time and peak RSS, or those of the build already in ``out`` (its ``.built`` marker)
    unless ``rebuild``; Failed (``out`` removed) when it fails."""
    if (out / ".built").is_file() and not rebuild:
        return json.loads((out / ".built").read_text())
    shutil.rmtree(out, ignore_errors=True)
    print(f"[{label}] building {source}", flush=True)
    try:
        built = build(out)
    except Failed:
        shutil.rmtree(out, ignore_errors=True)
        raise
    (out / ".built").write_text(json.dumps(built))
    return built


def time_contenders(paths: dict, vocab: int, skipped: dict, bandwidths: list[float]) -> dict:
    """``--rounds`` rounds over the contenders, in an order rotated every round. Before every measurement the read
    bandwidth and the load average are taken (the machine is shared: they show what the figure ran beside)."""
    samples: dict = {c: [] for c in paths}
    for round_, contender in harness.alternation(list(paths), ARGS.rounds):
        if contender in skipped:
            continue
        bandwidths.append(bandwidth(ARGS.threads))
        load = os.getloadavg()[0]
        try:
            sample = measure(contender, paths[contender], vocab)
            samples[contender].append({**sample, "bandwidth_before": bandwidths[-1], "load_before": load})
        except (Failed, subprocess.TimeoutExpired) as e:
            skipped[contender] = f"failed while timed: {e}"
        print(f"  round {round_ + 1}: {contender:<17} "
              + (f"TTFT {1e3 * samples[contender][-1]['ttft_s']:.1f} ms, decode "
                 f"{1e3 * samples[contender][-1]['decode_s']:.2f} ms/token (load {load:.1f}, "
                 f"{bandwidths[-1] / 1e9:.1f} GB/s before)" if contender not in skipped
                 else skipped[contender]), flush=True)
    return {c: s for c, s in samples.items() if s and c not in skipped}


def is_peer(contender: str) -> bool:
    return not contender.startswith("dstc")


def rows_for(samples: dict, footprints: dict, bw: float) -> list[dict]:
    """One row per contender: medians of its samples, its footprint (``footprint()``), the share of the bandwidth
    limit ``bw`` (bytes/s) its median decode step reaches, and each timing's ratio to the best peer (a contender
    not named dstc-*): below 1 is better than the best peer for times, above 1 for tokens/s."""
    rows = []
    for contender, runs in samples.items():
        decode = statistics.median(r["decode_s"] for r in runs)
        b4 = [r["batch4_tokens_per_s"] for r in runs if "batch4_tokens_per_s" in r]
        row = {"contender": contender, "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs),
               "decode_ms_per_token": 1e3 * decode, "tokens_per_s": 1 / decode,
               "tokens_per_s_batch4": statistics.median(b4) if b4 else None,
               "batch4_skipped": next((r["batch4_skipped"] for r in runs if "batch4_skipped" in r), None),
               "load_s": statistics.median(r["load_s"] for r in runs), "runs": len(runs),
               "peak_rss_mib": max((r["peak_rss_mib"] for r in runs if "peak_rss_mib" in r), default=None),
               **footprints[contender]}
        row["limit_ms_per_token"] = 1e3 * row["bytes_per_token"] / bw
        row["bandwidth_share"] = row["bytes_per_token"] / bw / decode
        rows.append(row)
    peers = [r for r in rows if is_peer(r["contender"])]
    for key, better in (("ttft_ms", min), ("decode_ms_per_token", min), ("tokens_per_s", max),
                        ("tokens_per_s_batch4", max)):
        values = [r[key] for r in peers if r[key] is not None]
        best = better(values) if values else None
        for row in rows:
            row[f"{key}_to_best_peer"] = row[key] / best if best and row[key] is not None else None
    return rows


# The targets for the dense case (1.5B widths, 4 layers, INT4), on dstc's artifacts with dstc's runner.
TARGET_WIDTH = "qwen-1.5b:4"
# each backend's dstc contenders: a target is judged on the better of them for its figure
BACKENDS = {"onnxruntime": ("dstc-ort", "dstc-ort-prefill8"), "openvino": ("dstc-ov",)}


def _best(rows: list[dict], key: str, better) -> dict[str, float]:
    """{contender: value} of the better of each backend's dstc contenders for ``key`` (where measured)."""
    out = {}
    for contenders in BACKENDS.values():
        values = {r["contender"]: r[key] for r in rows if r["contender"] in contenders and r[key] is not None}
        if values:
            best = better(values, key=values.__getitem__)
            out[best] = values[best]
    return out


def targets(rows: list[dict]) -> list[dict]:
    """[{"target", "met", "measured"}]: decode at >= 70 % of the bandwidth limit and <= 0.7x the best peer's time on
    at least one backend; TTFT <= the best peer's on both backends. A target that cannot be judged (a backend or
    every peer missing) has met None."""
    out = []
    shares = _best(rows, "bandwidth_share", max)
    out.append({"target": "decode >= 70 % of the bandwidth limit on at least one backend",
                "met": max(shares.values()) >= 0.7 if shares else None,
                "measured": {c: round(v, 3) for c, v in shares.items()}})
    judged = _best(rows, "decode_ms_per_token_to_best_peer", min)
    out.append({"target": "decode <= 0.7x the best peer's ms/token on at least one backend",
                "met": min(judged.values()) <= 0.7 if judged else None,
                "measured": {c: round(v, 3) for c, v in judged.items()}})
    judged = _best(rows, "ttft_ms_to_best_peer", min)
    out.append({"target": "TTFT <= the best peer's on both backends",
                "met": (len(judged) == len(BACKENDS) and max(judged.values()) <= 1.0) if judged else None,
                "measured": {c: round(v, 3) for c, v in judged.items()}})
    return out


def table(rows: list[dict], skipped: dict) -> str:
    """The Markdown table of ``rows_for`` rows, then one line per skipped contender."""
    lines = [("| contender | TTFT ms | decode ms/token | tokens/s b1 | tokens/s b4 | MB read/token | % of BW limit | "
              "KV bytes/token | peak RSS MiB | TTFT / best peer | decode / best peer | b4 tokens/s / best peer |"),
             "|" + "---|" * 12]

    def ratio(value):
        return f"{value:.2f}" if value is not None else "–"
    for r in rows:
        b4 = f"{r['tokens_per_s_batch4']:.1f}" if r["tokens_per_s_batch4"] else "–"
        rss = f"{r['peak_rss_mib']:.0f}" if r.get("peak_rss_mib") else "–"
        lines.append(f"| {r['contender']} | {r['ttft_ms']:.1f} | {r['decode_ms_per_token']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {b4} | {r['bytes_per_token'] / 1e6:.0f} | "
                     f"{100 * r['bandwidth_share']:.0f} % | {r['kv_bytes_per_token']} ({r['kv_precision']}) | "
                     f"{rss} | {ratio(r['ttft_ms_to_best_peer'])} | {ratio(r['decode_ms_per_token_to_best_peer'])} | "
                     f"{ratio(r['tokens_per_s_batch4_to_best_peer'])} |")
    lines += [f"| {name} | skipped: {why} |" + " |" * 10 for name, why in skipped.items()]
    return "\n".join(lines)


def versions() -> dict:
    """The installed version of each runtime and exporter the contenders use (None: not installed)."""
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "onnxruntime", "onnxruntime-genai", "openvino", "openvino-genai", "nncf",
                 "optimum-intel", "llama-cpp-python"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["optimum-intel"] = out["optimum-intel"] or optimum_intel_env.version()  # in its own environment
    if out["llama-cpp-python"] is None:  # a source tree on PYTHONPATH has no metadata
        with contextlib.suppress(ImportError):
            import llama_cpp
            out["llama-cpp-python"] = llama_cpp.__version__
    return out


def add_build_arguments(parser: argparse.ArgumentParser, work: Path) -> None:
    """The options of the builds and the run that peers.py and peers_speculative.py share."""
    parser.add_argument("--work", type=Path, default=work,
                        help="checkpoints and builds (kept: a later run reuses them unless --rebuild)")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--max-build-gib", type=float, default=7.0, help="a build above this RSS is killed, skipped")
    parser.add_argument("--lock", type=Path, default=harness.LOCK)
    parser.add_argument("--json", type=Path, default=None)


def chosen(names: str, known, what: str) -> list[str]:
    """The comma-separated ``names``, each one of ``known`` (else the run stops naming the unknown ones)."""
    wanted = names.split(",")
    if unknown := sorted(set(wanted) - set(known)):
        raise SystemExit(f"unknown {what} {unknown}: choose from {', '.join(known)}")
    return wanted


def main() -> None:
    if ARGS.worker:
        kind, path, vocab = ARGS.worker
        print(json.dumps(worker(kind, Path(path), int(vocab))))
        return
    if ARGS.quantize_gguf:
        quantize_gguf(*ARGS.quantize_gguf)
        return
    if ARGS.convert_gguf:
        convert_gguf(*ARGS.convert_gguf)
        return
    if ARGS.retable:
        retable(ARGS.retable)
        return
    wanted = chosen(ARGS.contenders, CONTENDERS, "contenders")
    cpu = describe_cpu()
    results = {"machine": {"cpu": cpu, "threads": ARGS.threads}, "versions": versions(), "settings": {
        "prompt": ARGS.prompt, "new_tokens": ARGS.new_tokens, "threads": ARGS.threads, "rounds": ARGS.rounds,
        "contenders": wanted}, "widths": {}}
    prepared = {}
    for width in ARGS.widths.split(","):
        work = ARGS.work / width.replace(":", "-")
        work.mkdir(parents=True, exist_ok=True)
        prepared[width] = prepare(width, work, wanted)
    print(cpu_line(cpu), flush=True)
    with harness.one_at_a_time(ARGS.lock):
        for width, (paths, builds, skipped, checkpoint, config) in prepared.items():
            print(f"[{width}] timing {', '.join(paths)}", flush=True)
            bandwidths: list[float] = []
            samples = time_contenders(paths, config["vocab_size"], skipped, bandwidths)
            # the limit: the best bandwidth seen (each figure beside a shared machine's load is a lower bound)
            bw = max(bandwidths)
            active = active_experts(config)
            rows = rows_for(samples, {c: footprint(c, paths[c], active) for c in samples}, bw)
            results["widths"][width] = {"checkpoint": str(checkpoint), "config": config, "builds": builds,
                                        "paths": {c: str(p) for c, p in paths.items()},
                                        "bandwidth_bytes_per_s": bw, "bandwidths": bandwidths, "rows": rows,
                                        "skipped": skipped, "samples": samples,
                                        "targets": targets(rows) if width == TARGET_WIDTH else None}
    report(results)
    if ARGS.json:
        ARGS.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


# the directory each contender's build is in, under a width's work directory (prepare's layout)
BUILD_DIRS = {"dstc-ort": "dstc-ort", "dstc-ort-prefill8": "dstc-ort-prefill8",
              "dstc-ort-noprefill8": "dstc-ort-noprefill8", "dstc-ort-genai": "dstc-ort",
              "dstc-ov": "dstc-ov", "dstc-ov-genai": "dstc-ov",
              "optimum-ov-genai": "optimum", "ortgenai-builder": "builder", "llamacpp-q4km": "llamacpp"}


def retable(path: Path) -> None:
    """Rows, targets and the table again from a results JSON's samples, the footprints read anew from the builds
    (which must still be there); the JSON is rewritten."""
    results = json.loads(path.read_text())
    for width, result in results["widths"].items():
        work = Path(result["checkpoint"]).parent
        paths = {c: Path(result.get("paths", {}).get(c) or work / BUILD_DIRS[c]) for c in result["samples"]}
        active = active_experts(result["config"])
        result["paths"] = {c: str(p) for c, p in paths.items()}
        result["rows"] = rows_for(result["samples"], {c: footprint(c, p, active) for c, p in paths.items()},
                                  result["bandwidth_bytes_per_s"])
        result["targets"] = targets(result["rows"]) if width == TARGET_WIDTH else None
    report(results)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


def report(results: dict) -> None:
    settings, cpu = results["settings"], results["machine"]["cpu"]
    for width, result in results["widths"].items():
        print(f"\n{width} ({result['config']['model_type']}, hidden {result['config']['hidden_size']}, "
              f"{result['config']['num_hidden_layers']} layers), prompt {settings['prompt']}, "
              f"{settings['new_tokens']} new tokens, medians of {settings['rounds']} alternated rounds; "
              f"{cpu_line(cpu)}, {settings['threads']} threads, read bandwidth "
              f"{result['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (the best of {len(result['bandwidths'])}, one "
              f"before each measurement; median {statistics.median(result['bandwidths']) / 1e9:.1f})")
        print(table(result["rows"], result["skipped"]))
        for target in result["targets"] or []:
            verdict = {True: "met", False: "missed", None: "not judged"}[target["met"]]
            print(f"  target {verdict}: {target['target']}: {target['measured']}")
        for name, build in result["builds"].items():
            print(f"  build {name}: {build['wall_s']} s, peak RSS {build['peak_rss_gib']} GiB")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="qwen-1.5b:4", help="NAME[:LAYERS[:EXPERTS]],... (see the module doc)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    add_build_arguments(parser, Path("/work/peers-work/peers"))
    parser.add_argument("--no-batch4", dest="batch4", action="store_false")
    parser.add_argument("--llamacpp-converter", type=Path, default=None)
    parser.add_argument("--retable", type=Path, default=None, metavar="JSON",
                        help="print (and rewrite) a results JSON's rows and table again from its samples")
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "PATH", "VOCAB"), help=argparse.SUPPRESS)
    parser.add_argument("--convert-gguf", nargs=3, metavar=("CONVERTER", "CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--quantize-gguf", nargs=2, metavar=("F16", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None

if __name__ == "__main__":
    main()
