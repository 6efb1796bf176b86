"""What each contender of benchmarks/peers.py reads per token and keeps per token, from its files (ONNX, OpenVINO IR,
GGUF), not from its timing: weight bytes (the embedding table apart, of which a token reads one row), routed
experts' share, the KV cache's bytes per token at the precision the runtime keeps it in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np


# A routed expert's weights, by the name of the initializer (ONNX) or of the MatMul reading it (OpenVINO), or a
# GGUF tensor of stacked experts; shared experts are read by every token.
EXPERT = re.compile(r"(?<!shared_)experts[./]\d+[./]|_exps\.")
PROMPT_ONLY = re.compile(r"_prefill_(int8|scale)(_\d+)?$")


def _onnx_sizes(path: Path) -> tuple[int, int, int, int]:
    """(weight bytes, embedding-table bytes, KV-cache bytes per token, routed-expert bytes) of an ONNX decoder:
    initializers read by a Gather of input_ids (directly or after a Cast) and by nothing else are the table; the
    cache from the past_key_values inputs' head count, head size and element type."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    sizes = {}
    for init in graph.initializer:
        external = {e.key: e.value for e in init.external_data}
        sizes[init.name] = int(external["length"]) if "length" in external else (
            len(init.raw_data) or int(np.prod(init.dims)) * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize)
    ids = {"input_ids"} | {n.output[0] for n in graph.node if n.op_type == "Cast" and n.input[0] == "input_ids"}
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type if not (node.op_type == "Gather" and node.input[1] in ids)
                                                else "table-gather")
    table = sum(size for name, size in sizes.items() if readers.get(name) == {"table-gather"})
    genai = path.parent / "genai_config.json"  # the builder leaves the head size symbolic in the graph
    head_size = json.loads(genai.read_text())["model"]["decoder"]["head_size"] if genai.is_file() else 0
    kv = 0
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            dims = value.type.tensor_type.shape.dim
            element = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).itemsize
            kv += dims[1].dim_value * (dims[3].dim_value or head_size) * element
    experts = sum(size for name, size in sizes.items() if EXPERT.search(name))
    # prefill-int8's copies are read by prompts only (If branches), not by a decode step
    prompt_only = sum(size for name, size in sizes.items() if PROMPT_ONLY.search(name))
    return sum(sizes.values()) - prompt_only, table, kv, experts


def _openvino_sizes(xml: Path, kv_precision: str) -> tuple[int, int, int, int]:
    """The same for an OpenVINO IR: Constants feeding a Gather of input_ids (through Convert / Subtract / Multiply
    of the compressed table) and nothing else; the cache from the stateful model's variables."""
    import openvino as ov

    model = ov.Core().read_model(str(xml))
    constants = [op for op in model.get_ops() if op.get_type_name() == "Constant"]
    total = sum(op.get_byte_size() for op in constants)
    table = 0
    for op in model.get_ops():
        if op.get_type_name() != "Gather" or "input_ids" not in _sources(op.input_value(1)):
            continue
        stack, seen = [op.input_value(0).get_node()], set()
        while stack:
            node = stack.pop()
            if node.get_friendly_name() in seen:
                continue
            seen.add(node.get_friendly_name())
            if node.get_type_name() == "Constant":
                if all(t.get_node() is op or t.get_node().get_friendly_name() in seen
                       for out in node.outputs() for t in out.get_target_inputs()):
                    table += node.get_byte_size()
            elif node.get_type_name() in ("Convert", "Subtract", "Multiply", "Reshape"):
                stack += [v.get_node() for v in node.input_values()]
    element = {"u8": 1, "i8": 1, "u4": 0.5, "bf16": 2, "f16": 2, "f32": 4}.get(kv_precision, 4)
    kv = 0
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            shape = op.get_output_partial_shape(0)
            kv += shape[1].get_length() * shape[3].get_length() * element
    experts = sum(op.get_byte_size() for op in constants if any(EXPERT.search(name) for name in _matmuls_fed(op)))
    return total, table, int(kv), experts


def _matmuls_fed(constant, depth: int = 5) -> set[str]:
    """Friendly names of the MatMuls a Constant feeds through decompression (Convert, Subtract, Multiply, Reshape,
    Transpose)."""
    names, stack = set(), [(constant, 0)]
    while stack:
        node, level = stack.pop()
        for out in node.outputs():
            for target in out.get_target_inputs():
                reader = target.get_node()
                if reader.get_type_name() == "MatMul":
                    names.add(reader.get_friendly_name())
                elif level < depth and reader.get_type_name() in ("Convert", "Subtract", "Multiply", "Reshape",
                                                                   "Transpose"):
                    stack.append((reader, level + 1))
    return names


def _sources(value, depth: int = 4) -> set[str]:
    """Names of the Parameters within ``depth`` ops above ``value``."""
    node = value.get_node()
    if node.get_type_name() == "Parameter":
        return set(value.get_names())
    if depth == 0:
        return set()
    return set().union(*[_sources(v, depth - 1) for v in node.input_values()] or [set()])


def _gguf_sizes(path: Path) -> tuple[int, int, int, int]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    table = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0

    def field(suffix: str) -> int:
        key = next(k for k in reader.fields if k.endswith(suffix))
        return int(reader.fields[key].parts[reader.fields[key].data[0]][0])

    layers, heads = field(".block_count"), field(".attention.head_count")
    kv_heads = field(".attention.head_count_kv") if any(k.endswith(".head_count_kv") for k in reader.fields) \
        else heads
    head_dim = field(".embedding_length") // heads
    experts = sum(size for name, size in tensors.items() if EXPERT.search(name))
    # f16 cache, llama.cpp's default
    return sum(tensors.values()), table, layers * 2 * kv_heads * head_dim * 2, experts


def _ov_kv_precision(directory: Path) -> str:
    """The KV-cache precision openvino_genai compiles an IR with: the IR's runtime_options, else the plugin's
    default on this CPU."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(directory / "openvino_model.xml"))
    if model.has_rt_info(["runtime_options", "KV_CACHE_PRECISION"]):
        return str(model.get_rt_info(["runtime_options", "KV_CACHE_PRECISION"]).astype(str))
    value = core.get_property("CPU", "KV_CACHE_PRECISION")  # an ov.Type: its short name (u8, bf16, f16, ...)
    return value.get_type_name() if hasattr(value, "get_type_name") else str(value)


def footprint(kind: str, path: Path, active_experts: float = 1.0) -> dict:
    """Bytes read per token (weights but the table; of the routed experts' weights the share ``active_experts``,
    experts per token over routed experts, that one token reads at batch 1), and KV-cache bytes per token with
    its precision."""
    if kind in ("dstc-ort", "dstc-ort-prefill8", "dstc-ort-noprefill8", "dstc-ort-genai", "ortgenai-builder"):
        total, table, kv, experts = _onnx_sizes(path / "model.onnx")
        precision = "f32"
    elif kind == "llamacpp-q4km":
        total, table, kv, experts = _gguf_sizes(path / "model-q4_k_m.gguf")
        precision = "f16"
    else:
        precision = _ov_kv_precision(path)
        total, table, kv, experts = _openvino_sizes(path / "openvino_model.xml", precision)
    return {"weight_bytes": total, "table_bytes": table, "routed_expert_bytes": experts,
            "bytes_per_token": per_token_bytes(total, table, experts, active_experts),
            "kv_bytes_per_token": kv, "kv_precision": precision}


def per_token_bytes(total: int, table: int, experts: int, active_experts: float) -> int:
    """Weight bytes one generated token reads: all but the embedding table (one row of it) and, of the routed
    experts, the active share."""
    return int(total - table - experts * (1 - active_experts))


def active_experts(config: dict) -> float:
    """Experts per token over routed experts (1.0 for a dense model)."""
    routed = config.get("n_routed_experts")
    return config["num_experts_per_tok"] / routed if routed else 1.0
