"""DeepSeek-V4's KV cache at long context: the bytes dstc's graph carries and transformers' cache objects hold
after a prefill of T tokens, per layer type, beside DeepSeek-V3's latent cache; then whole models (V4-Flash's 43
layers, V3's 61) at 8k and 64k tokens.

What a cache holds depends on its widths (V4: head_dim, index_head_dim; V3: kv_lora_rank, qk_rope_head_dim), V4's
compress rates and sliding window only — not on the hidden size, query heads, experts or vocabulary (V4 attention
is MQA: one K=V head whatever the query heads). So the models here have V4-Flash's and V3's real cache widths,
rates and window, and tiny everything else; each is prefilled with T tokens on ONNX Runtime (dstc's graph: the
bytes of its present.* outputs) and, for V4, in transformers (the bytes of every tensor its cache layers hold).
Bytes grow linearly in T past the window (checked at two lengths: the figure per token is the slope), and whole
models at 8k / 64k tokens are those slopes and constants times the real layer counts, float32 caches throughout.
V4 is exported twice, with its per-token state and its compressed cache (export.v4_cache: compressed: a bounded
window, the pooled entries, the incomplete window's tail); the compressed graph's whole-model figures are also
computed from its cache inputs and their length rules alone (toolchain/interface/graph.py cache_bytes_at), which
the measured bytes must match.

    PYTHONPATH=. .venv/bin/python benchmarks/v4_cache.py --workdir /tmp/v4-cache --json v4_cache.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import make_checkpoint  # noqa: E402  # tests/ holds the random-checkpoint writer

from benchmarks.harness import markdown_table  # noqa: E402

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
REFERENCES = REPO / "toolchain" / "models" / "reference_configs"
TINY = dict(vocab_size=300, hidden_size=64, num_attention_heads=2, max_position_embeddings=65536)
LENGTHS = (2048, 8192)
CONTEXTS = (8192, 65536)


def v4_config():
    from transformers import DeepseekV4Config

    real = json.loads((REFERENCES / "deepseek-v4-flash.json").read_text())
    real = DeepseekV4Config(**{k: v for k, v in real.items() if k not in ("_source", "quantization_config")})
    cache = {k: getattr(real, k) for k in ("head_dim", "index_head_dim", "sliding_window", "compress_rates",
                                           "partial_rotary_factor", "compress_rope_theta", "index_topk")}
    return DeepseekV4Config(**TINY, **cache, num_hidden_layers=3, layer_types=[SLIDING, CSA, HCA],
                            mlp_layer_types=["moe"] * 3, num_hash_layers=0, index_n_heads=2, q_lora_rank=32,
                            o_groups=2, o_lora_rank=32, n_routed_experts=2, num_experts_per_tok=1,
                            moe_intermediate_size=32, hc_mult=2), real


def v3_config():
    from transformers import DeepseekV3Config

    real = json.loads((REFERENCES / "deepseek-v3.json").read_text())
    real = DeepseekV3Config(**{k: v for k, v in real.items() if k not in ("_source", "quantization_config")})
    return DeepseekV3Config(**TINY, num_key_value_heads=2, num_hidden_layers=1, kv_lora_rank=real.kv_lora_rank,
                            qk_rope_head_dim=real.qk_rope_head_dim, qk_nope_head_dim=16, v_head_dim=16,
                            q_lora_rank=32, intermediate_size=64, first_k_dense_replace=1, n_routed_experts=2,
                            num_experts_per_tok=1, n_group=1, topk_group=1), real


def tensor_bytes(value, seen: set[int] | None = None) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or a dict / list / tuple of them), each storage once: V4's
    cache layers hold K=V as ``keys`` and ``values`` of one storage."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        if value.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(value.untyped_storage().data_ptr())
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v, seen) for v in value)
    return 0


def dstc_bytes(graph: Path, length: int, layer_types: list[str]) -> dict[str, int]:
    """Bytes of each layer's present.* after an ONNX Runtime prefill of ``length`` tokens."""
    from toolchain.runtime.decoder import ort_cache
    from toolchain.runtime.engines import ort_options, ort_session

    session = ort_session(graph, ort_options())
    ids = np.random.default_rng(0).integers(1, 300, (1, length), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(length)[None]}
    for name, (heads, dim, dtype) in ort_cache(session).items():
        feeds[name] = np.zeros([1, heads, 0, dim], dtype)
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(names, feeds), strict=True))
    grown: dict[str, int] = {}
    for name, value in out.items():
        if name.startswith("present."):
            kind = layer_types[int(name.split(".")[1])]
            grown[kind] = grown.get(kind, 0) + value.nbytes
    return grown


def transformers_bytes(model, length: int) -> dict[str, int]:
    ids = torch.from_numpy(np.random.default_rng(0).integers(1, 300, (1, length))).long()
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return {model.config.layer_types[i]: tensor_bytes(vars(layer)) for i, layer in enumerate(cache.layers)}


def fit(a: dict[str, int], b: dict[str, int]) -> dict[str, tuple[float, float]]:
    """{layer type: (bytes per token, constant bytes)} from the bytes at LENGTHS."""
    (t1, t2) = LENGTHS
    return {k: ((b[k] - a[k]) / (t2 - t1), a[k] - (b[k] - a[k]) / (t2 - t1) * t1) for k in a}


def from_graph(graph: Path, types: list[str], real) -> dict[str, float]:
    """{context: whole-model bytes} of a graph's cache at CONTEXTS from its cache inputs and length rules alone: each
    layer type's bytes (one layer of it in ``graph``) times its count in the real model."""
    import onnx_ir as ir

    from toolchain.interface.graph import cache_bytes_at, graph_metadata

    inputs = [(v.name, v.shape, v.dtype.itemsize) for v in ir.load(graph).graph.inputs]
    metadata = graph_metadata(graph)
    whole = {}
    for context in CONTEXTS:
        per_type = {kind: cache_bytes_at([i for i in inputs if i[0].startswith(f"past_key_values.{layer}.")],
                                         metadata, context) for layer, kind in enumerate(types)}
        whole[str(context)] = sum(per_type[kind] for kind in real.layer_types)
    return whole


def main() -> None:
    from transformers import AutoModelForCausalLM

    from toolchain import source as sources
    from toolchain.checkpoint.reader import open_checkpoint
    from toolchain.export.architectures import architecture_for
    from toolchain.export.decoder import build_decoder
    from toolchain.export.deepseek_v4 import with_v4_cache
    from toolchain.export.graph import save_graph

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows, figures = [], {}
    for family, (config, real) in (("V4-Flash", v4_config()), ("V3", v3_config())):
        out = args.workdir / family
        make_checkpoint(config, out / "ckpt", 0)
        source = sources.resolve(str(out / "ckpt"))
        layouts = {"dstc": None, "dstc compressed": "compressed"} if family == "V4-Flash" else {"dstc": None}
        with open_checkpoint(source.path) as reader:
            for holder, layout in layouts.items():
                arch = with_v4_cache(architecture_for(config.model_type), layout)
                (out / holder).mkdir(parents=True, exist_ok=True)
                save_graph(build_decoder(sources.skeleton(source, reader), arch, reader), out / holder / "model.onnx")
        types = list(getattr(config, "layer_types", None) or ["attention"] * config.num_hidden_layers)
        measured = {holder: [dstc_bytes(out / holder / "model.onnx", t, types) for t in LENGTHS] for holder in layouts}
        if family == "V4-Flash":
            figures["V4-Flash dstc compressed, from the graph"] = from_graph(out / "dstc compressed" / "model.onnx",
                                                                            types, real)
            model = AutoModelForCausalLM.from_pretrained(out / "ckpt", dtype=torch.float32,
                                                         attn_implementation="eager").eval()
            measured["transformers"] = [transformers_bytes(model, t) for t in LENGTHS]
        real_types = list(getattr(real, "layer_types", None) or ["attention"] * real.num_hidden_layers)
        for holder, (a, b) in measured.items():
            slopes = fit(a, b)
            figures[f"{family} {holder}"] = {"measured": dict(zip(map(str, LENGTHS), (a, b), strict=True)),
                                             "per_token_and_constant": slopes}
            for kind, (per_token, constant) in slopes.items():
                rows.append([family, holder, kind, f"{per_token:.0f}", f"{constant / 1024:.0f}"])
            whole = {c: sum(slopes[k][0] * c + slopes[k][1] for k in real_types if k in slopes) for c in CONTEXTS}
            figures[f"{family} {holder}"]["whole_model_bytes"] = whole
            rows.append([family, holder, f"whole model ({len(real_types)} layers)", "",
                         " / ".join(f"{whole[c] / 2**30:.2f} GiB at {c // 1024}k" for c in CONTEXTS)])
    whole = figures["V4-Flash dstc compressed, from the graph"]
    rows.append(["V4-Flash", "dstc compressed, from its cache inputs", "whole model (43 layers)", "",
                 " / ".join(f"{whole[str(c)] / 2**30:.2f} GiB at {c // 1024}k" for c in CONTEXTS)])
    print(markdown_table(["model", "cache", "layer type", "bytes per token", "constant KiB"], rows))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
