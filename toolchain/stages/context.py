"""What every stage is handed besides its input, its output and its section: ``stage(input, output, section,
context)``. The plan holds the build's decisions (toolchain/build_plan.py); the rest is how this run goes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from toolchain.build_plan import BuildPlan

if TYPE_CHECKING:  # the compression's code (onnx_ir) loads when the stage runs
    from toolchain.stages.compress_parts import PartRunner

Log = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


@dataclass(frozen=True)
class StageContext:
    plan: BuildPlan
    # the checkpoint the build resolved (None: the one the input's export.json records): a stage taken from the
    # cache may have been exported from a checkout or cache that no longer exists
    source: Path | None = None
    log: Log = _quiet
    # a streamed compression's weights written in parts by these tasks, the same bytes (stages/compress_parts.py)
    parts: PartRunner | None = None
    # the input directory is deleted after this stage (a build that keeps no stages): called before the stage gives
    # up the input's files as it reads them
    release_input: Callable[[], None] | None = None
    # greedy steps of the passes' parity check and of the compiled artifact's verification (None: the stage's own;
    # tests shorten them); the export's are its section's new_tokens
    check_tokens: int | None = None
