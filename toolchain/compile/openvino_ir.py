"""OpenVINO backend: model.onnx -> a stateful IR that optimum-intel's OVModelForCausalLM and openvino_genai's
LLMPipeline load as they load their own exports.

The layout they expect, and what this module builds:

- ``openvino_model.xml/.bin``: inputs ``input_ids``, ``attention_mask``, ``position_ids`` and ``beam_idx``
  ([batch] int32), output ``logits``. Every ``past_key_values.N.*`` input and its ``present.N.*`` output become
  one variable (ReadValue ... Assign), so the KV cache lives inside the infer request between calls. A Gather
  on the batch axis with ``beam_idx`` reorders the cache read from each variable (what beam search needs;
  greedy passes ``arange(batch)``). Each ReadValue is initialised with zeros of ``[batch, heads, 0, dim]``,
  batch taken from ``input_ids``, so the first call of a new sequence starts from an empty cache of the right
  batch.
- ``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml`` from openvino-tokenizers (the chat template and
  the special token ids go into their rt_info, where openvino_genai reads them);
- the checkpoint's ``config.json``, ``generation_config.json`` and tokenizer files, read by optimum-intel
  (AutoConfig, GenerationConfig) and by openvino_genai (generation defaults, eos ids).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from toolchain.interface.files import DETOKENIZER_XML, MODEL_XML, TOKENIZER_XML, weights_of
from toolchain.interface.graph import BATCH_AXIS, BEAM_IDX, INPUT_IDS, PAST_PREFIX, present_of
from toolchain.tokenizer_loading import load_tokenizer

# CPU plugin settings the artifact records in the IR's rt_info ``runtime_options``, which OpenVINO's compile_model
# applies (checked by benchmarks/openvino_settings.py), so openvino_genai, optimum-intel and dstc's runner all get
# them. KV cache f16, chosen by that benchmark (openvino_genai's stateful pipeline, R1-Distill-Qwen-1.5B and
# V2-Lite widths, prompts of 128 and 2k): the same speed as u8 and f32 (within 1 ms/token), the greedy tokens of
# the f32 cache (64 of 64), where the plugin's default u8 gave other tokens after 2-30 of 64, and NaN logits in a
# batch of 2 after a batch of 1 (toolchain/verify/smoke.py). The dynamic quantization group (0/32/64/128) made no
# measurable difference and threads belong to the machine: both stay the plugin's. Inference precision stays the
# plugin's too (bf16 where the CPU has bf16 instructions): the plugin ignores one stored in rt_info. Checks
# compile at toolchain/runtime/engines.py's "exact" numerics instead, passed as properties, which win over rt_info.
RUNTIME_OPTIONS = {"KV_CACHE_PRECISION": "f16"}


# a name OpenVINO made up for a node, its type and a process-wide counter, as a whole name or a part of one
# ("Transpose_2189305/scale", "Convert_14036.0")
MADE_UP_NAME = re.compile(r"(?<![^/])([A-Z][A-Za-z0-9]*)_\d+(?=$|[/.])")

def _names(ports) -> list[str]:
    return [p.get_any_name() for p in ports]


def fuse_beam_reorder(model) -> None:
    """Add the ``beam_idx`` [batch] int32 input and read every past_key_values.* input through
    Gather(past, beam_idx, axis=batch)."""
    import openvino as ov
    from openvino import opset13 as ops

    if BEAM_IDX in _names(model.inputs):
        raise ValueError(f"the model already has a {BEAM_IDX} input")
    batch = model.input(INPUT_IDS).get_partial_shape()[BATCH_AXIS]
    beam_idx = ops.parameter(ov.PartialShape([batch]), ov.Type.i32, name=BEAM_IDX)
    beam_idx.output(0).get_tensor().set_names({BEAM_IDX})
    model.add_parameters([beam_idx])
    axis = ops.constant(np.int64(BATCH_AXIS))
    for name in _names(model.inputs):
        if not name.startswith(PAST_PREFIX):
            continue
        past = model.input(name)
        consumers = list(past.get_target_inputs())
        reordered = ops.gather(past, beam_idx, axis).output(0)
        for consumer in consumers:
            consumer.replace_source_output(reordered)
    model.validate_nodes_and_infer_types()


def make_stateful(model) -> int:
    """Turn each past_key_values.* input / present.* output pair into a variable, initialised with an empty
    cache of input_ids' batch. Returns the number of variables."""
    import openvino as ov
    from openvino import opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    outputs = set(_names(model.outputs))
    pairs = {}
    for name in _names(model.inputs):
        if name.startswith(PAST_PREFIX):
            present = present_of(name)
            if present not in outputs:
                raise ValueError(f"{name} has no {present} output")
            pairs[name] = present
    if not pairs:
        raise ValueError("the model has no past_key_values.* inputs")
    apply_make_stateful_transformation(model, pairs)

    shape = ops.shape_of(model.input(INPUT_IDS), output_type="i64")
    batch = ops.gather(shape, ops.constant(np.array([BATCH_AXIS], np.int64)), ops.constant(np.int64(0)))
    read_values = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    for read_value in read_values:
        if read_value.get_output_element_type(0) != ov.Type.f32:
            # A float16 variable (export.cache_dtype) keeps the initial value of optimum-intel's own stateful
            # exports, the plugin's empty tensor, which the beam_idx Gather reads as zeros of the batch: OpenVINO
            # 2026.4's CPU plugin fails an initialiser subgraph for it (its first infer, or the first after a
            # reset_state that follows a decode step: "Can not clone with new dims", "Eltwise shape infer ...
            # mismatch"). Float32 variables keep theirs, so their IR is unchanged.
            continue
        dims = []
        for axis, dim in enumerate(read_value.get_output_partial_shape(0)):
            if axis == BATCH_AXIS:
                dims.append(batch)
            else:  # heads and head dim are static; the sequence axis starts empty
                dims.append(ops.constant(np.array([dim.get_length() if dim.is_static else 0], np.int64)))
        zeros = ops.broadcast(ops.constant(0.0, dtype=read_value.get_output_element_type(0)),
                              ops.concat(dims, axis=0))
        read_value.set_arguments([zeros])
    model.validate_nodes_and_infer_types()
    return len(read_values)


def convert(graph_path: Path, versions: dict[str, str]):
    """model.onnx (or an already converted, e.g. compressed, stateless IR .xml) -> stateful ov.Model, with the
    versions that made it in rt_info (optimum-intel reads optimum/transformers_version to pick the generation
    code path for some model types) and RUNTIME_OPTIONS in rt_info ``runtime_options``."""
    import openvino as ov

    if Path(graph_path).suffix == ".xml":
        model = ov.Core().read_model(str(graph_path))
    else:
        model = ov.convert_model(str(graph_path))
    fuse_beam_reorder(model)
    make_stateful(model)
    for key, value in versions.items():
        model.set_rt_info(value, ["optimum", key])
    for key, value in RUNTIME_OPTIONS.items():
        model.set_rt_info(value, ["runtime_options", key])
    return model


def stable_names(model):
    """``model`` with the names OpenVINO makes up (``Transpose_2189305``: its type and a counter of every node the
    process has created), kept by constant folding, by NNCF in the names it derives (``Transpose_2189305/scale``)
    and by openvino-tokenizers, numbered in the order the graph's nodes first use them instead: otherwise an IR's
    bytes depend on what the process did before (an earlier build, a stage run rather than reused from the cache,
    a reused Ray worker)."""
    numbers: dict[str, str] = {}

    def renumbered(name: str) -> str:
        return MADE_UP_NAME.sub(lambda m: numbers.setdefault(m[0], f"{m[1]}_{len(numbers)}"), name)

    for op in model.get_ordered_ops():
        op.set_friendly_name(renumbered(op.get_friendly_name()))
        for output in op.outputs():
            if names := output.get_names():
                # a port's names come as a set, whose order follows the process's string hashes: numbered in an
                # order of their own (the made-up numbers masked), two names of one port are numbered alike in
                # every process (DeepSeek-V4's compressor/ and indexer/ Shape_N swapped between runs)
                output.set_names({renumbered(n) for n in sorted(names, key=lambda n: (MADE_UP_NAME.sub(r"\1", n), n))})
    return model


def convert_tokenizers(source: Path, out_dir: Path) -> list[str]:
    """openvino_tokenizer.xml and openvino_detokenizer.xml from the checkpoint's Hugging Face tokenizer."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    tokenizer = load_tokenizer(source)
    tokenizer.padding_side = "left"  # as optimum-intel exports it for text generation
    tokenizer_model, detokenizer_model = convert_tokenizer(tokenizer, with_detokenizer=True)
    ov.save_model(stable_names(tokenizer_model), out_dir / TOKENIZER_XML)
    ov.save_model(stable_names(detokenizer_model), out_dir / DETOKENIZER_XML)
    return [TOKENIZER_XML, weights_of(TOKENIZER_XML), DETOKENIZER_XML, weights_of(DETOKENIZER_XML)]


def write(onnx_path: Path, source: Path, out_dir: Path, versions: dict[str, str], has_tokenizer: bool,
          log: Callable[[str], None]) -> dict:
    import openvino as ov

    log("converting model.onnx to OpenVINO IR and making the KV cache stateful")
    model = convert(onnx_path, versions)
    ov.save_model(stable_names(model), out_dir / MODEL_XML, compress_to_fp16=False)
    files = [MODEL_XML, weights_of(MODEL_XML)]
    if has_tokenizer:
        log("converting the tokenizer with openvino-tokenizers")
        files += convert_tokenizers(source, out_dir)
    return {"files": files, "inputs": _names(model.inputs), "outputs": _names(model.outputs),
            "variables": len(model.get_sinks()), "runtime_options": dict(RUNTIME_OPTIONS)}
