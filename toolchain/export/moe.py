"""Lowerings of a MoE layer's routed experts, chosen at export (``dstc export --moe``, recipe ``export.moe``) and
recorded in the graph's metadata (``dstc.moe_lowering``), where compression, routing agreement and the runtime read
it.

The router runs in the graph in every lowering (toolchain/export/routers.py): its TopK indices and weights are
computed exactly as transformers computes them, at run time. What differs is how the chosen experts run:

* ``dispatch`` (``dispatch`` below): per expert, NonZero picks its tokens and three 2-D MatMuls run on them;
  ~20 nodes per expert. Any runtime; but every idle expert still costs its nodes at each step and at session
  creation (measured in benchmarks/moe_decode.py).
* ``fused-onnxruntime``: one ``com.microsoft.MoE`` node per layer over stacked weights (fc1 [E, 2I, H] with gate
  and up rows interleaved, as ORT's CPU kernel requires with ``swiglu_fusion=1``; fc2 [E, H, I]). ORT's kernel
  softmaxes router_probs over all experts, takes the top k and weighs each expert by its softmax value
  (onnxruntime/contrib_ops/cpu/moe/moe_cpu.cc). It is fed log(w) at the chosen experts and the float32 minimum
  elsewhere, so it picks exactly the graph's experts with weights w / sum(w); the output is multiplied by sum(w).
  The compress stage turns the node into ``com.microsoft.QMoE`` (toolchain/compress/moe.py), which takes the
  same router input (its top k of router_probs, softmaxed over those k). ONNX Runtime only: OpenVINO's ONNX
  frontend has no MoE.
* ``fused-openvino``: the "tiled" MoE block OpenVINO's CPU plugin (2026.4) rewrites into GatherMatmul
  (ConvertTiledMoeBlockTo3GatherMatmuls, run in ConvertToCPUSpecificOpset): the tokens tiled over the experts,
  three MatMuls with ``transpose_b`` against expert-major [E, out, in] constants (com.microsoft.FusedMatMul
  transB=1, which OpenVINO's ONNX frontend reads as that MatMul), SiLU and the routing weights scattered into
  [tokens, E]. GatherMatmul computes the chosen experts only. ONNX Runtime runs the graph exactly too, but densely
  (every expert on every token), so it is for OpenVINO.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from toolchain.errors import InputError
from toolchain.export import blocks
from toolchain.export.decoder import Architecture
from toolchain.export.graph import GraphBuilder
from toolchain.export.weights import HFModule, LazyArray
from toolchain.interface.moe_lowerings import (  # AUTO, BACKENDS: re-exported for moe.AUTO / moe.BACKENDS
    AUTO as AUTO,
    BACKENDS as BACKENDS,
    LOWERINGS,
    RUNS_ON,
    parity_backends,
)

# From this many routed experts on, the fused forms decode faster than dispatch on both backends whatever the
# precision: benchmarks/moe_decode.py (V3-style, 8 active experts, 2 threads, docs/deepseek-generations.md "Export",
# export.moe), decode ms/token at 16 -> 256 experts, ONNX Runtime INT4 dispatch 5.0 -> 30.4, fused 3.4 -> 4.1;
# OpenVINO INT4 dispatch 6.6 -> 45.6, fused 4.0 -> 4.1. Below it, OpenVINO's fused block prefills 2-2.7x slower
# than dispatch, and ONNX Runtime's float32 MoE kernel decoded 1.2x slower than dispatch at 16 experts (its QMoE
# 1.9x faster).
FUSED_FROM_EXPERTS = 64


def auto_lowering(backend: str | None, experts: int, scheme: str | None, gptq_or_ratio: bool,
                  parity: tuple[str, ...] | None = None, storage: str = "float32",
                  lowerings: tuple[str, ...] = LOWERINGS) -> tuple[str, str]:
    """The lowering ``auto`` picks, and why: for a build on ``backend`` (None: an export alone, for no runtime in
    particular) of a model with ``experts`` routed experts (0: dense), whose weights the build compresses with
    ``scheme`` (None: not compressed; ``gptq_or_ratio``: with GPTQ or ratio < 1), whose parity is asked on
    ``parity`` (None: the default), whose export stores its matrices as ``storage`` (toolchain/export/weights.py
    storage_for) and whose architecture builds its experts in ``lowerings`` (MoeArchitecture.lowerings)."""
    if backend is None:
        return "dispatch", "no target backend: the form every runtime runs"
    if not experts:
        return "dispatch", "no MoE layer"
    if lowerings == ("dispatch",):
        return "dispatch", "the architecture's experts have no fused form"
    # the compress stage refuses both with a fused lowering (toolchain/compress/moe.py, stages/compress.py)
    if gptq_or_ratio:
        return "dispatch", "gptq and ratio < 1 see the dispatch form's experts only"
    if scheme == "shipped":
        return "dispatch", "the shipped scheme keeps the dispatch form's expert weights as they ship"
    # StackedExperts are float32 only: where dispatch's experts would be bf16, a fused export doubles their bytes
    # on disk (45 GB instead of 22.5 per DeepSeek-V3 MoE layer), and the disk bound of large builds comes first
    if storage == "bfloat16":
        return "dispatch", "the fused forms store experts in float32, twice the bf16 export's bytes at this size"
    compressed = scheme is not None
    if backend == "onnxruntime" and (compressed or experts >= FUSED_FROM_EXPERTS):
        choice = "fused-onnxruntime"
    elif backend == "openvino" and experts >= FUSED_FROM_EXPERTS:
        choice = "fused-openvino"
    else:
        return "dispatch", f"{experts} experts on {backend}: dispatch measured faster below {FUSED_FROM_EXPERTS}"
    if parity is not None and any(b not in RUNS_ON[choice] for b in parity):
        return "dispatch", f"parity asked on {', '.join(parity)}, which {choice} does not run on"
    return choice, f"{experts} experts on {backend}{', compressed' if compressed else ''}"
MS_DOMAIN = "com.microsoft"


def lower(arch: Architecture, lowering: str, parity: tuple[str, ...] | None) -> tuple[Architecture, tuple[str, ...]]:
    """For an export: the architecture lowered as ``lowering`` and the backends to check it on (``parity``, or when
    None every backend that runs the graph; a dense model's graph runs on both)."""
    arch = with_lowering(arch, lowering)
    return arch, parity_backends(arch.moe_lowering or "dispatch", parity)


def with_lowering(arch: Architecture, lowering: str) -> Architecture:
    """The architecture with its MoE layers lowered as ``lowering``; a dense family (``moe_lowering`` None) as it
    is: it has no MoE layer to lower."""
    if lowering not in LOWERINGS:
        raise InputError(f"unknown MoE lowering {lowering!r}; lowerings: {', '.join(LOWERINGS)}")
    if arch.moe_lowering is None or lowering == arch.moe_lowering:
        return arch
    arch = copy.copy(arch)
    arch.moe_lowering = lowering
    return arch


@dataclass(frozen=True)
class StackedExperts(LazyArray):
    """[E, rows, cols] float32 of every expert's matrices, read expert by expert when written. Each entry of
    ``experts`` holds one expert's [r, cols] sources (numpy or LazyArray); with two, their rows are interleaved
    (row i of the first, then row i of the second). Always float32: bf16 storage (toolchain/export/weights.py) is
    for the 2-D weights; the compress stage's fused-expert path (toolchain/compress/moe.py) reads float32 ones."""

    experts: tuple = ()

    def chunks(self, dtype: torch.dtype = torch.float32) -> Iterator[np.ndarray]:
        if dtype != torch.float32:
            raise ValueError("stacked experts are stored in float32")
        for sources in self.experts:
            parts = [s.materialize() if isinstance(s, LazyArray) else np.asarray(s, np.float32) for s in sources]
            yield np.stack(parts, axis=1).reshape(-1) if len(parts) > 1 else parts[0].reshape(-1)


def _stacked(experts: list[tuple], rows: int, cols: int) -> StackedExperts:
    return StackedExperts((len(experts), rows, cols), read=None, experts=tuple(experts))


def routed_experts(g: GraphBuilder, lowering: str, x2d: ir.Value, topk_idx: ir.Value, topk_w: ir.Value,
                   experts: HFModule, top_k: int, limit: float | None = None) -> ir.Value:
    """The routed experts' weighted sum [tokens, hidden] for the router's choice (topk_idx, topk_w: [tokens, k]);
    ``limit``: clipped SwiGLU experts, which only dispatch lowers (an architecture with them refuses the others)."""
    if lowering == "dispatch":
        return dispatch(g, x2d, topk_idx, topk_w, experts, limit=limit)
    if limit is not None:
        raise ValueError(f"the {lowering} MoE lowering has no clipped SwiGLU experts")
    weights = [g.params.expert(experts, e) for e in range(experts.gate_up_proj.shape[0])]
    inter, hidden = experts.gate_up_proj.shape[1] // 2, experts.gate_up_proj.shape[2]
    with g.scope("experts"):
        if lowering == "fused-onnxruntime":
            return _ort_moe(g, x2d, topk_idx, topk_w, weights, inter, hidden, top_k)
        return _openvino_tiled(g, x2d, topk_idx, topk_w, weights, inter, hidden)


def dispatch(g: GraphBuilder, x2d: ir.Value, topk_idx: ir.Value, topk_w: ir.Value, experts: HFModule,
             limit: float | None = None) -> ir.Value:
    """Routed experts, sparse and routed at run time: each expert runs only on the tokens sent to it.

    For expert e: tokens = NonZero(any(topk_idx == e)); y = expert_e(x[tokens]) * weight; ScatterND-add into the
    output. The loop over experts is unrolled at export (a fixed count) while the token sets stay dynamic, so the
    work is the routed experts' own; no weights are copied per token (unlike transformers' batched_mm) and no
    routing decision is frozen at export (unlike tracing its eager loop). Experts accumulate in index order, as
    transformers' index_add_ does. Each expert keeps plain 2-D MatMul weights, the form weight compression handles.

    ``experts``: transformers' fused-experts module; each expert's weights come from ``g.params.expert``.
    ``limit``: the experts' clipped SwiGLU (blocks.gated_mlp).
    """
    num_experts = experts.gate_up_proj.shape[0]
    with g.scope("experts"):
        out = g.op("ConstantOfShape", g.op("Shape", x2d), value=ir.tensor(np.zeros(1, np.float32)))
        for e in range(num_experts):
            with g.scope(str(e)):
                chosen = g.op("Cast", g.op("Equal", topk_idx, g.const(e)), to=ir.DataType.FLOAT)
                tokens = g.op("Squeeze", g.op("NonZero", g.op("ReduceSum", chosen, g.const([1]), keepdims=0)),
                              g.const([0]))
                weight = g.op("ReduceSum", g.op("Mul", chosen, topk_w), g.const([1]), keepdims=0)
                gate, up, down = g.params.expert(experts, e)
                y = blocks.gated_mlp(g, g.op("Gather", x2d, tokens, axis=0), gate, up, down, limit=limit)
                y = g.op("Mul", y, g.op("Unsqueeze", g.op("Gather", weight, tokens, axis=0), g.const([1])))
                out = g.op("ScatterND", out, g.op("Unsqueeze", tokens, g.const([1])), y, reduction="add")
        return out


def _ort_moe(g, x2d, topk_idx, topk_w, weights, inter, hidden, top_k):
    num_experts = len(weights)
    fill = g.op("ConstantOfShape", g.op("Concat", g.op("Shape", topk_w, end=1), g.const([num_experts]), axis=0),
                value=ir.tensor(np.array([blocks.MASK_MIN], np.float32)))
    # exp(float32 min - max) is 0: the idle experts get no weight in MoE's softmax and lose QMoE's top k
    probs = g.op("ScatterElements", fill, topk_idx, g.op("Log", topk_w), axis=1)
    fc1 = g.weight("gate_up_proj", _stacked([(gate, up) for gate, up, _ in weights], 2 * inter, hidden))
    fc2 = g.weight("down_proj", _stacked([(down,) for _, _, down in weights], hidden, inter))
    y = g.op("MoE", x2d, probs, fc1, None, fc2, domain=MS_DOMAIN, k=top_k, activation_type="swiglu",
             swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=0)
    # ONNX's shape inference has no com.microsoft schemas: the type is stated so that it flows on to later nodes
    # (the passes stage's fusions need the shapes)
    y.dtype, y.shape = ir.DataType.FLOAT, ir.Shape([None, hidden])
    return g.op("Mul", y, g.op("ReduceSum", topk_w, g.const([1]), keepdims=1))


def _openvino_tiled(g, x2d, topk_idx, topk_w, weights, inter, hidden):
    num_experts = len(weights)
    by_expert = g.const([num_experts, -1, hidden])
    xe = g.op("Reshape", g.op("Tile", x2d, g.const([num_experts, 1])), by_expert)

    def project(x, name, parts, rows, cols):
        # transB: OpenVINO's pattern wants MatMul(transpose_b); a Transpose of the constant would be folded away
        # by constant folding (onnxscript folds any Transpose of a single-use constant), and with it the fusion
        y = g.op("FusedMatMul", x, g.weight(name, _stacked([(p,) for p in parts], rows, cols)), domain=MS_DOMAIN,
                 transB=1)
        y.dtype, y.shape = ir.DataType.FLOAT, ir.Shape([num_experts, None, rows])  # see the MoE node's
        return y

    gate = project(xe, "gate_proj", [w[0] for w in weights], inter, hidden)
    up = project(xe, "up_proj", [w[1] for w in weights], inter, hidden)
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    # a no-op Reshape, but the pattern's: it ends the experts' branch before the routing weights' Multiply
    down = g.op("Reshape", project(act, "down_proj", [w[2] for w in weights], hidden, inter), by_expert)
    zeros = g.op("ConstantOfShape", g.op("Concat", g.op("Shape", topk_w, end=1), g.const([num_experts]), axis=0),
                 value=ir.tensor(np.zeros(1, np.float32)))
    dense = g.op("ScatterElements", zeros, topk_idx, topk_w, axis=1)  # [tokens, E], zero for idle experts
    per_expert = g.op("Unsqueeze", g.op("Reshape", g.op("Transpose", dense, perm=[1, 0]), g.const([num_experts, -1])),
                      g.const([-1]))
    return g.op("ReduceSum", g.op("Mul", down, per_expert), g.const([0]), keepdims=0)
