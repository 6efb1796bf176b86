"""How dstc runs a graph: the one place that creates ONNX Runtime sessions and compiles OpenVINO models.

Two numerics, named once:

* ``exact``: what the graph computes, for parity and for measuring compression. ONNX Runtime's CPU kernels are
  fp32 already; OpenVINO's CPU plugin is told f32 compute and an f32 KV cache, and no on-the-fly activation
  quantization for compressed weights (which it otherwise applies, differently in the stateful and stateless
  forms of one graph: 2e-3 of the logit range apart on an INT8 DeepSeek-V3).
* ``deployment``: the runtime's defaults, as openvino_genai and optimum-intel run an IR (bf16 compute where the
  CPU has bf16 instructions, a u8 KV cache, dynamic int8 activations): what users run, for latency and
  evaluation.

:class:`GraphRunner` runs a graph statelessly (past_key_values.* in, present.* out) with optional extra outputs;
the decoders over artifacts (toolchain/runtime/decoder.py) keep the KV cache in the runtime.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from toolchain.runtime.appending_cache import appending_onnx, appending_openvino

NUMERICS: dict[str, dict[str, str]] = {
    "exact": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
    "deployment": {},
}
CPU = ["CPUExecutionProvider"]


def ort_options(*, threads: int | None = None, external_dir: str | os.PathLike | None = None, level: str | None = None,
                optimized_path: Path | None = None, optimized_external: str | None = None,
                external_min_bytes: int | None = None, profile_prefix: Path | None = None):
    """ONNX Runtime session options. ``external_dir``: where a graph handed over as bytes finds its external
    weights (ORT refuses external data outside the model's directory). ``level``: "basic" etc.;
    ``optimized_path`` saves the optimized graph, its weights of ``external_min_bytes`` or more in
    ``optimized_external``. ``profile_prefix`` turns the profiler on."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if external_dir is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(Path(external_dir).resolve()))
    if level is not None:
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, f"ORT_ENABLE_{level.upper()}")
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    if optimized_external is not None:
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         optimized_external)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                         str(external_min_bytes or 0))
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_prefix)
    return options


def ort_session(model: Path | str | bytes, options=None):
    import onnxruntime as ort

    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options or ort_options(),
                                providers=CPU)


def with_extra_outputs(model, names: Sequence[str]) -> bytes:
    """A serialized copy of an ONNX graph (a path, read without its external weights, a ModelProto or an onnx_ir
    model) that also outputs the named values; ORT infers their types."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, str | Path):  # an artifact's graph: onnx-ir (and its sympy) is the build extra's
        proto = onnx.load(str(model), load_external_data=False)
    else:
        import onnx_ir as ir

        proto = ir.serde.serialize_model(model)
    known = {v for node in proto.graph.node for v in node.output} | {i.name for i in proto.graph.input}
    present = {o.name for o in proto.graph.output}
    for name in names:
        if name not in known and not _expose_from_prefill_branches(proto.graph, name):
            raise ValueError(f"the graph has no value named {name!r}")
        if name not in present:
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
    return proto.SerializeToString()


def _expose_from_prefill_branches(graph, name: str) -> bool:
    """A value inside prefill-int8's If (passes/quantize/prefill_int8.py: the decoder's span in the else-branch as
    it was, its copy for prompts in the then-branch, each copied value named ``NAME/prefill``), made an output of
    the If: each branch outputs its own (renamed ``NAME/decode`` in the else-branch, so that only the If's output
    is NAME). False where no If holds it."""
    import onnx

    for node in graph.node:
        branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
        decode, prompt = branches.get("else_branch"), branches.get("then_branch")
        if node.op_type != "If" or decode is None or prompt is None:
            continue
        if not any(name in n.output for n in decode.node) or not any(f"{name}/prefill" in n.output
                                                                     for n in prompt.node):
            continue
        inner = f"{name}/decode"
        for inner_node in decode.node:
            inner_node.input[:] = [inner if v == name else v for v in inner_node.input]
            inner_node.output[:] = [inner if v == name else v for v in inner_node.output]
        for info in decode.value_info:
            if info.name == name:
                info.name = inner
        decode.output.append(onnx.ValueInfoProto(name=inner))
        prompt.output.append(onnx.ValueInfoProto(name=f"{name}/prefill"))
        node.output.append(name)
        return True
    return False


def openvino_read(path: Path | str):
    """An ov.Model of an IR (.xml) or an ONNX file (converted)."""
    import openvino as ov

    return ov.Core().read_model(str(path)) if Path(path).suffix == ".xml" else ov.convert_model(str(path))


def runtime_cache_property(entries: int | None) -> dict[str, int]:
    """The CPU plugin's CPU_RUNTIME_CACHE_CAPACITY: kernels it keeps built per input shape, 5000 by default; what
    dstc's decoders give it, and why, is toolchain/runtime/kernel_caches.py's. ``entries`` None: the plugin's
    default."""
    return {} if entries is None else {"CPU_RUNTIME_CACHE_CAPACITY": entries}


def openvino_compile(model, numerics: str = "exact", *, threads: int | None = None,
                     config: Mapping[str, object] | None = None):
    """A CompiledModel on CPU: ``model`` an ov.Model or a path (read or converted)."""
    import openvino as ov

    if not isinstance(model, ov.Model):
        model = openvino_read(model)
    settings = {**NUMERICS[numerics], **({"INFERENCE_NUM_THREADS": threads} if threads else {}), **(config or {})}
    return ov.Core().compile_model(model, "CPU", settings)


class GraphRunner:
    """A graph run stateless: ``runner(feeds) -> {output name: array}`` for every graph output and the extra
    outputs asked for. ``model``: a path (.onnx / .xml), an onnx_ir model (ONNX Runtime) or an ov.Model
    (OpenVINO)."""

    def __init__(self, model, backend: str, *, numerics: str = "exact", extra_outputs: Sequence[str] = (),
                 threads: int | None = None, appending: bool = False) -> None:
        """``appending``: where the graph's present outputs are its past inputs' Concats with new entries only,
        run it outputting the new entries instead (toolchain/runtime/appending_cache.py); ``appends`` says whether
        it does."""
        self.backend = backend
        self.appends = False
        if backend == "onnxruntime":
            self._init_ort(model, list(extra_outputs), threads, appending)
        else:
            self._init_openvino(model, list(extra_outputs), numerics, threads, appending)

    def _init_ort(self, model, extra: list[str], threads: int | None, appending: bool) -> None:
        external: str | os.PathLike | None = None
        if appending and isinstance(model, str | Path):
            import onnx

            proto = onnx.load(str(model), load_external_data=False)
            if appending_onnx(proto):
                self.appends = True
                external, model = Path(model).parent, with_extra_outputs(proto, extra)
        if not self.appends and not isinstance(model, str | Path):  # an onnx_ir model
            import onnx_ir as ir

            external = next((v.const_value.base_dir for v in model.graph.initializers.values()
                             if isinstance(v.const_value, ir.ExternalTensor)), None)
            model = with_extra_outputs(model, extra)
        elif not self.appends and extra:
            external, model = Path(model).parent, with_extra_outputs(model, extra)
        self._session = ort_session(model, ort_options(threads=threads, external_dir=external))
        self._names = [o.name for o in self._session.get_outputs()]
        self._cache_types = {i.name: np.float16 for i in self._session.get_inputs() if i.type == "tensor(float16)"}

    def _init_openvino(self, model, extra: list[str], numerics: str, threads: int | None, appending: bool) -> None:
        import openvino as ov

        model = model.clone() if isinstance(model, ov.Model) else openvino_read(model)
        self.appends = appending and appending_openvino(model)
        have = {name for out in model.outputs for name in out.get_names()}
        if extra:
            model.add_outputs([name for name in extra if name not in have])
        self._compiled = openvino_compile(model, numerics, threads=threads)
        self._request = self._compiled.create_infer_request()
        self._cache_types = {port.get_any_name(): np.float16 for port in self._compiled.inputs
                             if port.get_element_type() == ov.Type.f16}
        self._ports = {out.get_any_name(): out for out in self._compiled.outputs}
        for name in extra:  # an extra output keeps the value's own name among its names
            self._ports[name] = next(o for o in self._compiled.outputs if name in o.get_names())

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # a graph storing its cache in float16 (export.cache_dtype) takes the float32 arrays a caller made for an
        # empty or a reference cache as float16; its own present.* outputs come back as float16
        feeds = {name: value.astype(self._cache_types[name], copy=False) if name in self._cache_types else value
                 for name, value in feeds.items()}
        if self.backend == "onnxruntime":
            return dict(zip(self._names, self._session.run(self._names, dict(feeds))))
        result = self._request.infer(dict(feeds))
        return {name: np.array(result[port]) for name, port in self._ports.items()}


def ort_kernels(path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Node kernels ONNX Runtime ran for one call (its profiler), at its default optimisation level."""
    import json
    from collections import Counter

    session = ort_session(path, ort_options(profile_prefix=Path(path).parent / "ort-profile"))
    session.run(["logits"], dict(feeds))
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink()
    return dict(Counter(e["args"]["op_name"] for e in events
                        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")).most_common())

