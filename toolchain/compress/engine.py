"""Weight compression itself: NNCF for INT4 groups and INT8 per channel, the int8-per-head pass for per-head
INT8, on the ONNX graph (onnxruntime target) or on OpenVINO's model of it (openvino target).

Each precision in the plan is one NNCF call restricted to its weights (every other weight's node is in the
call's ignored scope, with ``all_layers=True`` so that NNCF applies no embeddings / lm_head rule of its own: the
policy in policy.py decides those). Three traps of NNCF 3.4 with ORT 1.32, measured on our graphs:

1. INT4_ASYM on ONNX writes MatMulNBits zero points one per byte, [N, blocks], which ORT refuses at load; the
   ``to-matmul-nbits`` pass packs them (two per byte) before the model is saved.
2. INT4 of a 3-D MatMul weight: below opset 21 NNCF refuses it ("ONNX does not support 3D weights"), at 21+ it
   writes a blocked DequantizeLinear that ORT rejects ("scale must be 1D tensor"). The exporter stores every
   routed expert as its own 2-D MatMul; its 3-D weights are MLA's absorbed kv_b_proj, W_uk [H, nope, rank] and
   W_uv [H, rank, v] of the latent cache (toolchain/export/deepseek.py), read by a batched MatMul. A 3-D weight
   goes to INT8 per output channel instead (``demoted_3d`` in compression.json), which on [heads, K, N] is a
   scale per head and channel (also in the int8-per-head scheme). ONNX Runtime has no kernel for a batched
   MatMul of low-bit weights: the ORT rewrite stores it as Cast / Sub / Mul of the int8 values, which ORT folds
   into a float32 constant when it loads the graph (measured at V2-Lite widths, [16, 128, 512]: DequantizeLinear
   -> MatMul took 1.41 ms per call against 0.65 ms in float32), so there it runs at float32 speed with the INT8
   error; OpenVINO runs NNCF's decompression of it at each call, as fast as float32.
3. A group size that does not divide a weight's input width (a router's or a LoRA rank's K=64 with g128, every
   weight of a 64-wide test model) makes NNCF raise InvalidGroupSizeError. ``GroupSizeFallbackMode.ADJUST``
   takes the largest power of two below the group size that divides K (at least 32); a weight with none goes
   to the backup precision. The group size each weight got is in compression.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import onnx_ir as ir
from pydantic import Field

from passes.base import CountedResult
from passes.graph import name_of, stored_weight, tensor_of
from passes.quantize._weights import MS_DOMAIN
from passes.quantize.int8_per_head import Int8PerHead
from passes.quantize.matmul_nbits import ToMatMulNBits
from passes.quantize.prefill_int8 import PrefillInt8
from toolchain.errors import InputError
from toolchain.interface.graph import LAYER, ROLE
from toolchain.recipe import CompressSection

MIN_ADJUSTED_GROUP_SIZE = 32


class Options(CompressSection):
    """A recipe's compress section and what the graph adds to it: the head width of each projection whose output
    channels are heads (the graph's ``dstc.head_layout``), for int8-per-head."""

    head_blocks: dict[str, int] = Field(default_factory=dict)


@dataclass
class Weight:
    name: str  # initializer
    node: str  # consumer MatMul / Gather node name (NNCF's and OpenVINO's name for it)
    output: str  # the consumer's output value name (kept by every rewrite; the key between graphs)
    kind: str  # "matmul" | "gather"
    shape: tuple[int, ...]
    array: np.ndarray | None = None  # the fp32 value
    role: str | None = None  # what the exporter wrote on the initializer (toolchain/compress/policy.py)
    layer: int | None = None
    storage: str = "float32"  # "bfloat16": a bf16 initializer that a Cast widens (toolchain/export/graph.py)


def graph_weights(model: ir.Model, with_arrays: bool = True) -> list[Weight]:
    """Every float constant weight: 2-D and 3-D MatMul right operands and axis-0 Gather tables, a bf16-stored one
    by its bf16 initializer (the Cast's input, whose name is the weight's). An unnamed consumer is given a name
    first: NNCF's ignored scopes and OpenVINO address nodes by name. ``with_arrays`` False leaves the values where
    they are (the streaming path reads each when it compresses it)."""
    out = []
    taken = {node.name for node in model.graph}
    for i, node in enumerate(model.graph):
        if not node.name:
            node.name = next(f"{node.op_type}_w{i}_{k}" for k in range(len(taken) + 1)
                             if f"{node.op_type}_w{i}_{k}" not in taken)
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gather"):
            continue
        if node.op_type == "Gather" and (node.attributes.get("axis") is not None
                                         and node.attributes["axis"].as_int() != 0):
            continue
        value = node.inputs[1] if node.op_type == "MatMul" else node.inputs[0]
        stored = stored_weight(value)
        value = stored or value
        if value is None or value.const_value is None or value.is_graph_input():
            continue
        shape = tuple(value.const_value.shape.numpy())
        if value.const_value.dtype != (ir.DataType.BFLOAT16 if stored else ir.DataType.FLOAT) or \
                len(shape) not in (2, 3) or (node.op_type == "Gather" and len(shape) != 2):
            continue
        props = value.const_value.metadata_props
        layer = props.get(LAYER)
        out.append(Weight(name_of(value), name_of(node), name_of(node.outputs[0]), node.op_type.lower(), shape,
                          value.const_value.numpy().astype(np.float32, copy=False) if with_arrays else None,
                          props.get(ROLE), int(layer) if layer and layer.isdigit() else None,
                          "bfloat16" if stored else "float32"))
    return out


def widen_stored_weights(model: ir.Model) -> int:
    """Each bf16-stored weight and its Cast become a float32 initializer of the weight's name: the graph the float32
    export of the same checkpoint has, for the whole-model path (NNCF, the int8-per-head pass and the metrics take
    float32 constants; below the streaming threshold the float32 copies are small). Returns how many."""
    widened = 0
    for node in list(model.graph):
        stored = stored_weight(node.outputs[0]) if node.op_type == "Cast" and node.outputs else None
        if stored is None:
            continue
        tensor = ir.tensor(tensor_of(stored).numpy().astype(np.float32), name=stored.name)
        tensor.metadata_props.update(tensor_of(stored).metadata_props)  # dstc.role, dstc.layer
        stored.const_value, stored.dtype = tensor, ir.DataType.FLOAT
        node.outputs[0].replace_all_uses_with(stored, replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
        widened += 1
    return widened


def external_data_dir(model: ir.Model) -> str | None:
    """The folder of the model's external weights (exports over 1 GiB keep them in model.onnx.data), if any:
    a graph handed on as bytes or a proto has to name it."""
    folders = {init.const_value.base_dir for init in model.graph.initializers.values()
               if isinstance(init.const_value, ir.ExternalTensor)}
    return str(folders.pop()) if folders else None


def _nncf_call(kind: str, options: Options, names: list[str], all_nodes: list[str], dataset,
               data_dir: str | None = None, data_aware: bool = True):
    """keyword arguments of nncf.compress_weights for one precision group; ``data_dir``: the ONNX graph's
    external weights folder; ``data_aware`` False: NNCF's data-free scales whatever the options."""
    import nncf
    from nncf.onnx.quantization.backend_parameters import BackendParameters
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

    keep = set(names)
    ignored = nncf.IgnoredScope(names=[n for n in all_nodes if n not in keep], validate=False)
    backend_params = {BackendParameters.EXTERNAL_DATA_DIR: data_dir} if data_dir else {}
    if kind == "int8":
        mode = nncf.CompressWeightsMode.INT8_SYM if options.sym else nncf.CompressWeightsMode.INT8_ASYM
        # INT8 modes treat every layer alike
        return dict(mode=mode, ignored_scope=ignored,
                    advanced_parameters=AdvancedCompressionParameters(backend_params=backend_params))
    mode = nncf.CompressWeightsMode.INT4_SYM if options.sym else nncf.CompressWeightsMode.INT4_ASYM
    backup = {"int8": nncf.BackupMode.INT8_SYM if options.sym else nncf.BackupMode.INT8_ASYM,
              "none": nncf.BackupMode.NONE}[options.backup]
    kwargs = dict(mode=mode, group_size=options.group_size, ratio=options.ratio, backup_mode=backup,
                  ignored_scope=ignored, all_layers=True,
                  advanced_parameters=AdvancedCompressionParameters(
                      backend_params=backend_params, group_size_fallback_mode=GroupSizeFallbackMode.ADJUST,
                      min_adjusted_group_size=MIN_ADJUSTED_GROUP_SIZE))
    if options.data_aware and data_aware:
        # only the options asked for: NNCF's ONNX backend refuses gptq even as False
        kwargs.update(dataset=dataset, subset_size=dataset.get_length() or 128,
                      **{k: True for k in ("awq", "scale_estimation", "gptq") if getattr(options, k)})
    return kwargs


def _run_nncf(model, kwargs: dict, backend: str):
    """nncf.compress_weights; an option NNCF does not support on this backend is the user's error."""
    import nncf

    try:
        return nncf.compress_weights(model, **kwargs)
    except nncf.ParameterNotSupportedError as e:
        raise InputError(f"NNCF on {backend}: {e}") from None


def _groups(weights: list[Weight], plan: dict[str, str]) -> tuple[dict[str, list[str]], list[str]]:
    """precision -> consumer node names of its weights (3-D weights out of INT4), and the demoted 3-D weights.
    A 3-D weight planned int8-per-head goes to NNCF's INT8, whose scales are per head and output channel on a
    [heads, K, N] weight (the pass takes 2-D weights only)."""
    groups: dict[str, list[str]] = {}
    demoted = []
    for w in weights:
        precision = plan[w.name]
        if precision == "int4" and len(w.shape) == 3:
            precision = "int8"
            demoted.append(w.name)
        elif precision == "int8-per-head" and len(w.shape) == 3:
            precision = "int8"
        groups.setdefault(precision, []).append(w.node)
    return groups, demoted


def _check_nncf_options(options: Options, groups: dict[str, list[str]], dataset, weights: list[Weight],
                        plan: dict[str, str]) -> None:
    if options.gptq and options.scale_estimation and any(
            w.role == "routed_expert" and plan[w.name] == "int4" for w in weights):
        # NNCF 3.4's GPTQ takes scale estimation's statistics as the mean of each calibration sequence's inputs
        # (GPTQ.activations_to_wc_statistics), NaN for a sequence that routes no token to the expert. Measured on
        # deepseek-v2-lite-tiny: numpy's "Mean of empty slice" and NaN casts, 36 expert weights lost (relative error
        # 1.0, stage exit 6); before max_weight_error, non-finite logits
        raise InputError("gptq with scale_estimation is refused on INT4 routed experts: NNCF 3.4 averages each "
                         "calibration sequence's inputs, and one that routes no token to an expert gives it NaN "
                         "scales; use gptq alone, or awq / scale_estimation without gptq")
    if options.data_aware and "int4" not in groups:
        raise InputError("--awq, --scale-estimation, --gptq and --ratio < 1 apply to INT4 weights, and this "
                         "plan has none")
    if options.data_aware and dataset is None:
        raise InputError("data-aware compression needs a calibration dataset")


def _per_head(model: ir.Model, weights: list[Weight], plan: dict[str, str], options: Options,
              log: Callable[[str], None]) -> dict:
    """Run the int8-per-head pass on the weights planned for it (in place); its counts and near-misses."""
    names = [w.name for w in weights if plan[w.name] == "int8-per-head" and len(w.shape) == 2]
    if not names:
        return {"per_head": {}}
    log(f"int8-per-head pass on {len(names)} weights")
    pass_ = Int8PerHead(options.head_blocks, sym=options.sym, names=names)
    counts = dict(cast(CountedResult, pass_(model)).counts)  # what a CountingPass's call returns
    return {"per_head": counts, "per_head_near_misses": [str(m) for m in pass_.near_misses(model)]}


def _calls(weights: list[Weight], groups: dict[str, list[str]], options: Options,
           unreached: frozenset[str]) -> tuple[list[tuple[str, list[str], bool]], dict]:
    """NNCF's calls in order, (kind, nodes, data_aware), and what details records of them. INT8 first: NNCF's
    INT4 output has MatMulNBits without importing its domain, which the shape inference NNCF runs first on its
    input rejects; the import is added after each call all the same. A data-aware INT4 call runs the model on ORT,
    which refuses NNCF's INT8 DequantizeLinear of a 3-D weight (to-matmul-nbits repairs it after): those are
    compressed after it. The INT4 weights no calibration token reaches (a routed expert the calibration never
    chose) get a data-free call of their own after the data-aware one: NNCF's AWQ fails on their empty
    activations and its GPTQ writes zeros where an input column was never active, which is every column of
    theirs."""
    calls: list[tuple[str, list[str], bool]] = [(kind, groups[kind], True) for kind in ("int8", "int4")
                                                if kind in groups]
    if not (options.data_aware and "int4" in groups):
        return calls, {}
    later = {w.node for w in weights if len(w.shape) == 3}.intersection(groups.get("int8", []))
    idle = {w.node for w in weights if w.name in unreached}
    calls = [("int8", [n for n in groups.get("int8", []) if n not in later], True),
             ("int4", [n for n in groups["int4"] if n not in idle], True),
             ("int4", [n for n in groups["int4"] if n in idle], False),
             ("int8", [n for n in groups.get("int8", []) if n in later], True)]
    free = sorted(w.name for w in weights if w.name in unreached and w.node in groups["int4"])
    return [c for c in calls if c[1]], {"data_free_unreached": free}


def _log_call(log: Callable[[str], None], kind: str, nodes: list[str], data_aware: bool, options: Options,
              backend: str = "") -> None:
    free = "" if data_aware or not options.data_aware else " (data-free: no calibration token reaches them)"
    log(f"NNCF {kind} on {len(nodes)} weights{backend}{free}")


def compress_onnx(model: ir.Model, plan: dict[str, str], options: Options, dataset,
                  log: Callable[[str], None], unreached: frozenset[str] = frozenset()) -> tuple[ir.Model, dict]:
    """The ONNX graph with its weights compressed per ``plan``, before the ORT kernel rewrite. ``unreached``: the
    weights no calibration token reaches, which take NNCF's data-free scales (_calls)."""
    weights = graph_weights(model)
    groups, demoted = _groups(weights, plan)
    _check_nncf_options(options, groups, dataset, weights, plan)
    details = {"demoted_3d": demoted, **_per_head(model, weights, plan, options, log)}
    all_nodes = [w.node for w in weights]
    calls, called = _calls(weights, groups, options, unreached)
    details.update(called)
    for kind, nodes, data_aware in calls:
        _log_call(log, kind, nodes, data_aware, options)
        data_dir = external_data_dir(model)
        proto = ir.serde.serialize_model(model)
        proto = _run_nncf(proto, _nncf_call(kind, options, nodes, all_nodes, dataset, data_dir, data_aware),
                          "ONNX")
        model = ir.serde.deserialize_model(proto)
        if any(node.domain == MS_DOMAIN for node in model.graph):
            model.opset_imports.setdefault(MS_DOMAIN, 1)
    return model, details


def compress_openvino(onnx_model: ir.Model, plan: dict[str, str], options: Options, dataset, work_dir,
                      log: Callable[[str], None], unreached: frozenset[str] = frozenset()) -> tuple[Any, dict]:
    """ov.Model of the graph with its weights compressed per ``plan`` (per-head INT8 written in the ONNX first,
    which OpenVINO reads as its compressed-weight pattern); ``unreached`` as compress_onnx's."""
    import openvino as ov

    weights = graph_weights(onnx_model)
    groups, demoted = _groups(weights, plan)
    _check_nncf_options(options, groups, dataset, weights, plan)
    details = {"demoted_3d": demoted, **_per_head(onnx_model, weights, plan, options, log)}
    path = work_dir / "pre-openvino.onnx"
    # External weights are written again beside the copy: their recorded location is relative to the export.
    data = path.with_suffix(".onnx.data") if external_data_dir(onnx_model) else None
    ir.save(onnx_model, path, external_data=data.name if data else None)
    model = ov.convert_model(str(path))
    path.unlink()
    if data:
        data.unlink()  # convert_model has read (or mapped) the weights; a mapping outlives the name
    # OpenVINO names a node whose output is a graph output after it (lm_head's MatMul is "logits"), and NNCF's
    # scopes take OpenVINO's names: with the ONNX name, an INT8 call made lm_head INT8 whatever the plan said
    weights = _openvino_node_names(model, weights)
    groups, demoted = _groups(weights, plan)
    all_nodes = [w.node for w in weights]
    calls, called = _calls(weights, groups, options, unreached)
    details.update(called)
    for kind, nodes, data_aware in calls:
        _log_call(log, kind, nodes, data_aware, options, " (OpenVINO)")
        model = _run_nncf(model, _nncf_call(kind, options, nodes, all_nodes, dataset, data_aware=data_aware),
                          "OpenVINO")
    return model, details


def _openvino_node_names(model, weights: list[Weight]) -> list[Weight]:
    """The weights with ``node`` the name of their consumer in the ov.Model (found by its output's name)."""
    names = {name: op.get_friendly_name() for op in model.get_ordered_ops()
             if op.get_type_name() in ("MatMul", "Gather") for name in op.output(0).get_names()}
    return [replace(w, node=names.get(w.output, w.node)) for w in weights]


def to_ort_kernels(model: ir.Model, accuracy_level: int | None, prefill_int8: bool | None = False) -> dict:
    counts = dict(cast(CountedResult, ToMatMulNBits(accuracy_level)(model)).counts)  # a CountingPass's result
    if prefill_int8:
        counts.update(cast(CountedResult, PrefillInt8()(model)).counts)
    return counts


def numpy_dataset(feed_list):
    import nncf

    return None if not feed_list else nncf.Dataset(list(feed_list))
