"""Weight compression of fused MoE experts (toolchain/export/moe.py), where NNCF does not see them.

In a fused lowering each MoE layer's experts are stacked [E, out, in] initializers read by one com.microsoft.MoE
node (fused-onnxruntime) or by the tiled block's FusedMatMuls (fused-openvino); NNCF's whole-model
call and engine.graph_weights look for 2-D MatMul / Gather weights and pass them by. Here each expert's matrix is
quantized on its own with NNCF's own ``compress_weight`` (what NNCF's backends call per weight; a [out, in]
matrix reduced along ``in`` gives NNCF's groups of the [in, out] MatMul weight exactly), following the same plan
as every other weight (toolchain/compress/policy.py: routed experts take the scheme, ``ignore`` keeps them fp32)
and written in the form the target's fused kernel reads:

* onnxruntime: the MoE node becomes ``com.microsoft.QMoE`` with the same router input (it takes the top k of
  router_probs and softmaxes them, which the exporter's log-weights make w / sum(w) as for MoE; see
  onnxruntime/contrib_ops/cpu/moe/moe_quantization_cpu.cc): ``expert_weight_bits`` 4 with ``block_size`` the
  group (one that divides both the hidden and the intermediate width, as QMoE requires) or 8 per output row,
  weights packed two 4-bit values per byte along ``in`` (low nibble first, MatMulNBits' order), scales
  [E, out, blocks], zero points packed along blocks (none when symmetric: QMoE's default is 8 / 128), and
  ``accuracy_level`` (4: int8 activations; 8-bit experts use int8 activations at every level in ORT 1.32);
* openvino: each stacked weight becomes a blocked ``DequantizeLinear`` (opset 21, axis 2; 8-bit per channel as
  one block of ``in``), which OpenVINO's ONNX frontend turns into its compressed-weight pattern and its CPU
  plugin into GatherMatmulCompressed.

A layer's experts share one precision (one QMoE bit width, one stacked constant): a plan that splits them is an
InputError, and so is fp32 for fused-openvino experts (NNCF's whole-model call would compress them unasked).
Each quantized tensor is computed when saved, one stacked weight at a time, from the export's weights (a memory
map for external data); per expert and projection the relative weight error is recorded and, given calibration
activations, the output error on the tokens routed to that expert.

AWQ and scale estimation run per expert as on the dispatch form's MatMuls in bounded memory
(toolchain/compress/streamed_awq.py, streaming.py): given the calibration statistics of each expert's inputs (a
WCTensorStatistic per projection: the rows routed to it, and act(gate) * up of them for down_proj, per sequence),
NNCF's ``AWQ._data_aware_step`` on the expert's up_proj -> down_proj pair gives s, down_proj is quantized as W * s
per input channel and up_proj's rows (every second row of the onnxruntime form's gate/up weight) as W / s, and
NNCF's scale estimation gives each matrix's scales from its input's statistics (down_proj's divided by s). Each is
called on the [in, out] matrix the dispatch form's MatMul holds, so the same statistics give the same scales. The
AWQ scales are computed when the graph is rewritten (both weights of a pair read, one expert at a time); an expert
no calibration token reached keeps NNCF's data-free scales. Errors are measured in the model's units: a weight
restored with AWQ's scale undone against the export's. GPTQ and ratio < 1 are refused here.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, cast

import numpy as np
import onnx_ir as ir

from passes.graph import HeldInitializer, name_of, present, produced
from toolchain.compress import lowering, metrics, streamed_awq
from toolchain.compress.engine import Options
from toolchain.compress.streaming import ComputedOnSave, adjusted_group, raise_opset
from toolchain.errors import InputError
from toolchain.export.moe import MS_DOMAIN
from toolchain.interface.graph import ROLE, moe_lowering

if TYPE_CHECKING:
    from nncf.common.tensor_statistics.statistics import WCTensorStatistic

_LAYER = re.compile(r"^layers\.(\d+)/")


@dataclass
class Stacked(HeldInitializer):
    """One stacked expert weight [E, out, in]: its initializer, the projections its rows hold (two: gate and up
    interleaved row by row) and the node that reads it."""

    value: ir.Value
    projections: tuple[str, ...]
    node: str

    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, out, in]."""
        if self.value.shape is None:
            raise ValueError(f"{self.name} has no shape")
        e, out, k = self.value.shape.numpy()
        return e, out, k

    @property
    def role(self) -> str | None:
        """What the exporter wrote on the initializer (GraphBuilder.role): routed_expert."""
        return self.tensor.metadata_props.get(ROLE)


@dataclass
class FusedLayer:
    layer: int
    form: str  # "onnxruntime" (com.microsoft.MoE) | "openvino" (tiled block)
    scope: str  # layers.N/mlp/experts
    x: str  # the experts' input [tokens, hidden]
    topk_idx: str  # the router's choice [tokens, k]
    weights: list[Stacked]
    node: ir.Node | None = None  # the MoE node (onnxruntime form)

    @property
    def num_experts(self) -> int:
        return self.weights[0].shape[0]

    def names(self, stacked: Stacked) -> list[tuple[int, str, str]]:
        """(expert, projection, weight name) of each matrix in ``stacked``, named as the dispatch lowering names
        the expert's MatMul weight, so that policy patterns and compression.json read alike."""
        return [(e, p, f"{self.scope}/{e}/{p}/weight") for e in range(self.num_experts) for p in stacked.projections]


def lowering_of(model: ir.Model) -> str | None:
    """The export's MoE lowering as its metadata records it (toolchain/interface/graph.py moe_lowering); None for a
    dense model."""
    return moe_lowering(model.metadata_props, (node.op_type for node in model.graph))


def fused_layers(model: ir.Model) -> list[FusedLayer]:
    """The fused MoE layers of an export, in graph order: none unless its lowering is a fused one."""
    lowering = lowering_of(model)
    if lowering not in ("fused-onnxruntime", "fused-openvino"):
        return []
    layers = []
    for node in model.graph:
        name = name_of(node)
        scope = name.rsplit("/", 1)[0]
        match = _LAYER.match(name)
        if lowering == "fused-onnxruntime" and node.op_type == "MoE" and node.domain == MS_DOMAIN:
            if match is None:
                raise ValueError(f"the MoE node {name} is in no layer")
            scatter = produced(node.inputs[1])
            weights = [Stacked(present(node.inputs[2]), ("gate_proj", "up_proj"), name),
                       Stacked(present(node.inputs[4]), ("down_proj",), name)]
            layers.append(FusedLayer(int(match.group(1)), "onnxruntime", scope, name_of(node.inputs[0]),
                                     name_of(scatter.inputs[1]), weights, node))
        elif lowering == "fused-openvino" and node.op_type == "Tile" and match and scope.endswith("/mlp/experts"):
            nodes = [n for n in model.graph if name_of(n).startswith(scope + "/")]
            scatter = next(n for n in nodes if n.op_type == "ScatterElements")
            weights = [Stacked(weight, (name_of(weight).rsplit("/", 1)[-1],), name_of(n)) for n in nodes
                       if n.op_type == "FusedMatMul" and (weight := present(n.inputs[1])).is_initializer()]
            layers.append(FusedLayer(int(match.group(1)), "openvino", scope, name_of(node.inputs[0]),
                                     name_of(scatter.inputs[1]), weights))
    return layers


def router_indices(layers: list[FusedLayer]) -> dict[int, str]:
    """MoE layer -> its TopK indices value (the choice the fused node is fed), for routing agreement."""
    return {f.layer: f.topk_idx for f in layers}


def capture_names(layers: list[FusedLayer]) -> list[str]:
    """The values an fp32 calibration run outputs for :func:`calibration_activations`."""
    return [name for layer in layers for name in (layer.x, layer.topk_idx)]


def _gate_up(layer: FusedLayer, expert: int) -> tuple[np.ndarray, np.ndarray]:
    """An expert's gate_proj and up_proj [intermediate, hidden] in float32 (interleaved rows in the onnxruntime
    form's stacked weight)."""
    by_projection = {p: s for s in layer.weights for p in s.projections}
    fc = by_projection["gate_proj"]
    matrix = fc.tensor.numpy()[expert]
    if len(fc.projections) > 1:
        return np.array(matrix[0::2], np.float32), np.array(matrix[1::2], np.float32)
    return np.array(matrix, np.float32), np.array(by_projection["up_proj"].tensor.numpy()[expert], np.float32)


def _down_input(x: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(x gate^T) * (x up^T): down_proj's input for rows ``x``."""
    import torch

    xt = torch.from_numpy(np.array(x, np.float32))
    g = xt @ torch.from_numpy(gate).T
    return (torch.nn.functional.silu(g) * (xt @ torch.from_numpy(up).T)).numpy()


def _routed(layers: list[FusedLayer], outputs: list[dict]) -> dict[int, list[tuple[np.ndarray, np.ndarray]]]:
    """MoE layer -> per calibration sequence, its input rows [tokens, hidden] and the router's choice [tokens, k]."""
    def rows(v: np.ndarray) -> np.ndarray:
        return v.reshape(-1, v.shape[-1])

    return {layer.layer: [(rows(o[layer.x]), rows(o[layer.topk_idx])) for o in outputs] for layer in layers}


def calibration_activations(layers: list[FusedLayer],
                            outputs: list[dict]) -> Callable[[FusedLayer, int, str], np.ndarray | None]:
    """(layer, expert, projection) -> the calibration rows that reach that projection of that expert in the fp32
    graph (at most metrics.MAX_ROWS): the layer input's rows routed to the expert for gate and up, and
    silu(x gate^T) * (x up^T) of those rows for down. ``outputs``: per calibration sequence, the fp32 run's values
    of :func:`capture_names`."""
    sequences = _routed(layers, outputs)

    def rows(layer: FusedLayer, expert: int, projection: str) -> np.ndarray | None:
        x = np.concatenate([x[(idx == expert).any(-1)] for x, idx in sequences[layer.layer]])[:metrics.MAX_ROWS]
        if not len(x):
            return None
        return x if projection != "down_proj" else _down_input(x, *_gate_up(layer, expert))

    return rows


def calibration_statistics(layers: list[FusedLayer], outputs: list[dict]) \
        -> Callable[[FusedLayer, int, str], WCTensorStatistic | None]:
    """(layer, expert, projection) -> the statistics NNCF's data-aware algorithms read of that projection's input
    (an nncf WCTensorStatistic: per calibration sequence that routes a token to the expert, the mean of its rows
    and their shape, as toolchain/compress/layer_statistics.py gives them), or None for an expert no calibration
    token reached. ``outputs`` as for :func:`calibration_activations`."""
    from nncf.common.tensor_statistics.statistics import WCTensorStatistic
    from nncf.tensor import Tensor

    sequences = _routed(layers, outputs)

    def statistics(layer: FusedLayer, expert: int, projection: str) -> WCTensorStatistic | None:
        inputs = [x[(idx == expert).any(-1)] for x, idx in sequences[layer.layer]]
        inputs = [x for x in inputs if len(x)]
        if not inputs:
            return None
        if projection == "down_proj":
            gate, up = _gate_up(layer, expert)
            inputs = [_down_input(x, gate, up) for x in inputs]
        return WCTensorStatistic(mean_values=[Tensor(x.mean(0)) for x in inputs],
                                 shape_values=[tuple(x.shape) for x in inputs])

    return statistics


def int4_names(layers: list[FusedLayer], plan: Callable[..., str]) -> set[str]:
    """The expert matrices (dispatch-form names) the plan makes INT4: those whose inputs' statistics AWQ and scale
    estimation read."""
    return {name for layer in layers for s in layer.weights for _, _, name in layer.names(s)
            if plan(name, s.node, s.role) == "int4"}


def check(layers: list[FusedLayer], target: str, options: Options) -> None:
    if not layers:
        return
    if layers[0].form != target:
        raise InputError(f"the export's MoE layers are lowered for {layers[0].form} (fused-{layers[0].form}); "
                         f"compress it for that target, or export with --moe fused-{target}")
    if options.gptq or options.ratio < 1.0:
        raise InputError("gptq and ratio < 1 are not available for fused MoE experts (NNCF does not see them); "
                         "use the data-free scheme, awq or scale estimation, or export with --moe dispatch")


@dataclass
class Spec:
    bits: int
    group: int | None  # None: one scale per output row
    sym: bool

    @property
    def precision(self) -> str:
        return f"int{self.bits}-{'sym' if self.sym else 'asym'}-" + (f"g{self.group}" if self.group else "per-channel")


def _spec(precision: str, ks: list[int], options: Options) -> Spec | None:
    """The compressed form of a set of weights planned ``precision`` with input widths ``ks``; None: fp32."""
    if precision == "fp32":
        return None
    if precision == "int4":
        group = adjusted_group(int(np.gcd.reduce(ks)), options.group_size)
        if group is not None:
            return Spec(4, group, options.sym)
        if options.backup != "int8":
            return None
    return Spec(8, None, options.sym)  # int8, int8-per-head (experts have no heads: per channel), int4's backup


# (expert, projection) -> the statistics of its input, None where no calibration token reached the expert
Statistics = Callable[[int, str], "WCTensorStatistic | None"]


@dataclass
class Job(ComputedOnSave):
    """The quantization of one stacked weight, computed when the first of its tensors is saved."""

    layer: FusedLayer
    stacked: Stacked
    spec: Spec
    activations: Callable[[int, str], np.ndarray | None] | None
    stats: dict[str, dict] = field(default_factory=dict)  # weight name -> errors
    # AWQ's scale s of each expert's down_proj input channels (the layer's jobs share it: up_proj's rows take 1 / s)
    awq: dict[int, np.ndarray] = field(default_factory=dict)
    statistics: Statistics | None = None  # the inputs' statistics for scale estimation (down_proj's after AWQ)
    calibrated: bool = False  # AWQ or scale estimation asked for (and the experts INT4)
    data_aware: Counter = field(default_factory=Counter)  # expert matrices: "awq", "scale_estimation", "data_free"

    def _scaled(self, e: int, w: np.ndarray, undo: bool = False) -> np.ndarray:
        """``w`` (expert ``e``'s [out, in], in place) with AWQ's scales applied, or taken back off a restored one."""
        s = self.awq.get(e)
        if s is None:
            return w
        parts = len(self.stacked.projections)
        inverse = (1.0 / s).astype(np.float32)  # as streaming.Spec.column_scale multiplies the dispatch's up_proj
        for i, projection in enumerate(self.stacked.projections):
            if projection == "up_proj":
                w[i::parts] *= (s if undo else inverse)[:, None]
            elif projection == "down_proj":
                w *= (inverse if undo else s)[None, :]
        return w

    def _estimated(self, e: int, w: np.ndarray, mode: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        """NNCF's scale estimation of expert ``e``'s (AWQ-scaled) [out, in] matrix, each projection on its own
        [in, out] (the dispatch form's MatMul weight) from its input's statistics, in lowering.quantize's shapes
        for axis 1 ([out, in / group, 1]); (None, None) when not asked or no calibration token reached it."""
        if self.statistics is None:
            return None, None
        parts = len(self.stacked.projections)
        stats = [self.statistics(e, p) for p in self.stacked.projections]
        if any(stat is None for stat in stats):
            return None, None
        scale: np.ndarray | None = None
        zp: np.ndarray | None = None
        for i, stat in enumerate(stats):
            got = lowering.estimate_scales(np.ascontiguousarray(w[i::parts].T), stat, mode, self.spec.group)
            # [in / group, 1, out_i] -> [out_i, in / group, 1]
            part_scale, part_zp = (None if a is None else a.transpose(2, 0, 1) for a in got)
            assert part_scale is not None
            if scale is None:
                scale = np.empty((w.shape[0], *part_scale.shape[1:]), part_scale.dtype)
                zp = None if part_zp is None else np.empty((w.shape[0], *part_zp.shape[1:]), part_zp.dtype)
            scale[i::parts] = part_scale
            if zp is not None:
                zp[i::parts] = part_zp
        self.data_aware["scale_estimation"] += parts
        return scale, zp

    def _compute(self) -> dict[str, np.ndarray]:
        spec = self.spec
        mode = f"INT{spec.bits}_{'SYM' if spec.sym else 'ASYM'}"
        tensor = self.stacked.tensor
        stacked = tensor.numpy()  # a memory map for external data: read expert by expert
        names = self.layer.names(self.stacked)
        parts = len(self.stacked.projections)
        qs, scales, zps = [], [], []
        for e in range(stacked.shape[0]):
            w = np.array(stacked[e], dtype=np.float32)  # [out, in]
            original = w.copy() if e in self.awq else w
            if e in self.awq:
                self.data_aware["awq"] += sum(p in ("up_proj", "down_proj") for p in self.stacked.projections)
            w = self._scaled(e, w)
            given, given_zp = self._estimated(e, w, mode)
            if self.calibrated and e not in self.awq and given is None:  # no calibration token reached it
                self.data_aware["data_free"] += parts
            quantized = lowering.quantize(w, 1, mode, spec.group, keep_restored=True, scale=given,
                                          zero_point=given_zp)
            restored = self._scaled(e, cast(np.ndarray, quantized.restored).reshape(w.shape), undo=True)
            qs.append(quantized.q.reshape(w.shape))
            scales.append(quantized.scale.reshape(w.shape[0], -1))
            if quantized.zero_point is not None:
                zps.append(quantized.zero_point.reshape(w.shape[0], -1))
            for i, (_, projection, name) in enumerate(names[e * parts:(e + 1) * parts]):
                rows = slice(i, None, parts)  # interleaved projections: every parts-th row from the i-th
                # [in, out] as the dispatch lowering's MatMul weight, so that x @ W is the projection
                original_t, approx = original[rows].T, restored[rows].T
                x = self.activations(e, projection) if self.activations else None
                self.stats[name] = {"weight_error": metrics.relative_error(original_t, approx),
                                    "output_error": metrics.output_error(x, original_t, approx)}
        del stacked
        if isinstance(tensor, ir.ExternalTensor):
            tensor.release()
        q, scale = np.stack(qs), np.stack(scales).astype(np.float32)
        zp = np.stack(zps).astype(np.uint8) if zps else None
        return _ort_arrays(q, scale, zp, spec) if self.layer.form == "onnxruntime" else _dq_arrays(q, scale, zp)

    def tensor(self, key: str, dtype: ir.DataType, shape: tuple[int, ...], name: str) -> ir.Value:
        lazy = ir.LazyTensor(lambda: ir.tensor(self.take(key), dtype=dtype), dtype=dtype, shape=ir.Shape(shape),
                             name=name)
        self.pending.add(key)
        return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=lazy)


def _pack4(values: np.ndarray) -> np.ndarray:
    """[..., n] 4-bit values -> [..., ceil(n / 2)] uint8, element 2i in the low nibble."""
    values = values.astype(np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


def _ort_arrays(q, scale, zp, spec: Spec) -> dict[str, np.ndarray]:
    """QMoE's tensors: symmetric values offset by its default zero point (8 / 128), 4-bit ones packed."""
    if spec.sym:
        q = q.astype(np.int16) + (8 if spec.bits == 4 else 128)
    q = q.astype(np.uint8)
    out = {"quantized": _pack4(q) if spec.bits == 4 else q, "scale": scale if spec.group else scale[..., 0]}
    if zp is not None:
        zp = zp if spec.group else zp[..., 0]
        out["zero_point"] = _pack4(zp) if spec.bits == 4 else zp
    return out


def _dq_arrays(q, scale, zp) -> dict[str, np.ndarray]:
    out = {"quantized": q, "scale": scale}
    if zp is not None:
        out["zero_point"] = zp
    return out


def _shapes(layer: FusedLayer, spec: Spec, shape: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    e, n, k = shape
    blocks = k // spec.group if spec.group else 1
    side: tuple[int, ...]
    if layer.form == "openvino":
        side = (e, n, blocks)
        return {"quantized": shape, "scale": side, **({} if spec.sym else {"zero_point": side})}
    side = (e, n, blocks) if spec.group else (e, n)
    packed_zp = (e, n, -(-blocks * spec.bits // 8)) if spec.group else (e, -(-n * spec.bits // 8))
    return {"quantized": (e, n, k * spec.bits // 8), "scale": side, **({} if spec.sym else {"zero_point": packed_zp})}


def _dtype(layer: FusedLayer, spec: Spec, key: str) -> ir.DataType:
    if key == "scale":
        return ir.DataType.FLOAT
    if layer.form == "onnxruntime" or spec.bits == 8:
        return ir.DataType.INT8 if spec.sym and layer.form == "openvino" else ir.DataType.UINT8
    return ir.DataType.INT4 if spec.sym else ir.DataType.UINT4


def stored_bits(form: str, spec: Spec, shape: tuple[int, int]) -> int:
    """Bits one [out, in] expert matrix takes: values, float32 scales and zero points (QMoE pads each row's
    packed zero points to a byte)."""
    n, k = shape
    per_row = k // spec.group if spec.group else 1
    zero_points = 0 if spec.sym else n * (8 * -(-per_row * spec.bits // 8) if form == "onnxruntime"
                                          else per_row * spec.bits)
    return n * k * spec.bits + 32 * n * per_row + zero_points


def compress_experts(model: ir.Model, layers: list[FusedLayer], plan: Callable[..., str], options: Options,
                     accuracy_level: int | None,
                     activations: Callable[[FusedLayer, int, str], np.ndarray | None] | None = None,
                     statistics: Callable[[FusedLayer, int, str], WCTensorStatistic | None] | None = None) \
        -> list[Job]:
    """Rewrite ``model``'s fused experts in place as the plan says (``plan(weight name, node name, role)`` ->
    precision, i.e. Policy.precision); returns one Job per compressed stacked weight, whose stats fill as the
    model is saved. ``activations(layer, expert, projection)``: calibration rows reaching that projection of that
    expert, for output errors; ``statistics(layer, expert, projection)``: their nncf WCTensorStatistic (None for an
    expert no calibration token reached), for the options' AWQ and scale estimation of INT4 experts."""
    jobs = []
    for layer in layers:
        planned = {s.name: {plan(name, s.node, s.role) for _, _, name in layer.names(s)} for s in layer.weights}
        if layer.form == "onnxruntime":
            planned = {key: set().union(*planned.values()) for key in planned}  # one QMoE bit width
        if any(len(p) > 1 for p in planned.values()):
            raise InputError(f"{layer.scope}: the plan gives its experts {sorted(set().union(*planned.values()))}; "
                             f"a fused MoE layer's experts share one precision (export with --moe dispatch to "
                             f"compress experts differently)")
        ks = [s.shape[2] for s in layer.weights]
        specs = {s.name: _spec(planned[s.name].pop(), [s.shape[2]] if layer.form == "openvino" else ks, options)
                 for s in layer.weights}
        if layer.form == "openvino" and None in specs.values():
            raise InputError(f"{layer.scope}: fused-openvino experts cannot stay fp32 (NNCF's OpenVINO backend "
                             f"compresses every MatMul its ignored scope does not name, and that scope lists 2-D "
                             f"weights only); export with --moe dispatch to keep experts fp32")
        if all(spec is None for spec in specs.values()):
            continue
        bound = (lambda e, p, _layer=layer: activations(_layer, e, p)) if activations else None
        int4 = all(spec is not None and spec.bits == 4 and spec.group for spec in specs.values())
        of_layer: Statistics | None = None
        if statistics is not None and int4:
            of_layer = partial(statistics, layer)
        scales = awq_scales(layer, of_layer, specs) if options.awq and of_layer else {}
        estimate = _after_awq(of_layer, scales) if options.scale_estimation and of_layer else None
        layer_jobs = [Job(layer, s, spec, bound, awq=scales, statistics=estimate, calibrated=of_layer is not None)
                      for s in layer.weights if (spec := specs[s.name])]
        if layer.form == "onnxruntime":
            _to_qmoe(model, layer, layer_jobs, accuracy_level)
        else:
            for job in layer_jobs:
                _to_dequantize(model, layer, job)
        jobs += layer_jobs
    if any(job.layer.form == "openvino" for job in jobs):
        raise_opset(model)
    return jobs


def awq_scales(layer: FusedLayer, statistics: Statistics, specs: dict[str, Spec | None]) -> dict[int, np.ndarray]:
    """expert -> AWQ's scale of its down_proj input channels (streamed_awq.pair_scale) on the expert's down_proj
    and up_proj as the dispatch form's [in, out] MatMul weights, for each expert whose both inputs have
    statistics. Reads the two weights of one expert at a time."""
    fc2 = next(s for s in layer.weights if "down_proj" in s.projections)
    spec = cast(Spec, specs[fc2.name])
    scales = {}
    for e in range(layer.num_experts):
        down_stats, up_stats = statistics(e, "down_proj"), statistics(e, "up_proj")
        if down_stats is None or up_stats is None:
            continue
        down = np.ascontiguousarray(np.array(fc2.tensor.numpy()[e], np.float32).T)
        up = np.ascontiguousarray(_gate_up(layer, e)[1].T)
        scales[e] = streamed_awq.pair_scale(down, down_stats, up, up_stats, spec.sym, cast(int, spec.group))
    for s in layer.weights:
        if isinstance(s.tensor, ir.ExternalTensor):
            s.tensor.release()
    return scales


def _after_awq(statistics: Statistics, scales: dict[int, np.ndarray]) -> Statistics:
    """The inputs' statistics once AWQ's scales are applied: down_proj's divided by s (streamed_awq.divided)."""

    def of(expert: int, projection: str) -> WCTensorStatistic | None:
        stat = statistics(expert, projection)
        s = scales.get(expert)
        if stat is None or s is None or projection != "down_proj":
            return stat
        return streamed_awq.divided(stat, s)

    return of


def data_aware_counts(jobs: list[Job]) -> dict[str, int]:
    """compression.json's details of the fused experts' data-aware options, once the model is saved: expert
    matrices quantized with AWQ's scale, with scale estimation's, and with NNCF's data-free ones (no calibration
    token reached the expert)."""
    total: Counter = Counter()
    for job in jobs:
        total.update(job.data_aware)
    return {key: total[key] for key in ("awq", "scale_estimation", "data_free")}


def _inputs(model: ir.Model, job: Job) -> dict[str, ir.Value]:
    values = {}
    for key, shape in _shapes(job.layer, job.spec, job.stacked.shape).items():
        value = job.tensor(key, _dtype(job.layer, job.spec, key), shape, f"{job.stacked.name}_{key}")
        model.graph.register_initializer(value)
        values[key] = value
    return values


def _to_qmoe(model: ir.Model, layer: FusedLayer, jobs: list[Job], accuracy_level: int | None) -> None:
    fc1, fc2 = (_inputs(model, job) for job in jobs)
    spec = jobs[0].spec
    moe = layer.node
    if moe is None:
        raise ValueError(f"{layer.scope} has no MoE node")
    inputs = [moe.inputs[0], moe.inputs[1], fc1["quantized"], fc1["scale"], None, fc2["quantized"], fc2["scale"],
              None, None, None, None, fc1.get("zero_point"), fc2.get("zero_point")]
    while inputs[-1] is None:
        inputs.pop()
    attributes = dict(moe.attributes.items())
    attributes["expert_weight_bits"] = ir.AttrInt64("expert_weight_bits", spec.bits)
    if spec.group:
        attributes["block_size"] = ir.AttrInt64("block_size", spec.group)
    if accuracy_level is not None:
        attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", accuracy_level)
    qmoe = ir.node("QMoE", inputs, attributes=attributes, domain=MS_DOMAIN, name=moe.name,
                   num_outputs=1)
    model.graph.insert_before(moe, qmoe)
    output = moe.outputs[0]
    output.replace_all_uses_with(qmoe.outputs[0], replace_graph_outputs=True)
    # what onnx's shape inference cannot infer of a com.microsoft op, and NNCF's statistics of the MatMuls after
    # it need (their input's rank)
    qmoe.outputs[0].name, qmoe.outputs[0].type, qmoe.outputs[0].shape = output.name, output.type, output.shape
    model.graph.remove(moe, safe=True)
    for job in jobs:
        del model.graph.initializers[job.stacked.name]


def _to_dequantize(model: ir.Model, layer: FusedLayer, job: Job) -> None:
    values = _inputs(model, job)
    source, name = job.stacked.value, job.stacked.name
    k = job.stacked.shape[2]
    inputs = [values["quantized"], values["scale"]] + ([values["zero_point"]] if "zero_point" in values else [])
    dq = ir.node("DequantizeLinear", inputs,
                 attributes={"axis": 2, "block_size": job.spec.group or k}, name=f"{name}_DequantizeLinear",
                 num_outputs=1)
    dq.outputs[0].name = f"{name}_dequantized"
    dq.outputs[0].dtype, dq.outputs[0].shape = ir.DataType.FLOAT, ir.Shape(job.stacked.shape)
    matmul, _ = next(iter(source.uses()))
    model.graph.insert_before(matmul, dq)
    source.replace_all_uses_with(dq.outputs[0])
    del model.graph.initializers[name]


def weight_rows(jobs: list[Job], layers: list[FusedLayer], plan: Callable[..., str]) -> list[dict]:
    """compression.json rows of every expert matrix (fp32 ones too), in the shape of the other weights' rows."""
    by_value = {job.stacked.name: job for job in jobs}
    rows = []
    for layer in layers:
        for stacked in layer.weights:
            job = by_value.get(stacked.name)
            _, out, k = stacked.shape
            shape = [k, out // len(stacked.projections)]  # [in, out] as a MatMul weight
            bits = round(stored_bits(layer.form, job.spec, (shape[1], k)) / (shape[0] * shape[1]), 4) if job else 32.0
            for _, _, name in layer.names(stacked):
                stats = job.stats.get(name, {}) if job else {}
                rows.append({"weight": name, "node": stacked.node, "role": stacked.role,
                             "layer": layer.layer, "shape": shape, "planned": plan(name, stacked.node, stacked.role),
                             "precision": job.spec.precision if job else "fp32", "bits_per_weight": bits,
                             "weight_error": stats.get("weight_error", 0.0),
                             "output_error": stats.get("output_error") if job else None})
    return rows
