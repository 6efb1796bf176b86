"""Per-runtime pipelines: which passes run for ONNX Runtime and for OpenVINO, and what they must achieve.

Both start with the same generic part (:data:`GENERIC`): shapes, constant folding, BatchNormalization folding,
Transpose elimination, dead-code removal and common subexpressions, then shapes again. BN folding and Transpose
elimination change nothing on the exported decoders (they have neither BatchNormalization nor removable
Transposes); they are there for graphs that do.

* ``onnxruntime``: the generic part, then every fusion into the kernels ORT only runs when the graph names them
  (SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, RotaryEmbedding, GroupQueryAttention, ONNX
  Attention for MLA over its per-head cache, QuickGelu), MatMul+Add -> Gemm where 2-D, cleanups.
* ``openvino``: the generic part and standard ops only; OpenVINO fuses SDPA, RMSNorm and RoPE itself when it
  compiles, so the graph is only reshaped where its fusions would miss: ``rotate-half-split`` for RoPE. Its
  SDPA fusion fires on the exported attention as is (in the stateful IR the compile stage makes: the CPU plugin
  keeps SDPA only in stateful models), and so does its RMS fusion.

:func:`default_expectations` gives each fusion's expected count for an attention kind and depth (from the
``dstc.attention`` / ``dstc.num_layers`` / ``dstc.kv_cache`` / ``dstc.moe_layers`` / ``dstc.moe_lowering``
metadata the exporter writes from the architecture module), so a fusion that misses a layer fails the pipeline
with the pass's closest near-miss.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from passes.errors import PassError
from passes.graph_contract import ATTENTION, KV_CACHE, LATENT, MOE_LAYERS, MOE_LOWERING, NUM_LAYERS, ROTATIONS_PER_LAYER

GENERIC = ["infer-shapes", "fold-constants", "fold-batchnorm", "eliminate-transposes", "remove-unused", "cse",
           "infer-shapes"]

PIPELINES: dict[str, list[str]] = {
    "onnxruntime": [
        *GENERIC,
        "fuse-rms-norm", "fuse-skip-rms-norm", "fuse-rotary-embedding",
        "fuse-group-query-attention", "fuse-mla-attention", "fuse-silu", "fuse-matmul-add-gemm",
        "cse", "remove-unused",
    ],
    "openvino": [*GENERIC, "rotate-half-split", "remove-unused"],
}

ATTENTION_KINDS = ("gqa", "mla")  # what the exporter's architecture module says its attention is


def pipeline(target: str) -> list[str]:
    if target not in PIPELINES:
        raise PassError(f"unknown target {target!r}; targets: {', '.join(PIPELINES)}")
    return list(PIPELINES[target])


def model_info(model: ir.Model) -> tuple[str | None, int | None]:
    """(attention kind, num_layers) from the metadata dstc's exporter writes (``dstc.attention``, from the
    architecture module); None where absent."""
    props = model.metadata_props
    layers = props.get(NUM_LAYERS)
    return props.get(ATTENTION), int(layers) if layers and layers.isdigit() else None


def default_expectations(target: str, attention: str | None, num_layers: int | None,
                         kv_cache: str | None = None, opaque_mlps: int = 0,
                         rotations_per_layer: int = 2) -> dict[str, dict]:
    """Expected counts per pass for a decoder of ``num_layers`` layers whose attention is ``attention`` ("gqa"
    or "mla"; none for a graph of unknown kind) over a ``kv_cache`` ("per-head", or MLA's "latent"), rotating
    ``rotations_per_layer`` tensors by RoPE in each layer, of which ``opaque_mlps`` MoE layers run their experts
    in one com.microsoft.MoE node (the fused-onnxruntime lowering), with no SiLU outside it unless the layer has
    shared experts."""
    pipeline(target)
    if attention not in ATTENTION_KINDS or not num_layers:
        return {}
    layers = num_layers
    rotated = rotations_per_layer * layers
    rotations = {"min": rotated, "max": rotated}
    if target == "openvino":
        return {"rotate-half-split": rotations}
    expectations: dict[str, dict] = {
        # input and post-attention norm of every layer and the final norm (MLA adds its own latent norms)
        "fuse-rms-norm": {"min": 2 * layers + 1},
        # every norm but the first layer's input norm follows a residual Add
        "fuse-skip-rms-norm": {"min": 2 * layers, "max": 2 * layers},
        "fuse-rotary-embedding": {**rotations, "count": "rotary_embedding"},
        "fuse-silu": {"min": layers - opaque_mlps},
    }
    if attention == "gqa":
        expectations["fuse-group-query-attention"] = {"min": layers, "max": layers}
    elif kv_cache == LATENT:
        # scores over the latent cache are two products (q_lat latent^T + q_rot k_rot^T) that no attention op
        # takes; the graph stays as it is, to ORT's own MatMul fusions
        expectations["fuse-group-query-attention"] = {"max": 0}
        expectations["fuse-mla-attention"] = {"max": 0}
    else:  # GQA declines MLA (also where K and V head sizes are equal), which fuse-mla-attention then takes
        expectations["fuse-group-query-attention"] = {"max": 0}
        expectations["fuse-mla-attention"] = {"min": layers, "max": layers, "count": "mla"}
    return expectations


def expectations_for(model: ir.Model, target: str, pass_names: list[str] | None = None) -> dict[str, dict]:
    """:func:`default_expectations` for ``model``, restricted to the passes in ``pass_names`` when given."""
    props = model.metadata_props
    opaque = len(json.loads(props.get(MOE_LAYERS, "[]"))) \
        if props.get(MOE_LOWERING) == "fused-onnxruntime" else 0
    # q and k in every layer, where the exporter does not say otherwise (DeepSeek-V3.2's indexer rotates two more)
    rotations = int(props.get(ROTATIONS_PER_LAYER) or 2)
    expectations = default_expectations(target, *model_info(model), kv_cache=props.get(KV_CACHE),
                                        opaque_mlps=opaque, rotations_per_layer=rotations)
    if pass_names is not None:
        expectations = {name: spec for name, spec in expectations.items() if name in pass_names}
    return expectations
