"""INT4 fidelity at equal bits: dstc's compression options against the peers' INT4 on the four trained embedded
models (issue 21, deliver 6), and the evidence for the recipes' defaults.

dstc's contenders are real builds: a recipe per variant (the embedded recipe's export and compile for OpenVINO, or
ONNX Runtime with ``--target``, the variant's `compress:` section, `eval: {latency: false, openvino_f32: true}`),
run with `dstc build`, so KL, top-1, exact-match and per-layer MoE routing agreement come from the artifact's own
report.json on the embedded held-out corpus, against the cached fp32 PyTorch reference. Bits per weight are counted from compression.json's
per-weight rows: `all` (every weight matrix, embeddings and lm_head included) and `linear` (neither).

The peers (benchmarks/peer_fidelity.py, in the environment benchmarks/peer_env.sh makes: optimum-intel refuses
DeepSeek on transformers 5.x) are scored on the same sequences against the same cached reference record, with
eval's own KL (toolchain/evaluate/accuracy.py compare_distributions), so the columns are one measure.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fidelity.py [--models NAME ...] [--variants LABEL ...]
        [--peer-env /work/peerenv] [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

EVAL = {"latency": False, "openvino_f32": True}
BASE = {"scheme": "int4-grouped", "group_size": 128, "sym": False, "backup": "int8"}
# label -> compress options over BASE; routing-carrying weights (routers FP32, embeddings/lm_head INT8) are the
# policy's defaults in every row unless a row says otherwise
VARIANTS: dict[str, dict] = {
    "rtn": {},
    "awq": {"awq": True},
    "se": {"scale_estimation": True},
    "awq+se": {"awq": True, "scale_estimation": True},
    "gptq": {"gptq": True},
    "gptq+se": {"gptq": True, "scale_estimation": True},
    "rtn g64": {"group_size": 64},
    "awq+se g64": {"group_size": 64, "awq": True, "scale_estimation": True},
    "awq+se ratio0.9": {"awq": True, "scale_estimation": True, "ratio": 0.9},
    "rtn router int8": {"router": "int8"},
    "rtn shared int8": {"shared_experts": "int8"},
    # upper bounds of mixed precision for what feeds the routers: attention, or the first (dense) layer, unquantized
    "rtn attention fp32": {"ignore": ["/self_attn/"]},
    "rtn layer0 fp32": {"ignore": ["^layers\\.0/"]},
    "gptq attention fp32": {"gptq": True, "ignore": ["/self_attn/"]},
    # INT8 per channel for small weights upstream of the first router, GPTQ for the rest (issue 21's routing target)
    "gptq L0 attention int8": {"gptq": True, "int8": ["^layers\\.0/self_attn/"]},
    "gptq L0 gate-up int8 router int8": {"gptq": True, "router": "int8",
                                          "int8": ["^layers\\.0/mlp/dense/(gate|up)_proj/"]},
    "gptq L0-1 q_a kv_a int8": {"gptq": True, "int8": ["^layers\\.[01]/self_attn/(q_a_proj|kv_a_proj_with_mqa)/"]},
    "gptq q_a kv_a int8": {"gptq": True, "int8": ["/self_attn/(q_a_proj|kv_a_proj_with_mqa)/"]},
    "gptq g64": {"gptq": True, "group_size": 64},
    "gptq ratio0.95": {"gptq": True, "ratio": 0.95},
    "gptq g64 router int8 L0 up int8": {"gptq": True, "group_size": 64, "router": "int8",
                                        "int8": ["^layers\\.0/mlp/dense/up_proj/"]},
    "gptq g64 router int8 L0 attention int8": {"gptq": True, "group_size": 64, "router": "int8",
                                               "int8": ["^layers\\.0/self_attn/"]},
    "gptq g64 router int8 L0 up kv_a int8": {"gptq": True, "group_size": 64, "router": "int8",
                                             "int8": ["^layers\\.0/mlp/dense/up_proj/",
                                                      "/self_attn/kv_a_proj_with_mqa/"]},
    "gptq g64 router int8 L0 down int8": {"gptq": True, "group_size": 64, "router": "int8",
                                          "int8": ["^layers\\.0/mlp/dense/down_proj/"]},
    "gptq g64 router int8 L0 down kv_a int8": {"gptq": True, "group_size": 64, "router": "int8",
                                               "int8": ["^layers\\.0/mlp/dense/down_proj/",
                                                        "/self_attn/kv_a_proj_with_mqa/"]},
    "gptq router int8 L0 down-up int8": {"gptq": True, "router": "int8",
                                         "int8": ["^layers\\.0/mlp/dense/(down|up)_proj/"]},
    "gptq router int8 L0 down attention int8": {"gptq": True, "router": "int8",
                                                "int8": ["^layers\\.0/mlp/dense/down_proj/", "^layers\\.0/self_attn/"]},
    "gptq g64 router int8 L0 down L1 shared down int8": {
        "gptq": True, "group_size": 64, "router": "int8",
        "int8": ["^layers\\.0/mlp/dense/down_proj/", "^layers\\.1/mlp/shared_experts/down_proj/"]},
}
# rows measured on the DeepSeek models only (README's routing rows)
MOE_ONLY = {"rtn router int8", "rtn shared int8", "rtn attention fp32", "rtn layer0 fp32", "gptq attention fp32",
            "gptq L0 attention int8", "gptq L0 gate-up int8 router int8", "gptq L0-1 q_a kv_a int8",
            "gptq q_a kv_a int8", "gptq g64", "gptq ratio0.95", "gptq g64 router int8 L0 up int8",
            "gptq g64 router int8 L0 attention int8", "gptq g64 router int8 L0 up kv_a int8",
            "gptq g64 router int8 L0 down int8", "gptq g64 router int8 L0 down kv_a int8",
            "gptq router int8 L0 down-up int8", "gptq router int8 L0 down attention int8",
            "gptq g64 router int8 L0 down L1 shared down int8"}
MODELS = ("r1-distill-qwen-tiny", "r1-distill-llama-tiny", "deepseek-v2-lite-tiny", "deepseek-v3-tiny")


def recipe_for(model: str, label: str, options: dict, target: str) -> dict:
    name = f"{model}-fidelity-{label.replace(' ', '-').replace('+', '-')}"
    return {"name": name, "model": model, "passes": {"target": target},
            "compress": {**BASE, **options}, "compile": {"backend": target}, "eval": EVAL}


def bits(per_weight: list[dict]) -> dict:
    def share(rows) -> float:
        params = sum(int(np.prod(r["shape"])) for r in rows)
        return sum(r["bits_per_weight"] * int(np.prod(r["shape"])) for r in rows) / params

    linear = [r for r in per_weight if r["role"] not in ("embedding", "embeddings", "lm_head")]
    return {"all": share(per_weight), "linear": share(linear)}


def build_variant(model: str, label: str, options: dict, work: Path, env: dict, target: str) -> dict:
    suffix = "" if target == "openvino" else f"-{target}"
    recipe = work / "recipes" / f"{model}-{label.replace(' ', '_')}{suffix}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(yaml.safe_dump(recipe_for(model, label, options, target), sort_keys=False))
    out = work / "artifacts" / recipe.stem
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "toolchain", "build", str(recipe), "--out", str(out)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"model": model, "contender": f"dstc {label}{suffix}",
                "error": (done.stderr or done.stdout).strip()[-400:]}
    report = json.loads((out / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    stage = next(s for s in manifest["stages"] if s["name"] == "compress")
    compression = json.loads((Path(env["DSTC_CACHE_DIR"]) / "stages" / f"compress-{stage['id'][:20]}"
                              / "compression.json").read_text())
    metrics = report["metrics"]
    routing = report["series"]["routing_agreement_per_layer"]
    return {"model": model, "contender": f"dstc {label}{suffix}", "artifact": str(out),
            "build_s": round(time.perf_counter() - started, 1),
            "bits": bits(compression["per_weight"]),
            "kl": metrics["kl_mean"]["value"], "top1": metrics["top1_agreement"]["value"],
            "exact_match_drop": metrics.get("exact_match_drop", {}).get("value"),
            "routing_min": min(routing.values()) if routing else None,
            "routing_per_layer": routing}


def score_peer(contender: str, built: Path, artifact: Path, env: Path) -> dict:
    """The peer's next-token distributions on eval's sequences against eval's cached reference record."""
    import peer_fidelity

    from toolchain.evaluate.accuracy import compare_distributions
    from toolchain.evaluate.dataset import load_data
    from toolchain.models.train import END_OF_LINE
    from toolchain.reference.outputs import reference_record
    from toolchain.reference.record import first_scored
    from toolchain.runtime.artifact import open_artifact
    from toolchain.settings.evaluation import EvalSettings

    settings = EvalSettings(**EVAL)
    art = open_artifact(artifact)
    tokenizer = art.tokenizer()
    data = load_data(settings, tokenizer, task=True, max_length=int(art.config["max_position_embeddings"]))
    newline = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(END_OF_LINE))[0]
    record, _ = reference_record(art, data, settings, eos_ids=art.eos_token_ids, pad_id=art.pad_token_id,
                                     newline_id=newline)
    log_probs = peer_fidelity.log_probs(contender, built, [s.ids for s in data.sequences], env)
    kl, top1 = [], []
    for s, (sequence, lp) in enumerate(zip(data.sequences, log_probs)):
        row_kl, row_top1, _ = compare_distributions(lp, 0, sequence.ids, first_scored(sequence), record.top_ids[s],
                                                    record.top_logp[s], record.vocab)
        kl.append(row_kl)
        top1.append(row_top1)
    return {"kl": float(np.concatenate(kl).mean()), "top1": float(np.concatenate(top1).mean()),
            "positions": int(sum(len(k) for k in kl))}


def run_peers(model: str, artifact: Path, work: Path, env_dir: Path, contenders: list[str]) -> list[dict]:
    import peer_fidelity

    from toolchain.compress.calibration import load_texts
    from toolchain.models.registry import embedded_path
    from toolchain.stages.compress import CALIBRATION_SEQUENCES

    calibration = load_texts("embedded", CALIBRATION_SEQUENCES)  # what dstc's data-aware options calibrate on
    rows = []
    for contender in contenders:
        out = work / "peers" / model / contender
        row: dict = {"model": model, "contender": contender}
        try:
            row.update(peer_fidelity.build(contender, embedded_path(model), out, calibration, env_dir))
            row["bits"] = peer_fidelity.bits_per_weight(contender, out, env_dir)
            row.update(score_peer(contender, out, artifact, env_dir))
        except peer_fidelity.Skipped as e:
            row["skipped"] = str(e)
        rows.append(row)
        print(json.dumps(row, default=float), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | contender | bits/w all | bits/w linear | KL | top-1 | EM drop pts | routing min |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "kl" not in r:
            lines.append(f"| {r['model']} | {r['contender']} | – | – | {r.get('skipped') or r.get('error')} | | | |")
            continue
        b = r.get("bits") or {}
        em = r.get("exact_match_drop")
        routing = r.get("routing_min")
        lines.append(f"| {r['model']} | {r['contender']} | {b.get('all', float('nan')):.2f} | "
                     f"{b.get('linear', float('nan')):.2f} | {r['kl']:.2e} | {r['top1']:.4f} | "
                     f"{'' if em is None else f'{em:.1f}'} | {'' if routing is None else f'{routing:.3f}'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--target", choices=("openvino", "onnxruntime"), default="openvino",
                        help="dstc's builds (gptq runs on openvino only)")
    parser.add_argument("--peer-env", type=Path, default=None, help="the peers' environment (peer_env.sh)")
    parser.add_argument("--peers", nargs="*", default=None, help="peer contenders (default: all)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="dstc-fidelity-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSTC_CACHE_DIR": str(work / "cache")}
    os.environ["DSTC_CACHE_DIR"] = env["DSTC_CACHE_DIR"]  # the peers read the reference records the builds stored
    rows: list[dict] = []
    for model in args.models:
        moe = model.startswith("deepseek")
        first_artifact = None
        for label in args.variants:
            if label in MOE_ONLY and not moe:
                continue
            if label.startswith("gptq") and args.target != "openvino":
                continue
            row = build_variant(model, label, VARIANTS[label], work, env, args.target)
            rows.append(row)
            print(json.dumps(row, default=float), flush=True)
            first_artifact = first_artifact or row.get("artifact")
        if args.peer_env and first_artifact:
            import peer_fidelity

            rows += run_peers(model, Path(first_artifact), work, args.peer_env,
                              args.peers or list(peer_fidelity.CONTENDERS))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
