"""The exported graph's interface (optimum's names, which optimum-intel, openvino_genai and onnxruntime-genai
expect), the facts the exporter records in its metadata, and the one reader of its KV cache's shape.

Inputs ``input_ids``, ``attention_mask``, ``position_ids`` and, per layer, ``past_key_values.N.key`` / ``.value``
of shape [batch, heads, past, head dim]; outputs ``logits`` and ``present.N.key`` / ``.value``, the cache grown by
the new positions. The stateful OpenVINO IR adds ``beam_idx`` and keeps the cache in variables.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from passes.graph_contract import (  # noqa: F401 (the toolchain's readers take them from here)
    ATTENTION,
    KV_CACHE,
    LATENT,
    MOE_LAYERS,
    MOE_LOWERING,
    NUM_LAYERS,
    ROTATIONS_PER_LAYER,
)
from toolchain.errors import InputError

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
REQUIRED_INPUTS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)
BEAM_IDX = "beam_idx"  # the stateful IR's: the batch order of the cache (greedy passes arange(batch))
LOGITS = "logits"
PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."
# The axes of every cache tensor [batch, heads, sequence, head dim] (and the batch axis of input_ids).
BATCH_AXIS, HEADS_AXIS, SEQUENCE_AXIS, HEAD_DIM_AXIS = 0, 1, 2, 3

# The exporter's facts in the graph's metadata (ONNX metadata_props; the OpenVINO IR keeps them in its rt_info
# under "framework"), each a string. Those the passes read too are theirs (passes/graph_contract.py): NUM_LAYERS,
# ATTENTION, KV_CACHE (LATENT one of its values), MOE_LAYERS, MOE_LOWERING, ROTATIONS_PER_LAYER.
MODEL_TYPE = "dstc.model_type"
HEAD_LAYOUT = "dstc.head_layout"  # JSON: projection -> how its heads lie in the weight
CACHE_KINDS = "dstc.cache_kinds"  # JSON: each layer's cache tensors (key, value, and any more), in input order
# the element type every cache tensor is stored in (toolchain/export/cache_precision.py), computed in float32; a graph
# without it (exported before the option) caches float32
CACHE_DTYPE = "dstc.cache_dtype"
CACHE_DTYPES = ("float32", "float16")
# The main graph's optional output of its final-normed hidden state [batch, sequence, hidden] (what DeepSeek's MTP
# layer reads; DeepSeek-V4's: its hyper-connection streams before hc_head [batch, sequence, hc_mult, hidden]), and
# the MTP graph's input of it; HIDDEN_OUTPUT names the output in a graph that has it.
HIDDEN_STATES = "hidden_states"
HIDDEN_OUTPUT = "dstc.hidden_output"
MTP_HIDDEN = "mtp_hidden_states"  # an MTP graph's output of its layer's hidden state (toolchain/export/mtp.py)
MTP_LAYER = "dstc.mtp_layer"  # an MTP graph's checkpoint layer index (toolchain/export/mtp.py)
GENAI_MODEL_TYPE = "dstc.genai_model_type"  # onnxruntime-genai's model type; empty where its config cannot say
# ... and on each weight initializer of the exported graph.
ROLE = "dstc.role"
LAYER = "dstc.layer"
# JSON: the checkpoint tensor a matrix is read from, transposed or not, and its rows (export/weights.py provenance)
SOURCE = "dstc.source"

PER_HEAD = "per-head"
PER_TOKEN = "per-token"  # DeepSeek-V4's K=V and compressor projections per token (toolchain/export/deepseek_v4.py)
# DeepSeek-V4's compressed cache: a bounded sliding window, pooled entries and the incomplete window's tail, whose
# lengths follow CACHE_LENGTHS instead of growing by one per position (toolchain/export/deepseek_v4_attention.py)
COMPRESSED = "compressed"
# caches read by no ScaledDotProductAttention, which openvino_genai's continuous batching needs to page them
UNPAGEABLE = (LATENT, PER_TOKEN, COMPRESSED)
# JSON {"<layer>.<name>": [rule, n]}: how long each cache tensor that does not hold one entry per position is after
# T positions (the attention mask's length, padding included), by cache_length's rules; a tensor not named holds T.
CACHE_LENGTHS = "dstc.cache_lengths"
WINDOW, POOLED, TAIL = "window", "pooled", "tail"


def present_of(past: str) -> str:
    """The output that returns a cache input grown (``past_key_values.0.key`` -> ``present.0.key``)."""
    return PRESENT_PREFIX + past[len(PAST_PREFIX):]


def cache_spec(inputs: Iterable[tuple[str | None, Any]]) -> dict[str, tuple[int, int]]:
    """{past_key_values.* input: (heads, head dim)} from a graph's (input name, shape) pairs, in the graph's order;
    a cache input's heads and head dim are static (ints, or what ``int()`` takes)."""
    spec = {}
    for name, shape in inputs:
        if name and name.startswith(PAST_PREFIX):
            if shape is None:
                raise ValueError(f"the graph's cache input {name} has no shape")
            spec[name] = (int(shape[HEADS_AXIS]), int(shape[HEAD_DIM_AXIS]))
    return spec


def cache_bytes_per_token(inputs: list[tuple[str | None, Any, Any]], layer_types: list[str] | None,
                          lengths: Mapping[str, tuple[str, int]] | None = None) -> dict[str, int]:
    """{layer type: bytes one layer of that type caches per token} from a graph's (input name, shape, item size)
    triples: heads x head dim x item size summed over a layer's ``past_key_values.<layer>.*`` inputs (key, value
    and any more). ``layer_types``: the config's (DeepSeek-V4's sliding / CSA / HCA), None for one type,
    "attention"; layers of one type cache alike, so any of them gives its figure. ``lengths`` (cache_lengths): a
    window or tail adds nothing per token (its bytes are bounded), a pooled tensor its bytes over its rate, rounded
    down."""
    item_size = {name: size for name, _, size in inputs}
    grown: dict[int, int] = {}
    for name, (heads, dim) in cache_spec((name, shape) for name, shape, _ in inputs).items():
        layer = int(name[len(PAST_PREFIX):].split(".")[0])
        rule, n = (lengths or {}).get(name, ("", 1))
        size = 0 if rule in (WINDOW, TAIL) else heads * dim * int(item_size[name]) // n
        grown[layer] = grown.get(layer, 0) + size
    return {(layer_types[layer] if layer_types else "attention"): size for layer, size in sorted(grown.items())}


def cache_length(rule: str, n: int, total: int) -> int:
    """Entries a cache tensor of ``rule`` holds after ``total`` positions: ``window`` the last n (a shifted buffer,
    by slots: padding counts), ``pooled`` one per n positions (a row's entry w pools its own positions
    [w n, (w + 1) n); a left-padded row's last entries wait for their window, masked until then), ``tail`` n from
    the first step on (the projections of the incomplete window and, where windows overlap, of the one before,
    aligned to a window's start: a fixed buffer, empty only before the first step)."""
    if rule == WINDOW:
        return min(total, n)
    if rule == POOLED:
        return total // n
    if rule == TAIL:
        return n if total else 0
    raise ValueError(f"unknown cache length rule {rule!r}")


def cache_lengths(metadata: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    """{past_key_values.* input: (rule, n)} of the cache tensors a graph's metadata says do not grow by one entry
    per position (CACHE_LENGTHS); empty for a graph whose every cache tensor does."""
    return {PAST_PREFIX + name: (rule, int(n)) for name, (rule, n) in
            json.loads(metadata.get(CACHE_LENGTHS) or "{}").items()}


def cache_bytes_at(inputs: list[tuple[str | None, Any, Any]], metadata: Mapping[str, str], total: int) -> int:
    """Bytes a graph's whole cache holds for one sequence after ``total`` positions, from its (input name, shape,
    item size) triples and its length rules (cache_lengths)."""
    rules = cache_lengths(metadata)
    item_size = {name: size for name, _, size in inputs}
    held = 0
    for name, (heads, dim) in cache_spec((name, shape) for name, shape, _ in inputs).items():
        length = cache_length(*rules[name], total) if name in rules else total
        held += heads * dim * int(item_size[name]) * length
    return held


def cache_dtype(metadata: Mapping[str, str]) -> str:
    """The numpy name of the element type a graph's cache tensors are stored in (CACHE_DTYPE; float32 if absent)."""
    return metadata.get(CACHE_DTYPE) or "float32"


def extra_cache_kinds(metadata: dict[str, str]) -> list[str]:
    """The per-layer cache kinds beyond key and value (``past_key_values.N.<kind>``, e.g. DeepSeek-V3.2's
    ``index_key``) that a graph's metadata records (``CACHE_KINDS``; a graph without it has key and value only).
    Read from the metadata because a stateful IR has its caches as variables, not inputs."""
    return [kind for kind in json.loads(metadata.get(CACHE_KINDS) or "[]") if kind not in ("key", "value")]


def graph_inputs(path: Path) -> list[tuple[str, list[int]]]:
    """(name, shape) of every input of a graph file: an ONNX model (its weights are not read) or an OpenVINO IR
    (.xml). A dynamic axis is 0 in ONNX and -1 in an IR."""
    if Path(path).suffix == ".xml":
        import openvino as ov  # loaded only where an IR is read

        model = ov.Core().read_model(str(path))
        return [(port.get_any_name(), [d.get_length() if d.is_static else -1 for d in port.get_partial_shape()])
                for port in model.inputs]
    return onnx_inputs(_onnx_model(path).graph)


def onnx_inputs(graph) -> list[tuple[str, list[int]]]:
    """(name, shape) of every input of an ONNX graph (a GraphProto); a dynamic axis is 0."""
    return [(value.name, [d.dim_value for d in value.type.tensor_type.shape.dim]) for value in graph.input]


def graph_cache_spec(path: Path) -> dict[str, tuple[int, int]]:
    """The cache spec (``cache_spec``) of a graph file."""
    return cache_spec(graph_inputs(path))


def graph_metadata(path: Path) -> dict[str, str]:
    """The exporter's metadata of a graph file (an ONNX model, or an OpenVINO IR converted from one)."""
    if Path(path).suffix == ".xml":
        import openvino as ov  # loaded only where an IR is read

        return openvino_metadata(ov.Core().read_model(str(path)))
    return {p.key: p.value for p in _onnx_model(path).metadata_props}


def openvino_metadata(model) -> dict[str, str]:
    """The exporter's metadata of an OpenVINO model (its rt_info under "framework")."""
    if not model.has_rt_info(["framework"]):
        return {}
    return {str(key): value.astype(str) for key, value in model.get_rt_info(["framework"]).astype(dict).items()}


def require_positional_cache(metadata: Mapping[str, str], what: str) -> None:
    """InputError unless every cache tensor of a graph (its metadata) holds one entry per position, as ``what``
    (a runner that cuts, pads or merges caches along the sequence axis) needs: DeepSeek-V4's compressed layout
    does not (CACHE_LENGTHS)."""
    if cache_lengths(metadata):
        raise InputError(f"{what} needs a cache of one entry per position, and this graph keeps DeepSeek-V4's "
                         f"compressed cache (a bounded window, pooled entries, a tail); build it with "
                         f"export.v4_cache: per-token (dstc export --v4-cache per-token) for that")


def moe_lowering(metadata: Mapping[str, str], op_types: Iterable[str]) -> str | None:
    """The MoE lowering of an ONNX graph (MOE_LOWERING), None for a graph without MoE layers. ``metadata``: the
    graph's; ``op_types``: its node types, read only for a graph exported before the exporter recorded its
    lowering, which is told by its nodes as the stages told it then (com.microsoft MoE, or QMoE once compressed:
    fused-onnxruntime; the tiled block's FusedMatMul: fused-openvino)."""
    if metadata.get(MOE_LAYERS) == "[]":
        return None
    if MOE_LOWERING in metadata:
        return metadata[MOE_LOWERING]
    kinds = set(op_types)
    if kinds & {"MoE", "QMoE"}:
        return "fused-onnxruntime"
    return "fused-openvino" if "FusedMatMul" in kinds else "dispatch"


def _onnx_model(path: Path):
    import onnx  # the graph's structure only: its external weights stay on disk

    return onnx.load(str(path), load_external_data=False)


def check_onnx_graph(path: Path, recomputed: str | None = None) -> None:
    """InputError unless ``path`` parses as an ONNX model whose external weights are all present: a truncated
    or foreign file fails here, in one line, instead of deep inside a runtime or NNCF. ``recomputed``: a weights
    file that was not written, its tensors recomputed by the stage that reads them (an export's ``deferred``)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path} is not a readable ONNX model: {reason}") from None
    if not model.graph.node:
        raise InputError(f"{path} is not a readable ONNX model: its graph is empty")
    ends: dict[str, int] = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        name = info.get("location", "")
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        ends[name] = max(ends.get(name, 0), end)
    for name, end in ends.items():
        data = path.parent / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise InputError(f"{path} refers to weights outside its directory ({name})")
        if name == recomputed and not data.exists():
            continue
        if not data.is_file():
            raise InputError(f"{path} needs its weights file {data}, which is missing")
        if data.stat().st_size < end:
            raise InputError(f"{data} is truncated: {data.stat().st_size} bytes, the graph reads up to byte {end}")
