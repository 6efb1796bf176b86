"""manifest.json as a pydantic model (schema dstc.manifest/1), written and read by toolchain/manifest.py: readers
get fields (the recipe as the Recipe it was, each stage's report as its typed report) instead of string keys, and
a manifest of another version is one InputError.

The JSON is what it was before it was typed, with ``schema`` added: every field is dumped, None included (a
recipe's unset sections, an unpinned revision), except that each stage report keeps its own form. A manifest
without ``schema`` was written by an earlier dstc and is refused (see README, "Artifacts"): its stage reports
predate their schemas too.
"""

from __future__ import annotations

from typing import ClassVar, Literal, TypeVar

from pydantic import Field, ValidationError, field_serializer, field_validator

from toolchain.build_plan import BuildPlan
from toolchain.interface.reports import STAGE_REPORTS, Schema, StageReport, _Model
from toolchain.recipe import Recipe

R = TypeVar("R", bound=StageReport)


class ManifestSource(_Model):
    model: str
    revision: str | None
    kind: str
    files: dict[str, str]  # sha256 of every checkpoint file, by relative path


class StageRow(_Model):
    name: str
    id: str
    parent: str
    config: dict


class Provenance(_Model):
    """What no hash covers and no comparison reads: when, where, how long, what came from the cache, and each
    stage's report (timings and absolute paths), by ``<stage>/<file>``."""

    built_at: str
    host: str
    output: str
    durations_s: dict[str, float]
    cached_stages: list[str]
    stage_reports: dict[str, StageReport]

    @field_validator("stage_reports", mode="before")
    @classmethod
    def _typed_reports(cls, value):
        if not isinstance(value, dict):
            return value
        typed = {}
        for key, report in value.items():
            kind = STAGE_REPORTS.get(str(key).rpartition("/")[2])
            if kind is None:
                raise ValueError(f"{key} is not a stage report")
            if isinstance(report, kind):
                typed[key] = report
                continue
            if not isinstance(report, dict) or report.get("schema") != kind.SCHEMA:
                raise ValueError(f"{key} is not a {kind.SCHEMA} report")
            try:
                typed[key] = kind.model_validate(report)
            except ValidationError as e:
                first = e.errors()[0]
                raise ValueError(f"{key}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        return typed

    @field_serializer("stage_reports")
    def _report_forms(self, reports: dict[str, StageReport]) -> dict:
        return {key: report.dump() for key, report in reports.items()}

    def report(self, stage: str, kind: type[R]) -> R | None:
        """The ``stage``'s report of that kind, e.g. ("compress", CompressionReport); None when the build had no
        such stage."""
        name = next(file for file, report_kind in STAGE_REPORTS.items() if report_kind is kind)
        report = self.stage_reports.get(f"{stage}/{name}")
        return report if isinstance(report, kind) else None


class Manifest(Schema):
    SCHEMA: ClassVar[str] = "dstc.manifest/1"
    schema_: str = Field(SCHEMA, alias="schema")
    schema_version: Literal[1]  # the field's version before ``schema`` existed, kept so the content stays the same
    dstc_version: str
    git_commit: str | None
    recipe: Recipe
    recipe_sha256: str
    # every choice the recipe left open, as the build took it (toolchain/build_plan.py); None in a manifest written
    # before the field, which is then left out of the JSON as it was
    plan: BuildPlan | None = None
    source: ManifestSource
    stages: list[StageRow]
    versions: dict[str, str]
    seeds: dict[str, int]
    nondeterministic: dict[str, str]
    files: dict[str, str]  # sha256 of every artifact file but the unhashed ones (toolchain/manifest.py UNHASHED)
    # the runtimes that load the artifact (toolchain/deployment.py); None in a manifest written before the field,
    # which is then left out of the JSON as it was
    loads_with: list[str] | None = None
    provenance: Provenance
    # the sha256 of report.json as `dstc eval` wrote it into the artifact (toolchain/manifest.py record_report),
    # so that this digest and a signature cover the report; None until a report is written
    report: dict[str, str] | None = None
    digest: str  # sha256 of everything else (toolchain/hashing.py self_digest)

    def dump(self) -> dict:
        absent = {name for name in ("loads_with", "plan") if getattr(self, name) is None}
        return self.model_dump(mode="json", by_alias=True, exclude=absent or None)
