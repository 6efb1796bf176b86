"""One decoding session: a KV cache that forward() appends to, on OpenVINO, ONNX Runtime or a stateless graph.

Every decoder takes the same calls: ``forward(input_ids [B, S], attention_mask [B, past + S])`` returns the logits
of the S new positions and keeps their keys and values; position ids come from the attention mask (``positions``:
cumsum - 1, clipped at 0), so a left-padded batch decodes as the padding were not there.

* :class:`OnnxRuntimeDecoder`: an ORT graph with IO binding, the cache kept in ORT's OrtValues;
* :class:`OpenVINODecoder`: a stateful IR, the cache in its infer request's variables, at ``deployment`` numerics
  (what users run; ``runtime_config`` reads back what was applied) or ``exact`` ones (toolchain/runtime/engines.py);
* :class:`StatelessDecoder`: any graph with past_key_values.* inputs and present.* outputs, run by a GraphRunner,
  the cache kept as arrays (export parity, compile verification).

The three also ``rollback(keep)`` their cache to its first positions (a speculative step's rejected drafts): cut,
or replayed from a checkpoint where the cache holds no entry per position (toolchain/runtime/cache_replay.py); and
feed a prompt longer than their ``chunking`` allows in query chunks through the cache
(toolchain/runtime/prefill_chunks.py: MLA's latent graph would otherwise hold a score tensor quadratic in it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from toolchain.errors import InputError
from toolchain.hardware import cpu_flags
from toolchain.interface.files import MODEL_XML, ONNX_MODEL
from toolchain.interface.graph import (
    ATTENTION_MASK,
    BEAM_IDX,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    SEQUENCE_AXIS,
    cache_lengths,
    cache_spec,
    openvino_metadata,
    present_of,
)
from toolchain.runtime import engines
from toolchain.runtime.appending_cache import AppendingCache
from toolchain.runtime.artifact import Artifact, load_error
from toolchain.runtime.cache_replay import ReplayRollback
from toolchain.runtime.kernel_caches import KernelCaches, kernel_caches
from toolchain.runtime.last_logits import (
    INPUT as LOGITS_TO_KEEP,
    onnx_with_logits_to_keep,
    openvino_with_logits_to_keep,
)
from toolchain.runtime.memory import require_artifact_memory
from toolchain.runtime.prefill_chunks import PrefillChunking


class Decoder(Protocol):
    backend: str
    threads: int
    load_seconds: float
    runtime_config: dict
    extras: dict[str, np.ndarray]  # the requested extra outputs of the last forward

    def reset(self) -> None:
        """Empty the KV cache: the next forward starts a new batch of sequences."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0,
                inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """float32 logits [B, S, vocab] of the new positions (of the last ``logits_to_keep`` of them, 0: all);
        their keys and values join the cache. ``inputs``: the graph's further inputs (an MTP graph's
        hidden_states, toolchain/export/mtp.py)."""


class RewindableDecoder(Decoder, Protocol):
    """A Decoder whose cache can be cut back, as speculative decoding needs after a rejected draft
    (toolchain/runtime/speculative.py)."""

    def rollback(self, keep: int) -> None:
        """Keep the cache's first ``keep`` positions (columns of the attention mask so far, padding included) and
        drop the rest: the next forward continues from position ``keep``."""


def trimmed(cache: np.ndarray, keep: int) -> np.ndarray:
    """A cache tensor's first ``keep`` positions. Every cache tensor, whatever it holds (per-head keys and values,
    MLA's latent, DeepSeek-V3.2's indexer keys, DeepSeek-V4's per-token state), has the graph interface's layout:
    one entry per position on SEQUENCE_AXIS (toolchain/interface/graph.py)."""
    held = cache.shape[SEQUENCE_AXIS]
    if not 0 <= keep <= held:
        raise ValueError(f"cannot keep {keep} positions of a cache that holds {held}")
    return np.ascontiguousarray(cache[(slice(None),) * SEQUENCE_AXIS + (slice(0, keep),)])


def positions(attention_mask: np.ndarray, new: int) -> np.ndarray:
    return np.clip(attention_mask.cumsum(-1) - 1, 0, None)[:, -new:]


# ONNX Runtime's element types of a cache input, as numpy's
ORT_CACHE_DTYPES: dict[str, type[np.floating]] = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def ort_cache(session) -> dict[str, tuple[int, int, type[np.floating]]]:
    """{past_key_values.* input: (heads, head dim, numpy dtype)} of an ONNX Runtime session's graph."""
    inputs = session.get_inputs()
    types = {i.name: i.type for i in inputs}
    return {name: (heads, dim, ORT_CACHE_DTYPES[types[name]])
            for name, (heads, dim) in cache_spec((i.name, i.shape) for i in inputs).items()}


class OnnxRuntimeDecoder(ReplayRollback):
    backend = "onnxruntime"

    def __init__(self, path: Path, threads: int | None, extra_outputs: Sequence[str],
                 chunking: PrefillChunking | None = None) -> None:
        import onnx

        self.chunking = chunking
        started = time.perf_counter()
        # The graph goes as bytes (with logits_to_keep, and any extra outputs): it finds its external weights in
        # its directory.
        proto = onnx.load_from_string(engines.with_extra_outputs(path, extra_outputs))
        onnx_with_logits_to_keep(proto)
        options = engines.ort_options(threads=threads or os.cpu_count() or 1, external_dir=Path(path).parent)
        self.session = engines.ort_session(proto.SerializeToString(), options)
        self.load_seconds = time.perf_counter() - started
        applied = self.session.get_session_options()
        self.threads = applied.intra_op_num_threads
        self.runtime_config = {
            "providers": self.session.get_providers(),
            "intra_op_num_threads": applied.intra_op_num_threads,
            "inter_op_num_threads": applied.inter_op_num_threads,
            "graph_optimization_level": applied.graph_optimization_level.name,
            "execution_mode": applied.execution_mode.name,
            "enable_cpu_mem_arena": applied.enable_cpu_mem_arena,
            "enable_mem_pattern": applied.enable_mem_pattern,
        }
        # the exporter's metadata: its cache layout (CACHE_LENGTHS) says whether the cache is cut back or replayed
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        self.replays = bool(cache_lengths(self.metadata))
        self._past = ort_cache(self.session)
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._extra = list(extra_outputs)
        self.extra_outputs = tuple(extra_outputs)  # what a batch over its session reads too (batching.py)
        self._binding = self.session.io_binding()
        self.cache: dict = {}  # past_key_values.* input -> the OrtValue the last run returned for it
        self.extras: dict[str, np.ndarray] = {}

    def reset(self) -> None:
        self.cache = {}
        self._checkpoint = None

    def _state(self) -> object:
        return dict(self.cache)  # the OrtValues a run returned, which no later run writes to

    def _restore(self, state: object | None) -> None:
        self.cache = dict(state) if isinstance(state, dict) else {}

    def rollback(self, keep: int) -> None:
        from onnxruntime import OrtValue

        if self.replays:
            self._replay(keep)
            return
        # Copied out of ORT and back: a rollback is once per verify step, not per token, and an OrtValue has no
        # view of part of itself.
        self.cache = {name: OrtValue.ortvalue_from_numpy(trimmed(value.numpy(), keep))
                      for name, value in self.cache.items()}

    def _forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int,
                 inputs: dict[str, np.ndarray] | None) -> np.ndarray:
        ids = np.ascontiguousarray(input_ids, np.int64)
        mask = np.ascontiguousarray(attention_mask, np.int64)
        binding = self._binding
        for name, value in (inputs or {}).items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        binding.bind_cpu_input(INPUT_IDS, ids)
        binding.bind_cpu_input(ATTENTION_MASK, mask)
        binding.bind_cpu_input(LOGITS_TO_KEEP, np.array(logits_to_keep, np.int64))
        binding.bind_cpu_input(POSITION_IDS, np.ascontiguousarray(positions(mask, ids.shape[1])))
        for name, value in (self.cache or self._empty_cache(len(ids))).items():
            binding.bind_ortvalue_input(name, value)
        # Outputs are re-bound to the device each step rather than to last step's buffers: present.* grows by
        # the new positions, and ORT allocates each output at its new shape.
        binding.clear_binding_outputs()
        for name in self._outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        values = dict(zip(self._outputs, binding.get_outputs()))
        # The cache stays in ORT's OrtValues: each present.* is bound as the next step's past input as is, with
        # no copy to numpy and back per step (that copy grows with the context and the layer count).
        self.cache = {name: values[present_of(name)] for name in self._past}
        self.extras = {name: values[name].numpy() for name in self._extra}
        return values[LOGITS].numpy()

    def _empty_cache(self, batch: int) -> dict:
        from onnxruntime import OrtValue

        return {name: OrtValue.ortvalue_from_shape_and_type([batch, heads, 0, dim], dtype, "cpu", 0)
                for name, (heads, dim, dtype) in self._past.items()}


class OpenVINODecoder(ReplayRollback):
    backend = "openvino"

    def __init__(self, path: Path, threads: int | None, extra_outputs: Sequence[str], numerics: str,
                 chunking: PrefillChunking | None = None, caches: KernelCaches | None = None) -> None:
        import openvino as ov

        self.kernel_caches = caches or KernelCaches(None, None, "the defaults")
        self.kernel_caches.apply()  # oneDNN's, before this process's first compile (kernel_caches.py)
        started = time.perf_counter()
        model = engines.openvino_read(path)
        self.metadata = openvino_metadata(model)
        self.replays = bool(cache_lengths(self.metadata))
        # the CPU plugin's SDPA kernel blocks over the keys and holds no [heads, new, past + new] scores, and a
        # prompt fed in chunks cost 2.5-3x its one-shot prefill there (4096 tokens at R1-Distill-Qwen-1.5B widths x 4
        # layers: 10.2-12.0 s against 3.8-4.1 s): only a graph whose attention is MatMuls (MLA's latent) is chunked
        self.chunking = None if _fused_attention(model) else chunking
        if extra_outputs:
            model.add_outputs(list(extra_outputs))
        openvino_with_logits_to_keep(model)
        read_seconds = time.perf_counter() - started
        # The plugin's defaults with the IR's rt_info runtime_options, as openvino_genai and optimum-intel deploy
        # the IR (bf16 compute where the CPU has bf16 instructions; the KV cache a dstc artifact records, else the
        # plugin's u8): what is measured is what users run, and runtime_config says what it was. "exact" (on
        # request) separates the weights' error from the plugin's bf16 compute, KV cache precision and on-the-fly
        # int8 activations, which the deployment defaults add.
        config = {**engines.NUMERICS[numerics], **({"INFERENCE_NUM_THREADS": threads} if threads else {}),
                  **self.kernel_caches.properties()}
        if numerics == "deployment" and _fused_mlp_divides_by_zero(model, config):
            raise InputError(
                f"OpenVINO {ov.__version__.split('-')[0]}'s CPU plugin crashes (SIGFPE) compiling {path} at "
                "bf16 with one thread on a CPU with AMX: its fused MLP kernel needs two threads per stream "
                "(openvinotoolkit/openvino#28550); use 2 or more threads, or f32 (--openvino-f32)")
        started = time.perf_counter()  # the check is dstc's, not part of loading the model
        compiled = engines.openvino_compile(model, "deployment", config=config)
        self.compiled = compiled
        self.request = compiled.create_infer_request()  # the cache lives in its variables
        self.load_seconds = read_seconds + time.perf_counter() - started
        self.threads = int(compiled.get_property("INFERENCE_NUM_THREADS"))
        self.runtime_config = {"device": "CPU", **{
            name: _plain(compiled.get_property(name)) for name in compiled.get_property("SUPPORTED_PROPERTIES")
            if name != "SUPPORTED_PROPERTIES"}}
        self._logits = compiled.output(LOGITS)
        self._extra = {name: compiled.output(name) for name in extra_outputs}
        self.extra_outputs = tuple(extra_outputs)  # what a batch over its infer request reads too
        self.extras: dict[str, np.ndarray] = {}

    def reset(self) -> None:
        self.request.reset_state()
        self._checkpoint = None

    def _state(self) -> object:
        return [np.array(state.state.data) for state in self.request.query_state()]

    def _restore(self, state: object | None) -> None:
        import openvino as ov

        if state is None:
            self.request.reset_state()
            return
        assert isinstance(state, list)
        for variable, value in zip(self.request.query_state(), state):
            variable.state = ov.Tensor(np.array(value))  # the checkpoint may be restored again

    def rollback(self, keep: int) -> None:
        import openvino as ov

        if self.replays:
            self._replay(keep)
            return
        # Each variable read, cut on the sequence axis and set back, as openvino_genai trims its stateful KV cache
        # (utils::trim_kv_cache). The state reads in the variable's declared precision (f32): the plugin converts
        # from and back to the cache precision it keeps (f16 the artifact records, or f32 at exact numerics), which
        # is exact both ways.
        for state in self.request.query_state():
            state.state = ov.Tensor(trimmed(np.asarray(state.state.data), keep))

    def _forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int,
                 inputs: dict[str, np.ndarray] | None) -> np.ndarray:
        ids = np.ascontiguousarray(input_ids, np.int64)
        mask = np.ascontiguousarray(attention_mask, np.int64)
        result = self.request.infer({**{name: np.ascontiguousarray(value) for name, value in (inputs or {}).items()},
                                     INPUT_IDS: ids, ATTENTION_MASK: mask,
                                     POSITION_IDS: np.ascontiguousarray(positions(mask, ids.shape[1])),
                                     BEAM_IDX: np.arange(len(ids), dtype=np.int32),
                                      LOGITS_TO_KEEP: np.array(logits_to_keep, np.int64)},
                                     share_inputs=True, share_outputs=True)
        # Shared outputs are the request's own buffers, overwritten by the next infer: keep copies.
        self.extras = {name: np.array(result[port]) for name, port in self._extra.items()}
        return np.array(result[self._logits], dtype=np.float32)


def _fused_mlp_divides_by_zero(model, config: dict) -> bool:
    """Whether compiling ``model`` with ``config`` kills the process with SIGFPE (OpenVINO 2026.4; open upstream as
    openvinotoolkit/openvino#28550 and #33300).

    On an AMX CPU at bf16 the CPU plugin fuses each gated MLP into its LLMMLP node, whose down projection divides
    its output blocks among threads / 2 thread pairs: zero pairs with one thread per stream (INFERENCE_NUM_THREADS=1,
    or a process that may use one CPU whatever the setting). Measured on a Xeon with AMX: fp32 weights crash at 1
    thread and compile at 2 or 3; INT4/INT8 weights are not fused and compile at 1; f32 compute is not fused. No
    property keeps bf16 and avoids it (streams, pinning, hyper-threading, TBB partitioner, core type and dynamic
    quantization crash alike), so the decoder refuses rather than measure another precision than users deploy.
    """
    if "amx_bf16" not in cpu_flags() or not any(_is_fusable_mlp(op) for op in model.get_ordered_ops()):
        return False
    import openvino as ov
    import openvino.opset13 as opset

    # Threads, streams and precision as the plugin resolves them from the config and the CPUs this process may use,
    # read back from a one-op model (~30 ms).
    x = opset.parameter([1], ov.Type.f32)
    probe = engines.openvino_compile(ov.Model([opset.relu(x)], [x], "probe"), "deployment", config=config)
    per_stream = int(probe.get_property("INFERENCE_NUM_THREADS")) // int(probe.get_property("NUM_STREAMS"))
    return per_stream == 1 and probe.get_property("INFERENCE_PRECISION_HINT") == ov.Type.bf16


def _is_fusable_mlp(op) -> bool:
    """A down projection as the plugin's MLP fusion matches it, or more (gate and up are not checked): a MatMul by a
    float Constant, or a Convert of one, whose rank-3 input is a Multiply by a Swish or a Gelu."""
    if op.get_type_name() != "MatMul":
        return False
    weight = op.input_value(1).get_node()
    if weight.get_type_name() == "Convert":
        weight = weight.input_value(0).get_node()
    product = op.input_value(0)
    rank = product.get_partial_shape().rank
    return weight.get_type_name() == "Constant" and weight.get_element_type().is_real() \
        and product.get_node().get_type_name() == "Multiply" and rank.is_static and rank.get_length() == 3 \
        and any(v.get_node().get_type_name() in ("Swish", "Gelu") for v in product.get_node().input_values())


def _plain(value):
    """An OpenVINO property value as JSON: element types by name, enums and other objects as text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if hasattr(value, "get_type_name"):
        return value.get_type_name()
    return str(value)


def _fused_attention(model) -> bool:
    """Whether an OpenVINO model's attention is the plugin's ScaledDotProductAttention (per-head graphs after the
    compile stage's conversion; MLA's latent graph has none)."""
    return any(op.get_type_name() == "ScaledDotProductAttention" for op in model.get_ops())


def open_decoder(artifact: Artifact, *, threads: int | None = None, extra_outputs: Sequence[str] = (),
                 openvino_f32: bool = False, openvino_runtime_cache: int | None = None) -> RewindableDecoder:
    """A Decoder on the artifact's backend; ``threads`` None takes every CPU (ORT) or the plugin's choice
    (OpenVINO). ``extra_outputs``: graph values to return in ``extras`` after each forward. ``openvino_f32``:
    f32 compute and KV cache instead of the CPU plugin's deployment defaults (ONNX Runtime is fp32 already);
    ``openvino_runtime_cache``: the capacity of the CPU plugin's kernel caches, None dstc's choice for the artifact
    (toolchain/runtime/kernel_caches.py). A long prompt is prefilled in chunks (PrefillChunking.for_model) where the
    graph would hold its score tensor.
    InputError when the artifact would not fit in the memory available (toolchain/memory_guard.py) or its runtime
    cannot load it."""
    if threads is not None and threads < 1:
        raise InputError(f"threads must be at least 1, not {threads}")
    require_artifact_memory(artifact)
    chunking = PrefillChunking.for_model(artifact.config, artifact.size_bytes)
    try:
        if artifact.backend == "openvino":
            caches = kernel_caches(openvino_runtime_cache, artifact.metadata, artifact.size_bytes)
            return OpenVINODecoder(artifact.path / MODEL_XML, threads, tuple(extra_outputs),
                                   "exact" if openvino_f32 else "deployment", chunking, caches)
        return OnnxRuntimeDecoder(artifact.path / ONNX_MODEL, threads, tuple(extra_outputs), chunking)
    except Exception as e:
        error = load_error(artifact, e)
        if error is None:
            raise
        raise error from None


class StatelessDecoder(ReplayRollback):
    """A graph with past_key_values.* inputs and present.* outputs behind the Decoder calls: the cache is the last
    call's present.* arrays, fed back as the next call's past."""

    threads, load_seconds = 0, 0.0
    runtime_config: dict = {}  # noqa: RUF012 - a default every instance shares and none mutates

    def __init__(self, runner: engines.GraphRunner, past_specs: dict[str, tuple[int, int]],
                 extra_outputs: Sequence[str] = (), chunking: PrefillChunking | None = None,
                 metadata: Mapping[str, str] | None = None) -> None:
        self.backend = runner.backend
        self.metadata = dict(metadata or {})
        self.replays = bool(cache_lengths(self.metadata))
        self.chunking = chunking
        self._run, self._past_specs = runner, past_specs  # past_key_values.* -> (heads, head dim)
        self.runner, self.past_specs = runner, past_specs  # what a batch over the same graph runs (batching.py)
        self._extra = tuple(extra_outputs)  # graph outputs returned in extras
        self.extras: dict[str, np.ndarray] = {}
        self.reset()

    def reset(self) -> None:
        self._past: dict[str, np.ndarray] = {}
        self._checkpoint = None
        self._appended = AppendingCache()  # a runner that appends (runner.appends): the cache, in place

    def _state(self) -> object:
        return dict(self._past)

    def _restore(self, state: object | None) -> None:
        self._past = dict(state) if isinstance(state, dict) else {}

    def rollback(self, keep: int) -> None:
        if self.replays:
            self._replay(keep)
            return
        if getattr(self._run, "appends", False):
            self._appended.trim(keep)
        self._past = {name: trimmed(value, keep) for name, value in self._past.items()}

    def _forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int,
                 inputs: dict[str, np.ndarray] | None) -> np.ndarray:
        del logits_to_keep  # a stateless graph (a check's) computes every position; the caller reads the last
        feeds = {**(inputs or {}), INPUT_IDS: np.ascontiguousarray(input_ids, np.int64),
                 ATTENTION_MASK: np.ascontiguousarray(attention_mask, np.int64),
                 POSITION_IDS: np.ascontiguousarray(positions(attention_mask, input_ids.shape[1]))}
        appends = getattr(self._run, "appends", False)  # a GraphRunner's; a test's stand-in runner may not say
        if appends:  # the cache's slots, the free ones masked (appending_cache.py)
            feeds[ATTENTION_MASK] = self._appended.graph_mask(feeds[ATTENTION_MASK])
        for name, (heads, dim) in self._past_specs.items():
            empty = np.zeros((len(input_ids), heads, 0, dim), np.float32)
            feeds[name] = self._appended.past(name, empty) if appends else self._past.get(name, empty)
        outputs = self._run(feeds)
        if appends:
            self._appended.append({name: outputs[present_of(name)] for name in self._past_specs})  # new entries
        else:
            self._past = {name: outputs[present_of(name)] for name in self._past_specs}
        self.extras = {name: outputs[name] for name in self._extra}
        return outputs[LOGITS]
