"""What each stage writes about itself: export.json, passes.json, compression.json and compile.json as pydantic
models with a schema version each (as report.json has), so that a reader gets fields, not string keys, and a
report from another version or edited by hand is one InputError naming the file and the field. stage.json, the
record the stage runner writes beside a stage's output (toolchain/stages/runner.py), is one too; and the JSON
readers that every reader of a stage directory or an artifact uses.

The free-form parts (per-pass statistics, backend details, per-case parity figures) stay dicts: their shape is
the producing module's, and nothing reads them by key but the terminal summary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolchain.errors import InputError
from toolchain.interface.files import COMPILE_REPORT, COMPRESSION_REPORT, EXPORT_REPORT, PASSES_REPORT

S = TypeVar("S", bound="Schema")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def read_json_file(path: Path, what: str) -> dict:
    """A JSON object from a file; InputError (one line) for anything unreadable, however malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise InputError(f"{path} is nested too deeply to be a {what}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object")
    return data


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint's or an artifact's file (config.json, generation_config.json)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object")
    return data


class Schema(_Model):
    """A JSON document dstc writes, with the id of its schema (``dstc.<kind>/<version>``)."""

    SCHEMA: ClassVar[str] = ""
    schema_: str = Field(alias="schema")

    def dump(self) -> dict:
        """As JSON, fields that do not apply (None) left out, as the stages wrote them before they were typed."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.dump(), indent=2) + "\n")

    @classmethod
    def parse(cls: type[S], data: dict, where: str = "") -> S:
        if data.get("schema") != cls.SCHEMA:
            raise InputError(f"{where or cls.__name__}: not a {cls.SCHEMA} document (schema: "
                             f"{str(data.get('schema'))[:40]!r})")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            raise InputError(f"{where or cls.__name__}: {'.'.join(map(str, first['loc']))}: "
                             f"{first['msg'].removeprefix('Value error, ')}") from None

    @classmethod
    def read(cls: type[S], path: Path) -> S:
        return cls.parse(read_json_file(path, cls.SCHEMA), str(path))


class StageReport(Schema):
    """Base of the stage reports: a schema id, the version of dstc that wrote it, timings."""

    dstc_version: str
    timings: dict[str, float] = Field(default_factory=dict)


class Parity(_Model):
    """One backend's check against the PyTorch reference: end to end (greedy tokens and logits per case) or layer
    by layer (each piece's largest difference)."""

    passed: bool
    tolerance_relative_to_logits_range: float
    max_relative_diff: float
    max_abs_diff: float | None = None
    tokens_identical: bool | None = None
    cases: list[dict]
    mode: Literal["layer by layer"] | None = None
    pieces: dict[str, float] | None = None


class ExportSource(_Model):
    spec: str
    kind: str
    path: str
    model_type: str
    parameters: int
    skipped_layers: list[int] = Field(default_factory=list)  # e.g. DeepSeek-V3's multi-token-prediction layer
    tied_embeddings: bool = False


class DeferredWeights(_Model):
    """An export whose weights file was not written (a build's export before a streamed compression): ``file``,
    which model.onnx references, is recomputed from the source checkpoint by the exporter run with these
    settings (toolchain/stages/export.py recomputed_weights)."""

    file: str
    bytes: int  # what it would hold (counted in the graph's size_bytes)
    moe: str
    mla_cache: str | None = None
    v4_cache: str | None = None
    mtp: bool


class GraphInfo(_Model):
    files: list[str]
    opset: int
    nodes: int
    inputs: list[str]
    outputs: list[str]
    kv_cache: str
    size_bytes: int
    # the matrices' storage (toolchain/export/weights.py): float32, or bfloat16 widened by a Cast in the graph
    weights: Literal["float32", "bfloat16"] = "float32"
    # bytes one layer's KV cache (every cache tensor) grows by per token, by layer type (the config's
    # layer_types, "attention" for a model with one type), read from the graph's cache inputs
    cache_bytes_per_token: dict[str, int] = Field(default_factory=dict)
    # the element type of those cache tensors (export.cache_dtype; toolchain/export/cache_precision.py)
    cache_dtype: Literal["float32", "float16"] = "float32"
    deferred: DeferredWeights | None = None


class ExportReport(StageReport):
    SCHEMA: ClassVar[str] = "dstc.export/1"
    schema_: str = Field(SCHEMA, alias="schema")
    source: ExportSource
    graph: GraphInfo
    parity: dict[str, Parity]
    parity_mode: Literal["end-to-end", "layer by layer"]
    parity_skipped: str | None = None  # why no check ran: a layer's reference too large for this machine
    mtp: dict | None = None  # the MTP layer's graph (toolchain/export/mtp.py) and its parity, when exported


class PassesReport(StageReport):
    SCHEMA: ClassVar[str] = "dstc.passes/1"
    schema_: str = Field(SCHEMA, alias="schema")
    target: str
    input: dict
    output: dict
    pipeline: list[str]
    expectations: dict
    passes: list[dict]
    counts: dict[str, dict[str, int]]
    openvino_fusions: dict | None = None
    parity: dict[str, Parity] | None = None
    parity_skipped: str | None = None


class CompileReport(StageReport):
    SCHEMA: ClassVar[str] = "dstc.compile/1"
    schema_: str = Field(SCHEMA, alias="schema")
    backend: Literal["openvino", "onnxruntime"]
    export: dict
    model_type: str
    tokenizer: bool
    files: list[str]
    openvino: dict | None = None
    onnxruntime: dict | None = None
    smoke: dict | None = None
    verification: dict | None = None
    mtp: dict | None = None  # the compiled MTP layer's files and verification, when the export has one


class CompressionOptions(_Model):
    group_size: int
    sym: bool
    ratio: float
    backup: str
    awq: bool
    scale_estimation: bool
    gptq: bool
    dataset: str
    accuracy_level: int | None  # None on openvino: MatMulNBits' compute precision is an onnxruntime setting
    prefill_int8: bool = False  # absent from reports written before the option
    max_weight_error: float = 0.5  # absent from reports written before the option (which had no bound)


class CompressionPolicy(_Model):
    embeddings: str
    lm_head: str
    router: str
    shared_experts: str
    ignored_scope: list[str]
    int8_scope: list[str] = Field(default_factory=list)  # absent from reports written before the option


class WeightTotals(_Model):
    parameters: int
    bits_per_weight: float | None
    precisions: dict[str, int]


class Calibration(_Model):
    sequences: int
    tokens: int
    tokenization: str


class Agreement(_Model):
    """Next-token agreement of the compressed model with the uncompressed one on calibration text (None where the
    model was not run: streamed compression)."""

    tokens: int
    top1_agreement: float | None
    kl_mean: float | None
    kl_max: float | None
    note: str | None = None


class RoutingRow(_Model):
    layer: int
    agreement: float
    tokens: int


class HeadRow(_Model):
    head: int
    weight_error: float
    output_error: float | None


class WeightRow(_Model):
    """One weight (an expert matrix of a fused MoE layer counts as one): its plan, precision and errors."""

    weight: str
    node: str
    role: str | None
    layer: int | None
    shape: list[int]
    planned: str
    precision: str
    bits_per_weight: float
    weight_error: float
    output_error: float | None  # None: no calibration activations reached it (embeddings, streamed compression)
    # output_error measured on the inputs of its layer's other routed experts: no calibration token reached it
    borrowed_inputs: bool = False
    # weight_error after the best per-row or per-column rescale (compress/metrics.py rescaled_error): AWQ's
    # equivalent rescaling not counted; None where not measured (3-D, fused and streamed rows)
    rescaled_error: float | None = None
    head_side: Literal["output channels", "input rows", "stacked"] | None = None  # stacked: axis 0 of [heads, K, N]
    heads: list[HeadRow] | None = None


def lost_share(weight_error: float, rescaled_error: float | None) -> float:
    """How much of a weight its compression lost, as the max_weight_error bound and gate read it: its relative error,
    or the rescaled one where measured (AWQ's equivalent per-channel factors are not a loss; zeros are 1.0). A NaN or
    infinite error (a weight with non-finite values) is inf, above every bound: NaN compares false with all of them."""
    errors = [weight_error] if rescaled_error is None else [weight_error, rescaled_error]
    return min(errors) if all(math.isfinite(e) for e in errors) else math.inf


class LayerRow(_Model):
    layer: int | str  # a decoder layer, or the role of weights outside them (embeddings, lm_head)
    weights: int
    parameters: int
    bits_per_weight: float
    weight_error_max: float
    output_error_max: float | None
    output_error_mean: float | None


# the compression schemes: a recipe's compress.scheme (toolchain/recipe.py) is this type
CompressionScheme = Literal["int4-grouped", "int8-per-channel", "int8-per-head", "shipped"]


class CompressionReport(StageReport):
    """compression.json, for both forms of compression (whole model and streamed, ``streaming``). Measurements that
    were not made are written as null rather than left out, so it is dumped as it was built (unset fields left
    out, None kept)."""

    SCHEMA: ClassVar[str] = "dstc.compression/1"
    schema_: str = Field(SCHEMA, alias="schema")
    target: Literal["openvino", "onnxruntime"]
    scheme: CompressionScheme
    options: CompressionOptions
    policy: CompressionPolicy
    source: dict
    files: list[str]
    size_bytes: int
    file_sizes: dict[str, int]
    input_size_bytes: int | None
    weights: WeightTotals
    streaming: bool
    calibration: Calibration | None
    model: Agreement
    routing: list[RoutingRow]
    routing_agreement_min: float | None
    layers: list[LayerRow]
    per_weight: list[WeightRow]
    details: dict

    def dump(self) -> dict:
        return {"schema": self.schema_, **self.model_dump(mode="json", by_alias=True, exclude_unset=True,
                                                          fallback=_scalar)}

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.dump(), indent=1) + "\n")


def _scalar(value):
    """A numpy scalar in the free-form details (a kernel count, a norm) as the Python number it holds."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class StageRecord(Schema):
    """stage.json: which stage made a directory, from what (``parent``: the id of its input) and how (``config``),
    and the BLAKE3 of every file it wrote, checked before the directory is reused from the stage cache; ``digest``:
    the sha256 of the rest, the id with the files' hashes (toolchain/stages/runner.py)."""

    SCHEMA: ClassVar[str] = "dstc.stage/3"  # /2: BLAKE3, where /1 recorded sha256; /3: the digest
    schema_: str = Field(SCHEMA, alias="schema")
    name: str
    id: str
    parent: str
    config: dict
    files: dict[str, str]
    digest: str


# The reports by file name, as a stage directory holds them.
STAGE_REPORTS: dict[str, type[StageReport]] = {EXPORT_REPORT: ExportReport, PASSES_REPORT: PassesReport,
                                               COMPRESSION_REPORT: CompressionReport, COMPILE_REPORT: CompileReport}
