"""`dstc build`: run a recipe's stages into a verified, reproducible artifact.

Stages chain through directories (export -> passes -> compress -> compile), each run by the stage runner
(toolchain/stages/runner.py) into the stage cache under its id, which hashes its parent's id, its configuration
and its code, the first parent being the source checkpoint's file hashes; a finished stage is reused by any build
or single-stage command that reaches the same id. The artifact is the compile stage's deployable files plus
manifest.json, assembled in a temporary directory beside the target and renamed into place at the end.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from toolchain import source as sources
from toolchain.atomic import atomic_output_dir
from toolchain.compress import shipped
from toolchain.compress.calibration import EMBEDDED
from toolchain.errors import InputError
from toolchain.evaluate import tasks
from toolchain.evaluate.run import evaluate_artifact, write_report
from toolchain.gates import GateFailed, check_baseline_model, check_gates
from toolchain.hashing import digest
from toolchain.interface.files import REPORT_FILES, STAGE_RECORD
from toolchain.interface.reports import STAGE_REPORTS
from toolchain.manifest import git_commit, versions, write_manifest
from toolchain.recipe import Recipe, load_recipe
from toolchain.report.schema import load_report
from toolchain.settings.evaluation import EvalSettings
from toolchain.source_hashes import Hashing
from toolchain.stages.choices import plan_recipe
from toolchain.stages.runner import (
    Stage,
    copy_stage_files,
    drop_entry,
    move_stage_files,
    releasing,
    run_cached,
    stages_of,
)

if TYPE_CHECKING:  # the stage's code (onnx_ir, the exporter's graph module) loads when the stage runs
    from toolchain.stages.compress_parts import PartRunner

# Seeds of everything random on the way to an artifact (the parity prompts for checkpoints without a tokenizer).
SEEDS = {"parity_prompts": 0}


def plan(recipe: Recipe, source: Path, log: Callable[[str], None] = lambda _: None,
         parts: PartRunner | None = None) -> list[Stage]:
    """The recipe's stages in order, each with the configuration that goes into its id, on its plan
    (toolchain/stages/choices.py plan_recipe) for the checkpoint this build resolved (``source``). ``parts``: a
    streamed compression is written in parts by its tasks (the same bytes)."""
    return stages_of(plan_recipe(recipe, source, log), source, parts)


class Events:
    """What a build reports while it runs; the CLI draws it, tests ignore it."""

    def stage_started(self, name: str, stage_id: str, cached: bool) -> None: ...

    def stage_finished(self, name: str, seconds: float, cached: bool) -> None: ...

    def log(self, message: str) -> None: ...


def build(recipe_path: Path, out_dir: Path | None = None, *, model: str | None = None, use_cache: bool = True,
          keep_stages: bool = True, events: Events | None = None, parts: PartRunner | None = None) -> dict:
    """``keep_stages`` False: each stage cache entry this build writes is deleted once the next stage has run,
    and the last one's files are moved into the artifact instead of copied (what a disk that holds the checkpoint
    and the artifact but not every stage's output needs); entries it reused are left as they were. ``parts``: a
    streamed compression's weights are written in parts, by layer range, by its tasks (Ray's: --ray), into the
    bytes one process writes (toolchain/stages/compress_parts.py)."""
    events = events or Events()
    started = time.perf_counter()
    recipe, baseline, eval_settings = _checked(Path(recipe_path), model)
    out_dir = Path(out_dir or Path("artifacts") / recipe.name)
    # hashed while the config check imports transformers (seconds)
    hashing = Hashing(sources.locate(recipe.model, revision=recipe.revision)[0])
    source = sources.resolve(recipe.model, revision=recipe.revision)
    if recipe.compress and recipe.compress.scheme == "shipped":  # what the backend cannot run, before any stage
        shipped.check_source(source.path, recipe.compile.backend)
    if (recipe.eval or recipe.gates) and not (source.path / "tokenizer.json").is_file():
        raise InputError(f"{recipe_path}: the recipe evaluates its artifact (eval/gates), which needs a tokenizer, "
                         f"and {source.spec} has no tokenizer.json; remove eval and gates or add a tokenizer")
    source_files = hashing.result()
    parent, stage_rows, durations, cached_stages, reports = digest(source_files), [], {}, [], {}
    stage_dir: Path | None = None
    written: list[Path] = []  # the stage cache entries this build wrote (not reused)
    build_plan = plan_recipe(recipe, source.path, events.log)  # every choice the recipe leaves open, taken once
    with atomic_output_dir(out_dir) as tmp:
        for stage in stages_of(build_plan, source.path, parts):
            if not keep_stages and stage_dir in written:  # deleted once read: may be given up as it is read
                stage = releasing(stage, stage_dir)
            t0 = time.perf_counter()
            target, stage_id, cached = run_cached(
                stage, stage_dir, parent, use_cache=use_cache, log=events.log,
                # called by run_cached, in this iteration
                started=lambda stage_id, cached: events.stage_started(stage.name, stage_id, cached))  # noqa: B023
            if cached:
                cached_stages.append(stage.name)
            durations[stage.name] = round(time.perf_counter() - t0, 3)
            events.stage_finished(stage.name, durations[stage.name], cached)
            stage_rows.append({"name": stage.name, "id": stage_id, "parent": parent, "config": stage.config})
            # they hold timings and absolute paths: the manifest's provenance, not the artifact
            reports.update({f"{stage.name}/{name}": kind.read(target / name) for name, kind in STAGE_REPORTS.items()
                            if (target / name).is_file()})
            if not keep_stages and stage_dir in written:  # its input, read
                size = drop_entry(stage_dir)
                events.log(f"deleted the stage cache entry {stage_dir.name} ({size / 1e9:.1f} GB), which the "
                           f"{stage.name} stage has read (--no-keep-stages)")
            if not cached:
                written.append(target)
            parent, stage_dir = stage_id, target
        assert stage_dir is not None  # every plan starts with the export stage
        if not keep_stages and stage_dir in written:
            move_stage_files(stage_dir, tmp, skip=(*STAGE_REPORTS, STAGE_RECORD))
            events.log(f"moved the stage cache entry {stage_dir.name} into the artifact (--no-keep-stages)")
        else:
            copy_stage_files(stage_dir, tmp, skip=(*STAGE_REPORTS, STAGE_RECORD))
        fields = {
            "dstc_version": versions()["dstc"],
            "git_commit": git_commit(),
            "recipe": recipe,
            "recipe_sha256": recipe.digest(),
            "plan": build_plan,
            "source": {"model": recipe.model, "revision": recipe.revision, "kind": source.kind,
                       "files": source_files},
            "stages": stage_rows,
            "versions": versions(),
            "seeds": SEEDS,
            "nondeterministic": dict.fromkeys(REPORT_FILES,
                                              "written by dstc eval: measured latencies and host; not hashed"),
        }
        durations["total"] = round(time.perf_counter() - started, 3)
        provenance = {"built_at": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
                      "output": str(out_dir.resolve()), "durations_s": durations, "cached_stages": cached_stages,
                      "stage_reports": reports}
        manifest = write_manifest(tmp, fields, provenance)
        gates = _evaluate(recipe, eval_settings, baseline, tmp, out_dir, events) if eval_settings else None
    failed = [g for g in gates or [] if not g.passed]
    if gates and failed:
        raise GateFailed(f"{len(failed)} of {len(gates)} gates failed ({', '.join(g.name for g in failed)}); "
                         f"the artifact and its report are in {out_dir}")
    return manifest


def check(recipe_path: Path, model: str | None = None) -> Recipe:
    """What `build` checks of its input before any stage runs (the recipe, the files it names, where its checkpoint
    is), without running anything: a set of recipes is checked whole before the first is built. The recipe."""
    recipe = _checked(recipe_path, model)[0]
    sources.locate(recipe.model, revision=recipe.revision)
    return recipe


def _checked(recipe_path: Path, model: str | None):
    """The recipe (its calibration file read beside it), its gate baseline and its eval settings."""
    recipe = load_recipe(recipe_path, model)
    baseline = _gate_baseline(recipe, recipe_path)
    eval_settings = _eval_settings(recipe, recipe_path)
    return _calibration_beside_recipe(recipe, recipe_path), baseline, eval_settings


def _gate_baseline(recipe: Recipe, recipe_path: Path):
    """The recipe's gate baseline report (its path is relative to the recipe), read before anything is built."""
    gates = recipe.gates
    if gates is None:
        return None
    if gates.max_latency_ratio is not None and not gates.baseline:
        raise InputError(f"{recipe_path}: gates.max_latency_ratio needs gates.baseline (a report.json)")
    if not gates.baseline:
        return None
    baseline = load_report(recipe_path.parent / gates.baseline)
    check_baseline_model(recipe.model, baseline, gates)  # the report will name the recipe's model
    return baseline


def _eval_settings(recipe: Recipe, recipe_path: Path):
    """The recipe's eval settings (None: no eval), its dataset relative to the recipe's directory and checked to
    be there, and its tasks and their data checked, before anything is built."""
    if not (recipe.eval or recipe.gates):
        return None
    settings = recipe.eval or EvalSettings()
    if settings.dataset:
        dataset = recipe_path.parent / settings.dataset
        if not dataset.is_file():
            raise InputError(f"{recipe_path}: eval.dataset {settings.dataset} is not a file (looked for {dataset})")
        settings = settings.model_copy(update={"dataset": str(dataset)})
    tasks.check(settings)
    return settings


def _calibration_beside_recipe(recipe: Recipe, recipe_path: Path) -> Recipe:
    """The recipe with a relative compress.dataset read from the recipe's directory, as eval.dataset is (not from
    wherever the build was started), and checked to be there before anything is built."""
    if recipe.compress is None or recipe.compress.dataset == EMBEDDED or Path(recipe.compress.dataset).is_absolute():
        return recipe
    dataset = recipe_path.parent / recipe.compress.dataset
    if not dataset.exists():
        raise InputError(f"{recipe_path}: compress.dataset {recipe.compress.dataset} does not exist (looked for "
                         f"{dataset})")
    compress = recipe.compress.model_copy(update={"dataset": str(dataset.resolve())})
    return recipe.model_copy(update={"compress": compress})


def _evaluate(recipe: Recipe, settings, baseline, artifact: Path, final: Path, events: Events):
    """Evaluate the assembled artifact before it is renamed into place, write its report into it, and check the
    recipe's gates. Returns the gate results."""
    events.stage_started("eval", "", False)
    t0 = time.perf_counter()
    report = evaluate_artifact(artifact, settings, display_path=final, log=events.log)
    results = []
    if recipe.gates:
        results = check_gates(report, recipe.gates, baseline)
        report.gates = results
    write_report(report, artifact)
    events.stage_finished("eval", time.perf_counter() - t0, False)
    return results
