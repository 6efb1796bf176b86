"""report.json: what `dstc eval` measured on an artifact, versioned so that CI can read old and new reports.

Every metric carries its unit and its direction ("lower" or "higher" is better, "none" for facts such as a
size), so a gate or a comparison never needs to know a metric by name to tell better from worse.

A report is bound to what it measured, both ways: ``artifact.manifest_digest`` is the artifact's manifest digest
without its ``report`` entry (manifest_binding), ``files`` the sha256 of the report.md / report.html written with it,
and ``digest`` the sha256 of the report itself without that field, which every report of this schema must have; the
manifest's ``report`` entry records the sha256 of report.json (toolchain/manifest.py record_report), so its digest,
and a signature of manifest.json, cover the report. A report read from inside an artifact must match that artifact's
manifest both ways. These are hashes anyone can recompute: they catch an edit, a deleted field or a report copied
from another artifact; only a signature (`dstc sign`) proves who wrote the report.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toolchain.errors import InputError
from toolchain.hashing import self_digest, sha256_file
from toolchain.interface.files import MANIFEST, REPORT_FILES
from toolchain.interface.reports import read_json_file

SCHEMA = "dstc.report/6"
# Reports of these schemas are read too, upgraded to SCHEMA (_upgrade): /3 added Metric.stderr, /4
# LatencyCase.speculative, /5 the digest required and the binding to the manifest both ways, /6 the latency medians'
# confidence intervals (Metric.interval, LatencyCase.*_p50_interval_ms). Before /5 with a warning (UNPROVEN); a /5
# report is bound as a /6 one is (BOUND_SCHEMAS), and only lacks the intervals, which a latency gate says.
OLDER_SCHEMAS = ("dstc.report/1", "dstc.report/2", "dstc.report/3", "dstc.report/4", "dstc.report/5")
BOUND_SCHEMAS = ("dstc.report/5", SCHEMA)
UNPROVEN = ("was written by an earlier dstc ({schema}): its digest was optional and manifest.json does not record "
            "it, so an edit of its figures cannot be told; run dstc eval again to gate on figures dstc can vouch for")

Direction = Literal["lower", "higher", "none"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Interval(_Strict):
    """A confidence interval of a latency median, from one value per repetition (toolchain/evaluate/spread.py)."""

    low: float
    high: float
    confidence: float  # the probability that [low, high] holds the median: 0.95, less with few repetitions
    samples: int  # the repetitions it is of

    @model_validator(mode="after")
    def _ordered(self) -> Interval:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and 0 <= self.low <= self.high):
            raise ValueError(f"[{self.low}, {self.high}] is not an interval of non-negative times")
        if not 0 <= self.confidence <= 1 or self.samples < 2:
            raise ValueError(f"confidence {self.confidence} of {self.samples} samples is not a confidence")
        return self


class Metric(_Strict):
    value: float | None  # None: not applicable to this model (e.g. routing agreement of a dense model)
    unit: str  # "" for a plain number, "ratio" for a share in [0, 1], "ms", "s", "MB", "nats", "tokens/s", "points"
    direction: Direction
    description: str
    reference: float | None = None  # the fp32 PyTorch reference's value, where one exists
    stderr: float | None = None  # the value's standard error, where the harness gives one (lm-eval tasks)
    interval: Interval | None = None  # a latency median's confidence interval (the P50 metrics)


class Cpu(_Strict):
    """The CPU latency was measured on (toolchain/hardware.py describe_cpu)."""

    model: str | None = None  # as the OS reports it; a virtual machine may show a generic name
    vendor: str | None = None
    architecture: str = ""
    logical_cores: int | None = None
    isa: list[str] = Field(default_factory=list)  # of toolchain.hardware.ISA_EXTENSIONS: avx512_vnni, amx_int8 ...


class Environment(_Strict):
    host: str | None = None
    cpu: Cpu = Field(default_factory=Cpu)
    cores: int | None = None
    threads: int | None = None
    runtime_config: dict = Field(default_factory=dict)  # the runtime's settings as read back from it
    versions: dict[str, str] = Field(default_factory=dict)


class SpeculativeCase(_Strict):
    """A batch-1 latency case decoded again with speculative decoding (toolchain/evaluate/latency.py)."""

    method: str  # prompt-lookup | draft:ARTIFACT
    draft_tokens: int
    ttft_ms: list[float]
    tokens_per_s: float
    speedup: float  # tokens_per_s over plain decoding's
    greedy_match: float  # share of the tokens up to the first that differs from plain decoding's
    verify_steps: int
    proposed_per_position: list[int]
    accepted_per_position: list[int]
    acceptance_per_position: list[float]
    acceptance: float | None  # all positions together; None when nothing was drafted


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
    speculative: SpeculativeCase | None = None
    # the medians (ITL's over the pooled steps) and their intervals, of the TTFT and of each repetition's median
    # ITL; None in a report written before /6, an interval None with a single repetition
    ttft_p50_ms: float | None = None
    ttft_p50_interval_ms: Interval | None = None
    itl_p50_ms: float | None = None
    itl_p50_interval_ms: Interval | None = None


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
    skipped: bool = False  # its metric could not be measured; passed says whether that was allowed
    detail: str = ""
    warning: str = ""  # why the verdict may not mean much (a latency ratio within its medians' noise)


# The values a metric can take; a report outside them was not written by dstc (or was edited).
_SHARES = ("exact_match", "top1_agreement", "greedy_match_rate", "routing_agreement", "speculative_acceptance",
           "speculative_greedy_match_rate")
_NON_NEGATIVE_UNITS = ("ms", "s", "MB", "tokens/s", "nats")


def _metric_problem(name: str, metric: Metric) -> str | None:
    value = metric.value
    if value is None:
        return None
    if not math.isfinite(value):
        return f"{value} is not a finite number"
    if name == "perplexity" and value < 1:
        return f"perplexity {value} is below 1, which no distribution has"
    if name in _SHARES and not 0 <= value <= 1:
        return f"{value} is not a share in [0, 1]"
    if metric.unit in _NON_NEGATIVE_UNITS and value < 0:
        return f"{value} {metric.unit} is negative"
    return None


class Report(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: str = Field(SCHEMA, alias="schema")
    artifact: dict  # path, recipe, backend, model, model_type, manifest_sha256, size_bytes
    reference: dict  # model, path, runtime ("pytorch eager fp32")
    environment: Environment = Field(default_factory=Environment)
    settings: dict  # texts, problems, prompt lengths, batches, new tokens, warm-up, repetitions, seeds
    metrics: dict[str, Metric]
    latency: list[LatencyCase] = Field(default_factory=list)
    series: Series = Field(default_factory=Series)
    gates: list[GateResult] | None = None
    files: dict[str, str] = Field(default_factory=dict)  # report.md / report.html -> sha256, as written with it
    digest: str | None = None  # sha256 of this report without this field (write_report sets it)

    @model_validator(mode="after")
    def _values_in_range(self) -> Report:
        for name, metric in self.metrics.items():
            problem = _metric_problem(name, metric)
            if problem:
                raise ValueError(f"metric {name}: {problem}")
        return self

    def value(self, name: str) -> float | None:
        metric = self.metrics.get(name)
        return None if metric is None else metric.value

    def dump(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)

    def sealed(self) -> dict:
        """The report as written: its JSON with ``digest`` (set on this object too) the sha256 of the rest."""
        self.digest = None
        data = self.dump()
        self.digest = data["digest"] = self_digest(data)
        return data


def read_report_data(path: Path, warn: Callable[[str], None] | None = None) -> dict:
    """report.json as a dict of the right schema whose digest matches its content: required in BOUND_SCHEMAS,
    checked when there is one in an older schema, which ``warn`` is told of (UNPROVEN; default: a warning on
    stderr)."""
    data = read_json_file(path, "report")
    schema = data.get("schema")
    if schema != SCHEMA and schema not in OLDER_SCHEMAS:
        raise InputError(f"{path}: not a dstc report of schema {SCHEMA} (schema: {str(schema)[:40]!r})")
    if schema in BOUND_SCHEMAS and not isinstance(data.get("digest"), str):
        raise InputError(f"{path} has no digest: dstc writes one into every report, so it was edited after dstc "
                         f"wrote it")
    if data.get("digest") is not None and data["digest"] != self_digest(data):
        raise InputError(f"{path} was changed after dstc wrote it (its content does not match its digest)")
    if schema not in BOUND_SCHEMAS:
        (warn or _warn)(f"{path} {UNPROVEN.format(schema=schema)}")
    return data


def _warn(message: str) -> None:
    print(f"dstc: warning: {message}", file=sys.stderr)


def manifest_binding(manifest: dict) -> str:
    """What a report records of the manifest it was written for: its digest without the ``report`` entry, which
    eval writes after the report (and which a report cannot hold a hash of itself in)."""
    return self_digest({k: v for k, v in manifest.items() if k != "report"})


def check_report_binding(report: dict, artifact: Path, path: Path) -> None:
    """InputError unless the report (read from ``path``) was written for this artifact's manifest.json and, at
    BOUND_SCHEMAS, is the report that manifest records (record_report in toolchain/manifest.py)."""
    manifest_path = Path(artifact) / MANIFEST
    if report.get("schema") not in BOUND_SCHEMAS:  # older reports recorded the manifest file's sha256
        recorded, actual = (report.get("artifact") or {}).get("manifest_sha256"), sha256_file(manifest_path)
    else:
        manifest = read_json_file(manifest_path, "manifest")
        if manifest.get("digest") != self_digest(manifest):
            raise InputError(f"{manifest_path} was changed after dstc wrote it (its content does not match its "
                             f"digest), so the report it records cannot be trusted")
        recorded, actual = (report.get("artifact") or {}).get("manifest_digest"), manifest_binding(manifest)
        listed = (manifest.get("report") or {}).get(path.name)
        if recorded == actual and listed != sha256_file(path):
            raise InputError(f"{path} is not the report {MANIFEST} records "
                             f"({'none recorded' if listed is None else f'sha256 {listed[:12]}'}): it was replaced "
                             f"or edited after dstc eval wrote it; run dstc eval again")
    if recorded != actual:
        raise InputError(f"{path} was not written for the artifact in {artifact}: it records manifest "
                         f"{str(recorded)[:12]}, the artifact's manifest.json is {actual[:12]} (copied from another "
                         f"artifact, or the artifact was rebuilt: run dstc eval again)")


def _upgrade(data: dict) -> dict:
    """A report of an older schema as SCHEMA: dstc.report/1 had the architecture alone as ``environment.cpu``."""
    if data.get("schema") == "dstc.report/1":
        environment = dict(data.get("environment") or {})
        if isinstance(environment.get("cpu"), str):
            environment["cpu"] = {"architecture": environment["cpu"]}
        data = {**data, "schema": "dstc.report/2", "environment": environment}
    if data.get("schema") in ("dstc.report/2", "dstc.report/3", "dstc.report/4", "dstc.report/5"):
        data = {**data, "schema": SCHEMA}
    return data


def load_report(path: Path) -> Report:
    """A report.json (or an artifact directory holding one), validated; InputError names the file and the key.
    A report inside an artifact (beside a manifest.json) must have been written for that artifact."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_FILES[0]
    data = read_report_data(path)
    try:
        report = Report.model_validate(_upgrade(data))
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise InputError(f"{path}: {key}: {first['msg']}") from None
    except RecursionError:
        raise InputError(f"{path} is nested too deeply to be a report") from None
    if (path.parent / MANIFEST).is_file():
        check_report_binding(data, path.parent, path)
    return report
