"""What each stage writes about itself: export.json, passes.json, compression.json and compile.json as pydantic
models with a schema version each (as report.json has), so that a reader gets fields, not string keys, and a
report from another version or edited by hand is one InputError naming the file and the field.

The free-form parts (per-pass statistics, backend details, per-case parity figures) stay dicts: their shape is
the producing module's, and nothing reads them by key but the terminal summary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolchain.errors import InputError

R = TypeVar("R", bound="StageReport")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StageReport(_Model):
    """Base of the stage reports: a schema id, the version of dstc that wrote it, timings."""

    SCHEMA: ClassVar[str] = ""
    schema_: str = Field(alias="schema")
    dstc_version: str
    timings: dict[str, float] = Field(default_factory=dict)

    def dump(self) -> dict:
        """As JSON, fields that do not apply (None) left out, as the stages wrote them before they were typed."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.dump(), indent=2) + "\n")

    @classmethod
    def parse(cls: type[R], data: dict, where: str = "") -> R:
        if data.get("schema") != cls.SCHEMA:
            raise InputError(f"{where or cls.__name__}: not a {cls.SCHEMA} report (schema: "
                             f"{str(data.get('schema'))[:40]!r})")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            raise InputError(f"{where or cls.__name__}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None

    @classmethod
    def read(cls: type[R], path: Path) -> R:
        from toolchain.manifest import read_json_file

        return cls.parse(read_json_file(path, cls.SCHEMA), str(path))


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


class GraphInfo(_Model):
    files: list[str]
    opset: int
    nodes: int
    inputs: list[str]
    outputs: list[str]
    kv_cache: str
    size_bytes: int


class ExportReport(StageReport):
    SCHEMA: ClassVar[str] = "dstc.export/1"
    schema_: str = Field(SCHEMA, alias="schema")
    source: ExportSource
    graph: GraphInfo
    parity: dict[str, Parity]
    parity_mode: Literal["end-to-end", "layer by layer"]


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
