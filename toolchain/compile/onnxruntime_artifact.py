"""ONNX Runtime backend: model.onnx with ORT's portable offline optimisations applied, weights in external data,
and a genai_config.json for onnxruntime-genai where its config can describe the model.

Offline optimisation. ORT's *basic* level (constant folding, removal of redundant nodes, fusions that keep
standard ONNX ops) rewrites the graph with semantics-preserving rules that do not depend on the execution
provider or the CPU, so the saved graph stays a plain ONNX graph any ORT build (or another runtime) can load.
The extended and layout levels are not applied offline: they insert com.microsoft contrib ops and blocked
(NCHWc) layouts chosen for the provider and instruction set of the machine that saves the graph; ORT applies
them itself at session creation, on the machine that runs the model.

Interface: the graph keeps optimum's names (input_ids, attention_mask, position_ids, past_key_values.N.key /
.value -> logits, present.N.key / .value), which is what optimum's ORTModelForCausalLM and
onnxruntime-genai's decoder expect.

onnxruntime-genai. Its decoder runtime feeds the graph and keeps the KV cache itself; genai_config.json names
the inputs and outputs and gives the cache geometry: num_key_value_heads and one head_size, which its KV cache
allocates for both the key and the value tensors of a layer (per-layer sizes are read from the graph's key
input, and the value tensor is given the key's shape). DeepSeek's MLA caches keys of qk_nope_head_dim +
qk_rope_head_dim and values of v_head_dim (192 and 128 in V2/V3), so its cache cannot be described: no
genai_config.json is written for deepseek_v2 / deepseek_v3 and the manifest says why. Mixture-of-experts is
not a limit: routing happens inside the graph, which genai runs as a black box.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolchain.compile import ort_streamed
from toolchain.interface.files import GENAI_CONFIG, ONNX_MODEL, ONNX_WEIGHTS
from toolchain.interface.graph import GENAI_MODEL_TYPE, PAST_PREFIX, PRESENT_PREFIX, graph_cache_spec, graph_metadata
from toolchain.runtime.engines import ort_options, ort_session

# Initialisers smaller than this stay inside model.onnx (shapes, axes, scalars); the weights go to ONNX_WEIGHTS.
INLINE_MAX_BYTES = 1024


def optimize(src: Path, dst: Path) -> None:
    """Apply ORT's basic-level graph optimisations to src and save the result as dst + external weights."""
    ort_session(src, ort_options(level="basic", optimized_path=dst, optimized_external=ONNX_WEIGHTS,
                                 external_min_bytes=INLINE_MAX_BYTES))


def genai_model_type(onnx_path: Path) -> str | None:
    """onnxruntime-genai's model type, as the exporter wrote it from the architecture module (``dstc.genai_model_type``
    in the graph's metadata; empty where genai's config cannot describe the model)."""
    return graph_metadata(onnx_path).get(GENAI_MODEL_TYPE) or None


def genai_unsupported_reason(model_type: str, genai_type: str | None, dims: dict[str, tuple[int, int]]) -> str | None:
    # a cache without value tensors (DeepSeek-V4's K=V) has no pair to compare: its model type decides
    values = {k: dims.get(k.replace(".key", ".value")) for k in dims if k.endswith(".key")}
    mismatched = sorted({(dims[k][1], v[1]) for k, v in values.items() if v is not None and dims[k] != v})
    if mismatched:
        k, v = mismatched[0]
        return (f"the KV cache has keys of head dim {k} and values of head dim {v} (MLA); onnxruntime-genai's "
                f"config has one head_size for both, and its KV cache gives the value tensors the key's shape")
    if genai_type is None:
        return f"onnxruntime-genai has no model type for {model_type!r}"
    return None


def genai_config(config: dict, generation: dict, dims: dict[str, tuple[int, int]], genai_type: str) -> dict:
    heads, head_size = next(iter(dims.values()))
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    pad = config.get("pad_token_id")
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    context = config.get("max_position_embeddings", 2048)
    # genai's parser rejects null: a checkpoint without special token ids leaves them out
    token_ids = {"bos_token_id": generation.get("bos_token_id", config.get("bos_token_id")),
                 "eos_token_id": eos, "pad_token_id": pad}
    return {
        "model": {
            "type": genai_type,
            **{key: value for key, value in token_ids.items() if value is not None},
            "vocab_size": config["vocab_size"],
            "context_length": context,
            "decoder": {
                "filename": ONNX_MODEL,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "hidden_size": config["hidden_size"],
                "num_attention_heads": config["num_attention_heads"],
                "num_key_value_heads": heads,
                "num_hidden_layers": len(dims) // 2,
                "head_size": head_size,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids",
                           "past_key_names": f"{PAST_PREFIX}%d.key", "past_value_names": f"{PAST_PREFIX}%d.value"},
                "outputs": {"logits": "logits",
                            "present_key_names": f"{PRESENT_PREFIX}%d.key",
                            "present_value_names": f"{PRESENT_PREFIX}%d.value"},
            },
        },
        "search": {
            # The graph concatenates the past with the new keys into present.* of the total length, so past and
            # present cannot share one preallocated buffer.
            "past_present_share_buffer": False,
            "max_length": context,
            "min_length": 0,
            "do_sample": bool(generation.get("do_sample", False)),
            "temperature": generation.get("temperature", 1.0),
            "top_k": generation.get("top_k", 50),
            "top_p": generation.get("top_p", 1.0),
            "repetition_penalty": generation.get("repetition_penalty", 1.0),
            "num_beams": 1,
            "num_return_sequences": 1,
            "early_stopping": True,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


def write(onnx_path: Path, out_dir: Path, config: dict, generation: dict, log: Callable[[str], None],
          release_input: Callable[[], None] | None = None) -> dict:
    """``release_input``: the input's weights may be given up as the artifact's are written (its entry is deleted
    after: toolchain/compile/ort_streamed.py); called before they are touched."""
    import json

    log("applying ONNX Runtime's basic graph optimisations; weights to external data")
    if release_input is None or not ort_streamed.optimize_releasing(onnx_path, out_dir / ONNX_MODEL, INLINE_MAX_BYTES,
                                                                    release_input, log):
        optimize(onnx_path, out_dir / ONNX_MODEL)
    files = [ONNX_MODEL] + ([ONNX_WEIGHTS] if (out_dir / ONNX_WEIGHTS).exists() else [])
    dims = graph_cache_spec(out_dir / ONNX_MODEL)
    genai_type = genai_model_type(onnx_path)
    reason = genai_unsupported_reason(config["model_type"], genai_type, dims)
    if reason is None:
        assert genai_type is not None  # genai_unsupported_reason gives a reason when it is None
        (out_dir / GENAI_CONFIG).write_text(json.dumps(genai_config(config, generation, dims, genai_type), indent=2)
                                            + "\n")
        files.append(GENAI_CONFIG)
    else:
        log(f"no {GENAI_CONFIG}: {reason}")
    return {"files": files, "optimization_level": "basic", "genai_config": reason is None,
            "genai_unsupported_reason": reason}
