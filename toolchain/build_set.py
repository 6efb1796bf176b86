"""Several recipes in one `dstc build`: every recipe checked before any is built, each artifact in
``DIR/<recipe name>``, each build's failure kept to its own recipe, and the exit code the worst of them.

The builds run one after another here, or as Ray tasks (toolchain/distributed/ray_builds.py); both run each recipe
through `run_one`, so an artifact is the same bytes wherever it was built.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from toolchain.atomic import check_writable_target
from toolchain.build import Events, build, check
from toolchain.errors import DstcError, InputError

if TYPE_CHECKING:  # the stage's code (onnx_ir, the exporter's graph module) loads when the stage runs
    from toolchain.stages.compress_parts import PartRunner

DEFAULT_ROOT = Path("artifacts")


@dataclass(frozen=True)
class Job:
    """One recipe of the set: absolute paths, so that a task on another node reads and writes the same ones."""

    recipe: Path
    name: str
    out_dir: Path
    export: str = ""  # the checkpoint and export section: recipes that agree on it share their export stage


@dataclass
class Outcome:
    name: str
    out_dir: Path
    exit_code: int  # 0: built
    error: str | None = None
    manifest: dict = field(default_factory=dict)


def plan_jobs(recipes: list[Path], out: Path | None, model: str | None) -> list[Job]:
    """Check every recipe before anything runs (one InputError naming each refused one). One recipe is built into
    ``out`` (default artifacts/<name>), as `dstc build` always has; several into ``out/<name>``."""
    checked, refused = [], []
    for path in recipes:
        try:
            recipe = check(path, model)
        except InputError as e:
            refused.append(str(e))
            continue
        checked.append((path, recipe.name, f"{recipe.model}@{recipe.revision} {recipe.export.model_dump_json()}"))
    if refused:
        raise InputError(f"{len(refused)} of {len(recipes)} recipes refused, nothing built: {'; '.join(refused)}")
    names = [name for _, name, _ in checked]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise InputError(f"several recipes are named {', '.join(twice)}: their artifacts would be one directory")
    if len(checked) == 1 and out is not None:
        jobs = [Job(checked[0][0].resolve(), checked[0][1], out.resolve(), checked[0][2])]
    else:
        root = (out or DEFAULT_ROOT).resolve()
        jobs = [Job(path.resolve(), name, root / name, export) for path, name, export in checked]
    for job in jobs:
        check_writable_target(job.out_dir)
    return jobs


class LineEvents(Events):
    """A build's progress as plain lines prefixed with its recipe's name: several builds, or builds in Ray workers
    whose output the driver relays, stay readable interleaved."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _line(self, text: str) -> None:
        print(f"{self.name}: {text}", file=sys.stderr, flush=True)

    def stage_started(self, name: str, stage_id: str, cached: bool) -> None:
        if not cached:
            self._line(f"{name} running" + (f" (stage {stage_id[:12]})" if stage_id else ""))

    def stage_finished(self, name: str, seconds: float, cached: bool) -> None:
        self._line(f"{name} reused from the stage cache" if cached else f"{name} done in {seconds:.1f} s")

    def log(self, message: str) -> None:
        self._line(f"    {message}")


def run_one(job: Job, model: str | None, use_cache: bool, events: Events, parts: PartRunner | None = None) -> Outcome:
    """Build one recipe of the set; a DstcError is its outcome, not the set's. A bug keeps its traceback.
    ``parts``: its streamed compression written in parts by this runner's tasks."""
    try:
        manifest = build(job.recipe, job.out_dir, model=model, use_cache=use_cache, events=events, parts=parts)
    except DstcError as e:
        return Outcome(job.name, job.out_dir, e.exit_code, str(e))
    return Outcome(job.name, job.out_dir, 0, manifest=manifest)


def run_local(jobs: list[Job], model: str | None, use_cache: bool,
              events: Callable[[Job], Events] = lambda job: LineEvents(job.name)) -> list[Outcome]:
    return [run_one(job, model, use_cache, events(job)) for job in jobs]


def spread(jobs: list[Job]) -> list[Job]:
    """The jobs in the order to start them in parallel: round-robin over the groups that share an export, so that
    the first wave builds different exports and a recipe reusing one starts once it is in the stage cache (two
    builds started together on one export: one waits for the other's, its CPU idle)."""
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.export, []).append(job)
    return [group[i] for i in range(max(map(len, groups.values()), default=0)) for group in groups.values()
            if i < len(group)]


def worst(outcomes: list[Outcome]) -> int:
    return max((o.exit_code for o in outcomes), default=0)
