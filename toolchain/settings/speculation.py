"""Which speculative decoding a runner uses (toolchain/runtime/speculative.py): its drafter and draft length. A
section, so that `dstc generate`'s options come from its fields (toolchain/cli_options.py) and a recipe or another
command can hold the same keys."""

from __future__ import annotations

from pydantic import Field, field_validator

from toolchain.settings.section import Section

PROMPT_LOOKUP = "prompt-lookup"
MTP = "mtp"
DRAFT_PREFIX = "draft:"


class SpeculationSettings(Section):
    speculate: str | None = Field(
        None, json_schema_extra={"metavar": "prompt-lookup|mtp|draft:ARTIFACT"},
        description="Speculative decoding (lossless: the same greedy tokens): drafts by n-gram lookup in the text "
                    "so far, by the artifact's own multi-token-prediction layer (built with export.mtp), or by a "
                    "smaller artifact of the same tokenizer (default: none).")
    draft_tokens: int = Field(4, ge=1, le=32, description="Draft tokens per verify step of speculative decoding.")

    @field_validator("speculate")
    @classmethod
    def _known(cls, value: str | None) -> str | None:
        if value in (None, PROMPT_LOOKUP, MTP) or (value.startswith(DRAFT_PREFIX) and value[len(DRAFT_PREFIX):]):
            return value
        raise ValueError(f"{value!r} is not {PROMPT_LOOKUP!r}, {MTP!r} or {DRAFT_PREFIX}ARTIFACT")

    @property
    def draft_artifact(self) -> str | None:
        """The draft model's artifact directory, when one drafts."""
        return self.speculate[len(DRAFT_PREFIX):] if self.speculate and self.speculate.startswith(DRAFT_PREFIX) \
            else None
