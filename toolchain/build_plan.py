"""A build's plan: every choice that a recipe (or a single-stage command's options) leaves open, taken once before
any stage runs (toolchain/stages/choices.py) and recorded in manifest.json. The stages read their section from it
and decide nothing again: the MoE lowering is a lowering (never auto), prefill_int8 is true or false (never the
CPU-dependent None), and one backend is what every stage builds for.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toolchain.interface.moe_lowerings import AUTO
from toolchain.recipe import Backend, CompileSection, CompressSection, ExportSection, PassesSection


class BuildPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    SCHEMA: ClassVar[str] = "dstc.plan/1"
    schema_: Literal["dstc.plan/1"] = Field("dstc.plan/1", alias="schema")
    # the checkpoint as the recipe or `dstc export` names it (None: a stage run alone on a directory)
    model: str | None = None
    revision: str | None = None
    # the runtime every stage builds for (a recipe's compile.backend, `dstc compress --backend`, a passes target);
    # None: an export alone, for no runtime in particular
    backend: Backend | None = None
    export: ExportSection | None = None  # its moe resolved (never auto)
    # the next stage is a streamed compression, which reads the weights from the checkpoint: not written by the export
    defer_weights: bool = False
    weights_read_by: str | None = None  # why a later stage reads the export's weights file (said when a large one is)
    passes: PassesSection | None = None
    passes_parity: bool = True  # `dstc optimize --no-parity` turns the passes stage's parity check off
    compress: CompressSection | None = None  # its prefill_int8 resolved (never None)
    compile: CompileSection | None = None
    # why, for each choice the recipe left open and the plan took (choice -> reason)
    decisions: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _resolved(self) -> BuildPlan:
        """A plan holds choices taken, never one left to a stage (a stage given this plan decides nothing)."""
        if self.export is not None and self.export.moe == AUTO:
            raise ValueError("export.moe is auto: the plan resolves it (toolchain/stages/choices.py moe_lowering)")
        if self.compress is not None and self.compress.prefill_int8 is None:
            raise ValueError("compress.prefill_int8 is open: the plan resolves it (toolchain/stages/choices.py "
                             "prefill_int8)")
        if self.compress is not None and self.backend is None:
            raise ValueError("a compression is for a backend: the plan names it")
        return self

    def dump(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)
