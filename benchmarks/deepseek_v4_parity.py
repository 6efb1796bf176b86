"""DeepSeek-V4's exported graph against transformers on random configs other than the test suite's: prefill plus
--steps greedy decode steps (64 by default) on ONNX Runtime, OpenVINO (stateless, as parity runs it) and the
stateful OpenVINO IR (toolchain/compile/openvino_ir.py, exact numerics), with the cache's bytes per token and
layer type as the graph declares them.

Each config is random in its seed (weights, and the constants transformers leaves at zero: tests/conftest.py
randomize_v4_initial_constants) and differs from tests/conftest.py's V4 in its widths, hc_mult, window, rates,
top-k and, for "yarn", a YaRN compress rotary. The graph is built from the checkpoint through dstc's reader, as
`dstc export` builds it; the reference is the model transformers' own from_pretrained loads.

    PYTHONPATH=. .venv/bin/python benchmarks/deepseek_v4_parity.py --workdir /tmp/v4-parity --json v4_parity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import make_checkpoint  # tests/ holds the random-checkpoint writer

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CONFIGS = {
    # V4-Flash's proportions scaled down: head_dim 64 of which 8 rotary, MQA, 4 streams
    "flash-like": dict(hidden_size=128, num_attention_heads=8, head_dim=64, partial_rotary_factor=0.125, q_lora_rank=48,
                       o_groups=4, o_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=48, sliding_window=16,
                       compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
                       index_n_heads=16, index_head_dim=32, index_topk=6, hc_mult=4, hc_sinkhorn_iters=20,
                       swiglu_limit=0.2, routed_scaling_factor=1.5,
                       layer_types=[HCA, CSA, HCA, CSA, SLIDING], mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 2),
    "yarn": dict(hidden_size=96, num_attention_heads=6, head_dim=48, partial_rotary_factor=1 / 3, q_lora_rank=32,
                 o_groups=3, o_lora_rank=24, n_routed_experts=12, num_experts_per_tok=3, moe_intermediate_size=40,
                 sliding_window=12,
                 compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 24},
                 index_n_heads=12, index_head_dim=24, index_topk=4, hc_mult=2, hc_sinkhorn_iters=7,
                 swiglu_limit=0.3, routed_scaling_factor=2.0, scoring_func="sqrtsoftplus",
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                  "beta_fast": 32.0, "beta_slow": 1.0},
                 layer_types=[CSA, SLIDING, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"]),
}


def prompts(vocab: int, seed: int) -> list:
    from toolchain.verify.parity import Case

    rng = np.random.default_rng(seed)
    return [Case("short", [rng.integers(0, vocab, 3).tolist()]),
            Case("long", [rng.integers(0, vocab, 70).tolist()]),
            Case("batch2-left-padded", [rng.integers(0, vocab, 29).tolist(), rng.integers(0, vocab, 9).tolist()])]


def run(name: str, seed: int, steps: int, workdir: Path) -> dict:
    import onnx_ir as ir
    import openvino as ov
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    from toolchain import source as sources
    from toolchain.checkpoint.reader import open_checkpoint
    from toolchain.compile.openvino_ir import convert
    from toolchain.export.architectures import architecture_for
    from toolchain.export.decoder import build_decoder
    from toolchain.export.graph import save_graph
    from toolchain.interface.graph import cache_bytes_per_token
    from toolchain.reference.whole import TorchDecoder
    from toolchain.runtime.decoder import OpenVINODecoder
    from toolchain.verify.parity import OPENVINO_TOLERANCE, TOLERANCES, compare, compare_decoders

    config = DeepseekV4Config(vocab_size=211, num_hidden_layers=len(CONFIGS[name]["layer_types"]),
                              max_position_embeddings=512, **CONFIGS[name])
    out = workdir / f"{name}-{seed}"
    make_checkpoint(config, out / "ckpt", seed)
    model = AutoModelForCausalLM.from_pretrained(out / "ckpt", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    source = sources.resolve(str(out / "ckpt"))
    with open_checkpoint(source.path) as reader:
        save_graph(build_decoder(sources.skeleton(source, reader), architecture_for("deepseek_v4"), reader),
                   out / "model.onnx")
    cases = prompts(config.vocab_size, seed)
    results = {}
    for backend in ("onnxruntime", "openvino"):
        results[backend] = compare(TorchDecoder.over(model), out / "model.onnx", backend, cases, steps, pad_id=0)
    ov.save_model(convert(out / "model.onnx", {}), str(out / "stateful.xml"), compress_to_fp16=False)
    results["openvino-stateful"] = compare_decoders(
        TorchDecoder.over(model), lambda: OpenVINODecoder(out / "stateful.xml", None, (), "exact"), cases, steps,
        0, OPENVINO_TOLERANCE)
    per_type = cache_bytes_per_token([(v.name, v.shape, v.dtype.itemsize)
                                      for v in ir.load(out / "model.onnx").graph.inputs], config.layer_types)
    return {"config": name, "seed": seed, "steps": steps, "tolerances": TOLERANCES,
            "cache_bytes_per_token_per_layer": per_type,
            "parity": {b: {k: r[k] for k in ("passed", "max_relative_diff", "tokens_identical")} |
                       {"cases": [(c["name"], c["prompt_lengths"], c["relative_diff"]) for c in r["cases"]]}
                       for b, r in results.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12])
    args = parser.parse_args()
    rows = []
    for name in CONFIGS:
        for seed in args.seeds:
            rows.append(row := run(name, seed, args.steps, args.workdir))
            for backend, result in row["parity"].items():
                print(f"{row['config']:<11} seed {row['seed']:<3} {backend:<18} passed {result['passed']!s:<5} "
                      f"max rel diff {result['max_relative_diff']:.2e}", flush=True)
            print(f"{'':<11} cache bytes per token and layer: {row['cache_bytes_per_token_per_layer']}", flush=True)
            if args.json:  # written as each row completes
                args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
