"""The peers' INT4 builds of a checkpoint, their next-token log-probabilities and their bits per weight, for comparing
dstc's INT4 fidelity with theirs at equal bits (issue 21).

The peers run in their own environment, ENV (``benchmarks/peer_env.sh ENV``: transformers 4.57.6, optimum-intel,
NNCF, OpenVINO, llama.cpp built from llama-cpp-python's sdist), always in child processes
(benchmarks/peer_worker.py and the peers' own command-line tools): this module imports only numpy and the standard
library, so dstc's environment never loads the peers' transformers.

Contenders:

* ``optimum-int4``: ``optimum-cli export openvino --weight-format int4`` with its defaults (NNCF data-free,
  asymmetric, group 128, ratio 1.0; embeddings and lm_head int8 per channel).
* ``optimum-int4-awq-se``: the same with AWQ and scale estimation on the caller's calibration texts, given to
  optimum-intel's Python API as a list of strings (``OVWeightQuantizationConfig(dataset=[...])``, as the CLI's
  ``--awq --scale-estimation`` would use a named dataset).
* ``llamacpp-q4km``: llama.cpp's convert_hf_to_gguf.py (f32 GGUF, kept as ``model-f32.gguf``), then
  ``llama-quantize ... Q4_K_M``. Q4_K needs rows of a multiple of 256 weights: narrower tensors (the embedded models'
  hidden size is 128) fall back to other types (Q5_0 and Q8_0 where Q4_K and Q6_K were meant);
  ``bits_per_weight`` gives the types chosen.
* ``llamacpp-q4km-imatrix``: the same, quantized with an importance matrix that ``llama-imatrix`` computed on the
  calibration texts (one per line in ``calibration.txt``; chunks of ``min(128, tokens // 2)`` tokens). The build
  checks that llama.cpp tokenizes that file as transformers does (``tokenization_match`` in its result).
* ``llamacpp-q4_0`` / ``llamacpp-q4_0-imatrix``: ``Q4_0`` (blocks of 32 weights, an f16 scale each: 4.5 bits) in
  place of Q4_K_M, which the embedded models' 128-wide rows push to about 6 bits: llama.cpp's point at the bits
  of the others.

The checkpoint is given to the peers rewritten for transformers 4.x (``peer_checkpoint``): the embedded
checkpoints were saved by transformers 5, whose ``rope_parameters`` transformers 4.57 does not read (it would run
the default RoPE: a different model) and whose tokenizer class it does not know. ``__main__`` checks that the
peers' transformers then computes what dstc's reference computes.

Known refusals (raised as ``Skipped`` with the peer's own line): optimum-intel 2.1.0 exports DeepSeek-V2/V3 only on
transformers <= 4.53.3 ("Maximum required is 4.53.3"); on 4.53.3 itself its DeepSeek patches, written for the hub
checkpoints' remote code (modeling_deepseek.py), fail on transformers' own DeepseekV3 ("deepseek_v3_attn_forward()
got an unexpected keyword argument 'cache_position'"), and 4.53.3 has no DeepseekV2 at all. Qwen2 needs >= 4.57.
llama.cpp converts deepseek-v2-lite-tiny but cannot load or quantize it ("key not found in model:
deepseek2.attention.q_lora_rank": it takes a DeepSeek-V2 without q_lora_rank for V2-Lite only at 26 or 27 layers).
On deepseek-v3-tiny llama.cpp's f32 GGUF is itself 5.3e-3 nats of KL from the reference (1e-12 on Qwen2 / Llama):
``__main__`` prints each llama.cpp build's KL against its own f32 beside the KL against the reference.

API:

* ``build(contender, checkpoint, out, calibration, env) -> dict``: builds into ``out``; ``wall_s`` and
  ``peak_rss_gib`` (the whole process tree, sampled every 0.1 s) over all of the build's steps, ``steps`` per step.
* ``log_probs(contender, built, sequences, env) -> list[np.ndarray]``: per sequence of token ids (of length n), a
  float64 array [n, vocab] of log-softmax next-token log-probabilities: row i is the distribution of token i + 1
  given tokens 0..i (the last row predicts past the sequence). OpenVINO runs with f32 compute, an f32 KV cache and
  no dynamic activation quantization; llama.cpp with an f32 KV cache, no flash attention and no repacked weights.
  The whole sequence is one forward pass (no BOS is added: give it in the ids).
* ``bits_per_weight(contender, built, env) -> dict``: ``all`` (every weight matrix, embeddings and lm_head
  included: stored bits of the weights, their scales and zero points over their parameter count), ``linear`` (the
  same without the embeddings and lm_head), ``parameters`` / ``linear_parameters``, and ``types``: the count of
  weight matrices per storage type. For llama.cpp the env is needed (gguf's reader runs there).

    .venv/bin/python benchmarks/peer_fidelity.py --model r1-distill-qwen-tiny --env /work/peerenv --work /tmp/peers/run
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import numpy as np

# llama.cpp's contenders -> the llama-quantize type
LLAMACPP = {"llamacpp-q4km": "Q4_K_M", "llamacpp-q4km-imatrix": "Q4_K_M", "llamacpp-q4_0": "Q4_0",
            "llamacpp-q4_0-imatrix": "Q4_0"}
CONTENDERS = ("optimum-int4", "optimum-int4-awq-se", *LLAMACPP)
REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "benchmarks" / "peer_worker.py"
LLAMA_CPP_PYTHON = "0.3.36"  # benchmarks/peer_env.sh's pin: where its source and build are
GiB = 1 << 30
TIMEOUT_S = 3600


class Skipped(Exception):
    """A peer that refuses the model (or fails on it): the message is its own one-line reason."""


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint as the peers' transformers reads it.

def peer_checkpoint(checkpoint: Path, out: Path) -> Path:
    """``out`` holding ``checkpoint`` for transformers 4.x: config.json with RoPE as ``rope_theta`` /
    ``rope_scaling`` (``rope_parameters`` kept for llama.cpp's converter, which reads it first) and ``torch_dtype``;
    tokenizer_config.json naming PreTrainedTokenizerFast, its extra special tokens as ``additional_special_tokens``.
    The other files are symbolic links to the checkpoint's."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_theta"}, "type": rope["rope_type"]}
    if "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = json.loads((checkpoint / "tokenizer_config.json").read_text())
    tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = tokenizer.pop("extra_special_tokens", [])
    if isinstance(extra, list):
        tokenizer["additional_special_tokens"] = extra
    tokenizer.pop("backend", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
    for file in checkpoint.iterdir():
        link = out / file.name
        if file.name not in ("config.json", "tokenizer_config.json") and not link.exists():
            link.symlink_to(file.resolve())
    return out


# ---------------------------------------------------------------------------------------------------------------
# Running the peers.

def _error_line(output: str) -> str:
    """The peer's own reason: the last ``SomethingError: ...`` line (Python), else the last line naming an error,
    else the first line saying something failed (llama.cpp's tools say the cause first, then who failed), else the
    last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pattern in (r"^[\w.]*(Error|Exception)\b.*:", r"\berror\b"):
        for line in reversed(lines):
            if re.search(pattern, line, re.IGNORECASE):
                return line[:300]
    for line in lines:
        if re.search(r"failed|unsupported|not supported", line, re.IGNORECASE):
            return line[:300]
    return (lines or ["no output"])[-1][:300]


def _run(cmd: list[str], log: Path, *, cwd: Path | None = None) -> dict:
    """Run ``cmd`` (output to ``log``): its wall time and the peak RSS of its process tree; Skipped with its error
    line when it fails."""
    if str(REPO) not in sys.path:  # imported by the tests as a file, not run as a script
        sys.path.insert(0, str(REPO))
    from benchmarks import harness

    run = harness.run_measured(cmd, cwd=cwd, log=log, env={"PYTHONWARNINGS": "ignore"}, timeout=TIMEOUT_S,
                               every=0.1)
    if run.returncode != 0:
        raise Skipped(_error_line(log.read_text(errors="replace")))
    return {"wall_s": round(run.wall_s, 2), "peak_rss_gib": round(run.peak_bytes / GiB, 3)}


def _paths(env: Path) -> dict[str, Path]:
    env = Path(env)
    return {"python": env / "bin" / "python", "optimum-cli": env / "bin" / "optimum-cli",
            "converter": env / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
            / "convert_hf_to_gguf.py",
            "imatrix": env / "llama.cpp-build" / "bin" / "llama-imatrix",
            "quantize": env / "llama.cpp-build" / "bin" / "llama-quantize"}


def _worker(env: Path, *args: str) -> list[str]:
    return [str(_paths(env)["python"]), str(WORKER), *args]


def _gguf(built: Path) -> Path:
    return built / "model.gguf"


def _ir(built: Path) -> Path:
    return built / "ir"


def build(contender: str, checkpoint: Path, out: Path, calibration: list[str], env: Path) -> dict:
    """Build ``contender`` from ``checkpoint`` into ``out`` (``calibration``: the texts for the data-aware ones)."""
    if contender not in CONTENDERS:
        raise ValueError(f"unknown contender {contender!r}: one of {', '.join(CONTENDERS)}")
    paths = _paths(env)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = peer_checkpoint(Path(checkpoint), out / "checkpoint")
    steps: dict[str, dict] = {}
    result: dict = {}
    if contender == "optimum-int4":
        steps["export"] = _run([str(paths["optimum-cli"]), "export", "openvino", "--model", str(source), "--task",
                                "text-generation-with-past", "--weight-format", "int4", str(_ir(out))],
                               out / "export.log")
    elif contender == "optimum-int4-awq-se":
        (out / "calibration.json").write_text(json.dumps(calibration))
        steps["export"] = _run(_worker(env, "optimum-awq", str(source), str(_ir(out)), str(out / "calibration.json")),
                               out / "export.log")
        result["calibration"] = f"{len(calibration)} texts given as a list of strings"
    else:
        f32 = out / "model-f32.gguf"
        steps["convert"] = _run(_worker(env, "convert-gguf", str(paths["converter"]), str(source), str(f32)),
                                out / "convert.log")
        quantize = [str(paths["quantize"])]
        if contender.endswith("-imatrix"):
            text = out / "calibration.txt"
            text.write_text("\n".join(calibration) + "\n")
            result["tokenization_match"], tokens = _tokenization_match(env, f32, text, source, out)
            context = min(128, tokens // 2)
            steps["imatrix"] = _run([str(paths["imatrix"]), "-m", str(f32), "-f", str(text), "-o",
                                     str(out / "imatrix.gguf"), "-c", str(context), "-b", str(context), "-t", "2",
                                     "--no-repack", "--no-ppl"], out / "imatrix.log")
            result["imatrix_chunks"] = f"{tokens // context} chunks of {context} tokens ({tokens} tokens)"
            quantize += ["--imatrix", str(out / "imatrix.gguf")]
        steps["quantize"] = _run([*quantize, str(f32), str(_gguf(out)), LLAMACPP[contender], "2"],
                                 out / "quantize.log")
    return {"wall_s": round(sum(s["wall_s"] for s in steps.values()), 2),
            "peak_rss_gib": max(s["peak_rss_gib"] for s in steps.values()), "steps": steps, **result}


def _tokenization_match(env: Path, gguf: Path, text: Path, source: Path, out: Path) -> tuple[float, int]:
    """The share of llama.cpp's token ids for ``text`` equal to transformers' at the same place (1.0: the same
    tokenization, so the importance matrix sees the calibration sequences the model was evaluated on), and its
    token count."""
    log = out / "tokenize.log"
    done = subprocess.run(_worker(env, "tokenize-gguf", str(gguf), str(text), str(source)), capture_output=True,
                          text=True, timeout=600, check=False)
    log.write_text(done.stderr)
    if done.returncode != 0:
        raise Skipped(_error_line(done.stderr))
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    ours, theirs = ids["llamacpp"], ids["transformers"]
    same = sum(a == b for a, b in zip(ours, theirs, strict=False)) / max(len(ours), len(theirs))
    return round(same, 4), len(ours)


# ---------------------------------------------------------------------------------------------------------------
# Log-probabilities.

def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _split_log_probs(cmd: list[str], sequences: list[list[int]], work: Path, out: Path) -> list[np.ndarray]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise Skipped(_error_line(done.stderr + done.stdout))
    logits = np.load(out)
    bounds = np.cumsum([len(s) for s in sequences])[:-1]
    return [log_softmax(rows) for rows in np.split(logits, bounds)]


def log_probs(contender: str, built: Path, sequences: list[list[int]], env: Path) -> list[np.ndarray]:
    """Per sequence, [len, vocab] float64 log-probabilities; row i predicts token i + 1."""
    built = Path(built)
    with tempfile.TemporaryDirectory(prefix="peer-logits-") as tmp:
        work = Path(tmp)
        (work / "sequences.json").write_text(json.dumps([[int(t) for t in s] for s in sequences]))
        out = work / "logits.npy"
        if contender.startswith("optimum"):
            cmd = _worker(env, "ov-logits", str(_ir(built)), str(work / "sequences.json"), str(out))
        elif contender.startswith("llamacpp"):
            gguf = built if built.suffix == ".gguf" else _gguf(built)
            cmd = _worker(env, "gguf-logits", str(gguf), str(work / "sequences.json"), str(out), "2")
        elif contender == "transformers-fp32":  # the peers' transformers on the rewritten checkpoint (a check)
            cmd = _worker(env, "hf-logits", str(built / "checkpoint"), str(work / "sequences.json"), str(out))
        else:
            raise ValueError(f"unknown contender {contender!r}")
        return _split_log_probs(cmd, sequences, work, out)


# ---------------------------------------------------------------------------------------------------------------
# Bits per weight, from the files.

BITS = {"u1": 1, "u2": 2, "u3": 3, "u4": 4, "i4": 4, "nf4": 4, "f4e2m1": 4, "u8": 8, "i8": 8, "f8e4m3": 8,
        "f8e5m2": 8, "f8e8m0": 8, "f16": 16, "bf16": 16, "f32": 32}
# operations between a stored weight and the MatMul / Gather reading it (decompression: unpack, subtract the zero
# point, scale, regroup)
DECOMPRESSION = {"Convert", "Subtract", "Multiply", "Reshape", "Transpose", "Unsqueeze", "Squeeze"}


def _elements(shape: str | None) -> int:
    return int(np.prod([int(d) for d in shape.split(",")])) if shape else 1


def ir_bits(xml: Path) -> dict:
    """Bits per weight of an OpenVINO IR: each MatMul input and Gather table computed from constants alone is a
    weight matrix; its largest constant is the weight (its element count the parameters), the others its scales and
    zero points (shape constants of Reshape and the like excluded). Gather tables are embeddings; a MatMul whose
    weight or node is named lm_head is the lm_head."""
    root = ET.parse(xml).getroot()
    layers = {layer.get("id"): layer for layer in root.iter("layer")}
    inputs: dict[str, dict[str, str]] = {}
    for edge in root.iter("edge"):
        inputs.setdefault(edge.get("to-layer", ""), {})[edge.get("to-port", "")] = edge.get("from-layer", "")

    def ports(layer_id: str) -> list[str]:
        return [port.get("id", "") for port in layers[layer_id].findall("input/port")]

    def constants(layer_id: str) -> list[str] | None:
        """The constants a value is computed from through decompression ops only; None if anything else feeds it."""
        layer = layers[layer_id]
        if layer.get("type") == "Const":
            return [layer_id]
        if layer.get("type") not in DECOMPRESSION:
            return None
        found = []
        port_ids = ports(layer_id)
        for index, port in enumerate(port_ids):
            source = inputs.get(layer_id, {}).get(port)
            if source is None:
                continue
            if index == 1 and layer.get("type") in ("Reshape", "Transpose", "Unsqueeze", "Squeeze"):
                continue  # a shape or an axis order, not data
            sub = constants(source)
            if sub is None:
                return None
            found += sub
        return found

    seen: set[str] = set()
    totals = {"all": [0, 0], "linear": [0, 0]}
    types: Counter = Counter()
    for layer_id, layer in layers.items():
        kind = layer.get("type")
        if kind not in ("MatMul", "Gather"):
            continue
        candidates = ["0"] if kind == "Gather" else ports(layer_id)[:2]
        for port in candidates:
            source = inputs.get(layer_id, {}).get(port)
            consts = constants(source) if source is not None else None
            if not consts:
                continue
            data = {c: layers[c].find("data") for c in consts}
            weight = max(consts, key=lambda c: _elements(data[c].get("shape")))
            if weight in seen or sum(int(d) > 1 for d in (data[weight].get("shape") or "1").split(",")) < 2:
                continue  # a vector (RoPE's frequencies, a bias), not a weight matrix
            seen.add(weight)
            stored = sum(_elements(d.get("shape")) * BITS[d.get("element_type", "f32")] for d in data.values())
            parameters = _elements(data[weight].get("shape"))
            types[data[weight].get("element_type")] += 1
            names = f"{layers[weight].get('name')} {layer.get('name')}"
            table_or_head = kind == "Gather" or "lm_head" in names
            for key in ("all",) if table_or_head else ("all", "linear"):
                totals[key][0] += stored
                totals[key][1] += parameters
    return {"all": totals["all"][0] / totals["all"][1], "linear": totals["linear"][0] / totals["linear"][1],
            "parameters": totals["all"][1], "linear_parameters": totals["linear"][1], "types": dict(types)}


def gguf_bits(tensors: list[dict]) -> dict:
    """Bits per weight of a GGUF's tensors (name, type, shape, elements, bytes, as gguf's reader gives them): every
    tensor of two or more dimensions is a weight matrix (stacked experts are one, of three); token_embd and output
    are the embeddings and lm_head. A block type's bytes hold its scales and minimums."""
    totals = {"all": [0, 0], "linear": [0, 0]}
    types: Counter = Counter()
    for tensor in tensors:
        if sum(d > 1 for d in tensor["shape"]) < 2:
            continue
        types[tensor["type"]] += 1
        keys = ("all",) if tensor["name"] in ("token_embd.weight", "output.weight") else ("all", "linear")
        for key in keys:
            totals[key][0] += tensor["bytes"] * 8
            totals[key][1] += tensor["elements"]
    return {"all": totals["all"][0] / totals["all"][1], "linear": totals["linear"][0] / totals["linear"][1],
            "parameters": totals["all"][1], "linear_parameters": totals["linear"][1], "types": dict(types)}


def gguf_tensors(gguf: Path, env: Path) -> list[dict]:
    done = subprocess.run(_worker(env, "gguf-tensors", str(gguf)), capture_output=True, text=True, timeout=600,
                          check=False)
    if done.returncode != 0:
        raise Skipped(_error_line(done.stderr))
    return json.loads(done.stdout.strip().splitlines()[-1])


def bits_per_weight(contender: str, built: Path, env: Path | None = None) -> dict:
    built = Path(built)
    if contender.startswith("optimum"):
        return ir_bits(_ir(built) / "openvino_model.xml")
    if env is None:
        raise ValueError("a GGUF's tensors are read with gguf in the peer environment: give env")
    return gguf_bits(gguf_tensors(built if built.suffix == ".gguf" else _gguf(built), env))


# ---------------------------------------------------------------------------------------------------------------
# A check on one embedded model: every contender against dstc's fp32 transformers reference.

# The corpus' template grammar picks many words uniformly (one of 22 objects, 24 names): at about a fifth of the
# positions the reference's two likeliest tokens are within 0.01 of each other, and which one a quantized model
# ranks first is a coin toss. ``top1_decided`` counts only positions where they are at least this far apart.
DECIDED_GAP = 0.05


def compare(reference: list[np.ndarray], candidate: list[np.ndarray]) -> dict:
    """Mean KL(reference || candidate) and top-1 agreement over every row, and over the decided rows."""
    p_log = np.concatenate(reference)
    q_log = np.concatenate(candidate)
    kl = (np.exp(p_log) * (p_log - q_log)).sum(-1)
    agree = p_log.argmax(-1) == q_log.argmax(-1)
    top2 = np.sort(p_log, axis=-1)[:, -2:]
    decided = np.exp(top2[:, 1]) - np.exp(top2[:, 0]) >= DECIDED_GAP
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(agree.mean()),
            "top1_decided": float(agree[decided].mean()), "decided": int(decided.sum()), "positions": len(kl)}


def heldout_sequences(tokenizer, positions: int) -> list[list[int]]:
    """Held-out texts and problems of the embedded corpus (never in calibration), tokenized with BOS, until
    ``positions`` tokens."""
    from toolchain.models.corpus import task_examples, text_samples

    texts = text_samples("heldout", positions // 4)
    problems = ["".join(pair) for pair in task_examples("heldout", positions // 8)]
    sequences, total = [], 0
    for text in (t for pair in zip(texts, problems + texts, strict=False) for t in pair):
        ids = tokenizer(text)["input_ids"]
        sequences.append(ids)
        total += len(ids)
        if total >= positions:
            break
    return sequences


def reference_log_probs(checkpoint: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """dstc's reference: transformers (dstc's environment) in fp32, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [log_softmax(model(torch.tensor([s])).logits[0].numpy()) for s in sequences]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="r1-distill-qwen-tiny")
    parser.add_argument("--env", type=Path, default=Path("/work/peerenv"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/peers/run"))
    parser.add_argument("--positions", type=int, default=400)
    parser.add_argument("--calibration", type=int, default=32, help="texts of the embedded corpus' train split")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from toolchain.models.corpus import calibration_texts
    from toolchain.models.registry import embedded_path

    checkpoint = embedded_path(args.model)
    sequences = heldout_sequences(AutoTokenizer.from_pretrained(checkpoint), args.positions)
    reference = reference_log_probs(checkpoint, sequences)
    calibration = calibration_texts(args.calibration)
    rows: dict[str, dict] = {}
    outputs: dict[str, list[np.ndarray]] = {}
    for contender in args.contenders.split(","):
        out = args.work / args.model / contender
        try:
            row = build(contender, checkpoint, out, calibration, args.env)
            row["bits"] = bits_per_weight(contender, out, args.env)
            outputs[contender] = log_probs(contender, out, sequences, args.env)
            row.update(compare(reference, outputs[contender]))
        except Skipped as reason:
            row = {"skipped": str(reason)}
        rows[contender] = row
        print(contender, json.dumps(row), flush=True)
    # checks of the setup: the peers' transformers on the rewritten checkpoint; llama.cpp on the f32 GGUF (its
    # runtime's own distance from the reference, and its quantization's distance from its own f32)
    some = args.work / args.model / next(iter(rows))
    checks = {"transformers-fp32": some, "llamacpp-f32": args.work / args.model / "llamacpp-q4km" / "model-f32.gguf"}
    for name, built in checks.items():
        if built.exists():
            try:
                outputs[name] = log_probs(name, built, sequences, args.env)
                rows[name] = compare(reference, outputs[name])
            except Skipped as reason:
                rows[name] = {"skipped": str(reason)}
            print(name, json.dumps(rows[name]), flush=True)
    for contender in LLAMACPP:
        if contender in outputs and "llamacpp-f32" in outputs:
            rows[contender]["kl_vs_own_f32"] = compare(outputs["llamacpp-f32"], outputs[contender])["kl_mean"]
    print(f"\n{args.model}: {sum(len(s) for s in sequences)} positions in {len(sequences)} held-out sequences")
    print(f"{'contender':24} {'bits all':>8} {'linear':>7} {'KL mean':>10} {'top-1':>7} {'decided':>7} "
          f"{'build s':>8} {'GiB':>6} {'KL vs own f32':>13}")
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:24} skipped: {row['skipped']}")
            continue
        bits, nan = row.get("bits", {}), float("nan")
        print(f"{name:24} {bits.get('all', nan):8.3f} {bits.get('linear', nan):7.3f} {row['kl_mean']:10.3e} "
              f"{row['top1']:7.4f} {row['top1_decided']:7.4f} {row.get('wall_s', nan):8.1f} "
              f"{row.get('peak_rss_gib', nan):6.2f} {row.get('kl_vs_own_f32', nan):13.3e}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
