"""A built artifact on disk: which runtime it is for, its configs and tokenizer, and the size of its model files.

Two layouts are accepted, told apart by their files: a ``dstc build`` output (``manifest.json``) and a
``dstc compile`` output (``compile.json``). Either holds the graph of one backend (``openvino_model.xml`` or
``model.onnx``) beside the checkpoint's ``config.json``, ``generation_config.json`` and tokenizer files.

Opening an artifact checks that every file is there and that no weight file is shorter than its graph reads (a
copy cut short, a full disk): the graphs record each weight's offset and length, so this costs a read of the
graphs, not of the weights. manifest.json records hashes, not sizes, and hashing gigabytes of weights at every
load is `dstc verify`'s work. What the check cannot see (a weight file of the right length with other bytes) fails
in the runtime's loader, which ``load_error`` turns into the same kind of one-line error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from toolchain.errors import InputError
from toolchain.interface.files import (
    COMPILE_REPORT,
    CONFIG,
    GENERATION_CONFIG,
    MANIFEST,
    MODEL_XML,
    ONNX_MODEL,
    ONNX_WEIGHTS,
    TOKENIZER,
    weights_of,
)
from toolchain.interface.graph import MOE_LOWERING, check_onnx_graph, graph_metadata
from toolchain.interface.reports import CompileReport, read_json
from toolchain.manifest import read_manifest
from toolchain.tokenizer_loading import load_tokenizer

if TYPE_CHECKING:
    from toolchain.manifest_schema import Manifest


@dataclass(frozen=True)
class Artifact:
    path: Path
    backend: str  # "openvino" | "onnxruntime"
    manifest: Manifest | None  # manifest.json of a build; None for a compile-only directory
    config: dict
    generation: dict

    def tokenizer(self):
        """The Hugging Face tokenizer saved beside the graph (loaded once)."""
        return self._tokenizer

    @cached_property  # writes the instance __dict__ directly, so it works on a frozen dataclass
    def _tokenizer(self):
        if not (self.path / TOKENIZER).is_file():
            raise InputError(f"{self.path} has no tokenizer.json (its checkpoint had no tokenizer)")
        return load_tokenizer(self.path)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.generation.get("eos_token_id", self.config.get("eos_token_id"))
        if eos is None:
            return []
        return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]

    @property
    def pad_token_id(self) -> int:
        for pad in (self.generation.get("pad_token_id"), self.config.get("pad_token_id")):
            if pad is not None:
                return int(pad)
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    @property
    def context_length(self) -> int | None:
        """The longest sequence (prompt + generated tokens) the model was trained for."""
        value = self.config.get("max_position_embeddings")
        return int(value) if isinstance(value, int) and value > 0 else None

    def check_length(self, prompt_tokens: int, new_tokens: int) -> None:
        """InputError, with the numbers, when a prompt and the tokens to generate do not fit the context (past
        it a model does not fail: it silently produces garbage)."""
        context = self.context_length
        if context is not None and prompt_tokens + new_tokens > context:
            raise InputError(f"the prompt is {prompt_tokens} tokens and {new_tokens} more are to be generated: "
                             f"{prompt_tokens + new_tokens} exceeds the model's context of {context} tokens")

    @property
    def graph(self) -> Path:
        """The graph file: the OpenVINO IR's .xml, or model.onnx."""
        return self.path / (MODEL_XML if self.backend == "openvino" else ONNX_MODEL)

    @cached_property
    def metadata(self) -> dict[str, str]:
        """The exporter's facts about the graph (toolchain/interface/graph.py), carried through every stage."""
        return graph_metadata(self.graph)

    @property
    def moe_lowering(self) -> str | None:
        """How the MoE layers' experts run (toolchain/export/moe.py), as the exporter recorded it; None for a dense
        model, or one exported before the record."""
        return self.metadata.get(MOE_LOWERING)

    @property
    def model_files(self) -> list[Path]:
        """The graph and weight files (what a deployment loads besides configs and tokenizer)."""
        names = (MODEL_XML, weights_of(MODEL_XML)) if self.backend == "openvino" else (ONNX_MODEL, ONNX_WEIGHTS)
        return [self.path / n for n in names if (self.path / n).is_file()]

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.model_files)


def open_artifact(path: Path | str) -> Artifact:
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path} is not a directory (expected an artifact of dstc build or dstc compile)")
    if (path / MODEL_XML).is_file():
        backend = "openvino"
    elif (path / ONNX_MODEL).is_file():
        backend = "onnxruntime"
    else:
        raise InputError(f"{path} is not an artifact: no {MODEL_XML} or {ONNX_MODEL}")
    if not (path / MANIFEST).is_file() and not (path / COMPILE_REPORT).is_file():
        raise InputError(f"{path} is not a compiled artifact: no {MANIFEST} or {COMPILE_REPORT} "
                         f"(an export? run dstc compile or dstc build)")
    if not (path / CONFIG).is_file():
        raise InputError(f"{path} is not a compiled artifact: no {CONFIG}")
    generation = path / GENERATION_CONFIG
    manifest = read_manifest(path) if (path / MANIFEST).is_file() else None
    listed = manifest.files if manifest else CompileReport.read(path / COMPILE_REPORT).files
    missing = sorted(name for name in listed if not (path / name).is_file())
    if missing:
        raise InputError(f"{path} is incomplete: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                         f"missing (dstc verify {path} lists every difference)")
    if backend == "onnxruntime":
        check_onnx_graph(path / ONNX_MODEL)
    for xml in sorted(path.glob("openvino_*.xml")):  # the model's IR and the tokenizer's
        _check_ir_weights(xml)
    return Artifact(path=path, backend=backend, manifest=manifest, config=read_json(path / CONFIG),
                    generation=read_json(generation) if generation.is_file() else {})


_DATA = re.compile(rb"<data\b[^>]*>")
_OFFSET, _SIZE = re.compile(rb'\boffset="(\d+)"'), re.compile(rb'\bsize="(\d+)"')


def _check_ir_weights(xml: Path) -> None:
    """InputError when an OpenVINO IR's .bin is shorter than its constants reach (each constant's <data> has the
    offset and size of its bytes in the .bin)."""
    end = 0
    for tag in _DATA.findall(xml.read_bytes()):
        offset, size = _OFFSET.search(tag), _SIZE.search(tag)
        if offset and size:
            end = max(end, int(offset.group(1)) + int(size.group(1)))
    weights = xml.with_suffix(".bin")
    if end and not weights.is_file():
        raise InputError(f"{xml} needs its weights file {weights}, which is missing")
    if end and weights.stat().st_size < end:
        raise InputError(f"{weights} is truncated: {weights.stat().st_size} bytes, {xml.name} reads up to byte {end}")


def load_error(artifact: Artifact, error: BaseException) -> InputError | None:
    """The one-line InputError for a runtime's failure to load the artifact's model (ONNX Runtime's Fail,
    InvalidGraph, ...; OpenVINO's RuntimeError: weights of the right length with other bytes), naming the model
    file; None for any other exception, which stays a bug with its traceback."""
    if not isinstance(error, RuntimeError) and type(error).__module__ != "onnxruntime.capi.onnxruntime_pybind11_state":
        return None
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # OpenVINO puts the reason last, after where in its sources it was raised; ORT prefixes its status code
    reason = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", lines[-1]) if lines else type(error).__name__
    model = artifact.path / (MODEL_XML if artifact.backend == "openvino" else ONNX_MODEL)
    return InputError(f"{artifact.backend} cannot load {model}: {reason} (dstc verify {artifact.path} checks every "
                      f"file against its manifest)")
