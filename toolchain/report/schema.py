"""report.json: what `dstc eval` measured on an artifact, versioned so that CI can read old and new reports.

Every metric carries its unit and its direction ("lower" or "higher" is better, "none" for facts such as a
size), so a gate or a comparison never needs to know a metric by name to tell better from worse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolchain.errors import InputError
from toolchain.manifest import REPORT_FILES

SCHEMA = "dstc.report/1"

Direction = Literal["lower", "higher", "none"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Metric(_Strict):
    value: float | None  # None: not applicable to this model (e.g. routing agreement of a dense model)
    unit: str  # "" for a plain number, "ratio" for a share in [0, 1], "ms", "s", "MB", "nats", "tokens/s", "points"
    direction: Direction
    description: str
    reference: float | None = None  # the fp32 PyTorch reference's value, where one exists


class LatencyCase(_Strict):
    """One prompt length x batch size: every measured repetition, so that distributions can be drawn."""

    prompt_length: int
    batch: int
    new_tokens: int
    warmup: int
    repetitions: int
    ttft_ms: list[float]  # time to first token, one per repetition (prefill + first token)
    itl_ms: list[float]  # inter-token latencies of every repetition, pooled
    tokens_per_s: float  # decode throughput: batch x (new_tokens - 1) / summed ITL, median over repetitions


class LayerError(_Strict):
    """Quantization error of one weight, from the compression stage's measurements."""

    weight: str
    layer: int | None
    precision: str
    weight_error: float
    output_error: float | None


class HeadError(_Strict):
    weight: str
    layer: int | None
    head: int
    weight_error: float
    output_error: float | None


class Series(_Strict):
    kl_per_position: list[float] = Field(default_factory=list)  # mean KL(reference || artifact) at each position
    routing_agreement_per_layer: dict[str, float] = Field(default_factory=dict)  # MoE layer index -> agreement
    layer_errors: list[LayerError] = Field(default_factory=list)
    head_errors: list[HeadError] = Field(default_factory=list)


class GateResult(_Strict):
    name: str  # e.g. "max_perplexity_increase"
    metric: str  # the metric it reads
    value: float | None
    limit: float
    passed: bool
    detail: str = ""


class Report(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: str = Field(SCHEMA, alias="schema")
    artifact: dict  # path, recipe, backend, model, model_type, manifest_sha256, size_bytes
    reference: dict  # model, path, runtime ("pytorch eager fp32")
    environment: dict  # threads, cpu, host, versions, runtime_config
    settings: dict  # texts, problems, prompt lengths, batches, new tokens, warm-up, repetitions, seeds
    metrics: dict[str, Metric]
    latency: list[LatencyCase] = Field(default_factory=list)
    series: Series = Field(default_factory=Series)
    gates: list[GateResult] | None = None

    def value(self, name: str) -> float | None:
        metric = self.metrics.get(name)
        return None if metric is None else metric.value

    def dump(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)


def load_report(path: Path) -> Report:
    """A report.json (or an artifact directory holding one), validated; InputError names the file and the key."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_FILES[0]
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise InputError(f"cannot read report {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else None
        raise InputError(f"{path}: not a dstc report of schema {SCHEMA} (schema: {found!r})")
    try:
        return Report.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise InputError(f"{path}: {key}: {first['msg']}") from None
