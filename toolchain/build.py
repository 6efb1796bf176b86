"""`dstc build`: run a recipe's stages into a verified, reproducible artifact.

Stages chain through directories (export -> passes -> compress -> compile). Each stage's id hashes its parent's
id, its configuration and the toolchain's code, the first parent being the source checkpoint's file hashes (as
Olive chains pass ids); a finished stage is kept in the stage cache under its id and reused by any build that
reaches the same id. The artifact is the compile stage's deployable files plus manifest.json, assembled in a
temporary directory beside the target and renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from toolchain import source as sources
from toolchain.atomic import MARKER, atomic_output_dir, lock_file
from toolchain.errors import InputError
from toolchain.gates import GateFailed
from toolchain.manifest import REPORT_FILES, code_digest, digest, file_hashes, git_commit, versions, write_manifest
from toolchain.recipe import Recipe, load_recipe

# Stage reports: they hold timings and absolute paths, so they go to the manifest's provenance, not the artifact.
STAGE_RECORD = "stage.json"
STAGE_REPORTS = ("export.json", "passes.json", "compression.json", "compile.json", STAGE_RECORD)
# Seeds of everything random on the way to an artifact (the parity prompts for checkpoints without a tokenizer).
SEEDS = {"parity_prompts": 0}


def cache_root() -> Path:
    return Path(os.environ.get("DSTC_CACHE_DIR") or Path.home() / ".cache" / "dstc") / "stages"


@dataclass
class Stage:
    name: str
    config: dict
    run: Callable[[Path | None, Path, Callable[[str], None]], dict]
    module: str  # the stage's code, whose import closure goes into its id




def plan(recipe: Recipe, source: Path) -> list[Stage]:
    """The recipe's stages in order, each with the configuration that goes into its id. Later stages read the
    checkpoint this build resolved (``source``), not the path an earlier, perhaps cached, stage recorded."""
    stages = [Stage("export", {"model": recipe.model, **recipe.export.model_dump(mode="json")}, _export(recipe),
                    "toolchain.stages.export")]
    if recipe.passes:
        stages.append(Stage("passes", recipe.passes.model_dump(mode="json"), _passes(recipe, source),
                            "toolchain.stages.optimize"))
    if recipe.compress:
        stages.append(Stage("compress", recipe.compress.model_dump(mode="json"), _compress(recipe, source),
                            "toolchain.stages.compress"))
    stages.append(Stage("compile", recipe.compile.model_dump(mode="json"), _compile(recipe, source),
                        "toolchain.stages.compile"))
    return stages


def _export(recipe: Recipe):
    from toolchain.stages.export import export

    return lambda _in, out, log: export(recipe.model, out, parity=tuple(recipe.export.parity), new_tokens=recipe.export.new_tokens,
                                        revision=recipe.revision, moe=recipe.export.moe, log=log)


def _passes(recipe: Recipe, source: Path):
    from toolchain.stages.optimize import optimize

    cfg = recipe.passes
    return lambda inp, out, log: optimize(inp, out, cfg.target, passes=cfg.passes, expectations=cfg.expect,
                                          source=source, log=log)


def _compress(recipe: Recipe, source: Path):
    from toolchain.stages.compress import compress

    cfg = recipe.compress.model_dump()
    return lambda inp, out, log: compress(inp, out, target=recipe.compile.backend, source=source, log=log,
                                          **cfg)


def _compile(recipe: Recipe, source: Path):
    from toolchain.stages.compile import compile_artifact

    cfg = recipe.compile
    return lambda inp, out, log: compile_artifact(inp, out, cfg.backend, verify=cfg.verify, source=source,
                                                    log=log)


class Events:
    """What a build reports while it runs; the CLI draws it, tests ignore it."""

    def stage_started(self, name: str, stage_id: str, cached: bool) -> None: ...

    def stage_finished(self, name: str, seconds: float, cached: bool) -> None: ...

    def log(self, message: str) -> None: ...


def build(recipe_path: Path, out_dir: Path | None = None, *, model: str | None = None, use_cache: bool = True,
          events: Events | None = None) -> dict:
    events = events or Events()
    started = time.perf_counter()
    recipe = load_recipe(recipe_path, model)
    out_dir = Path(out_dir or Path("artifacts") / recipe.name)
    baseline = _gate_baseline(recipe, Path(recipe_path))
    source = sources.resolve(recipe.model, revision=recipe.revision)
    if (recipe.eval or recipe.gates) and not (source.path / "tokenizer.json").is_file():
        raise InputError(f"{recipe_path}: the recipe evaluates its artifact (eval/gates), which needs a tokenizer, "
                         f"and {source.spec} has no tokenizer.json; remove eval and gates or add a tokenizer")
    source_files = file_hashes(source.path)
    parent, stage_rows, durations, cached_stages, reports = digest(source_files), [], {}, [], {}
    stage_dir = None
    with atomic_output_dir(out_dir) as tmp:
        for stage in plan(recipe, source.path):
            stage_id = digest({"stage": stage.name, "config": stage.config, "parent": parent,
                               "code": code_digest(stage.module)})
            target = cache_root() / f"{stage.name}-{stage_id[:20]}"
            target.parent.mkdir(parents=True, exist_ok=True)
            # One build at a time per cache entry: a second build of the same stage waits, then reuses it.
            with lock_file(target.parent / f".{target.name}.build.lock", wait=True, what=target):
                damage = cache_damage(target) if use_cache else None
                cached = use_cache and not damage
                if damage and damage != "absent":
                    events.log(f"the stage cache entry {target} does not match what was recorded when it was "
                               f"written ({damage}); running the {stage.name} stage again")
                events.stage_started(stage.name, stage_id, cached)
                t0 = time.perf_counter()
                if not cached:
                    _run_stage(stage, stage_dir, target, stage_id, parent, events.log)
                else:
                    cached_stages.append(stage.name)
            durations[stage.name] = round(time.perf_counter() - t0, 3)
            events.stage_finished(stage.name, durations[stage.name], cached)
            stage_rows.append({"name": stage.name, "id": stage_id, "parent": parent, "config": stage.config})
            reports.update({f"{stage.name}/{r}": _read_report(target / r) for r in STAGE_REPORTS[:-1]
                            if (target / r).is_file()})
            parent, stage_dir = stage_id, target
        for item in sorted(stage_dir.iterdir()):
            if item.name not in STAGE_REPORTS and item.name != MARKER:
                # copies, not hard links: onnx and onnx-ir refuse external data with more than one link
                # ("potential hardlink attack"), so a linked model.onnx.data would not load there
                (shutil.copytree if item.is_dir() else shutil.copyfile)(item, tmp / item.name)
        fields = {
            "dstc_version": versions()["dstc"],
            "git_commit": git_commit(),
            "recipe": recipe.model_dump(mode="json"),
            "recipe_sha256": recipe.digest(),
            "source": {"model": recipe.model, "revision": recipe.revision, "kind": source.kind,
                       "files": source_files},
            "stages": stage_rows,
            "versions": versions(),
            "seeds": SEEDS,
            "nondeterministic": {name: "written by dstc eval: measured latencies and host; not hashed"
                                 for name in REPORT_FILES},
        }
        durations["total"] = round(time.perf_counter() - started, 3)
        provenance = {"built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
                      "output": str(out_dir.resolve()), "durations_s": durations, "cached_stages": cached_stages,
                      "stage_reports": reports}
        manifest = write_manifest(tmp, fields, provenance)
        gates = _evaluate(recipe, baseline, tmp, out_dir, events) if recipe.eval or recipe.gates else None
    failed = [g for g in gates or [] if not g.passed]
    if failed:
        raise GateFailed(f"{len(failed)} of {len(gates)} gates failed ({', '.join(g.name for g in failed)}); "
                         f"the artifact and its report are in {out_dir}")
    return manifest


def _gate_baseline(recipe: Recipe, recipe_path: Path):
    """The recipe's gate baseline report (its path is relative to the recipe), read before anything is built."""
    from toolchain.errors import InputError
    from toolchain.report.schema import load_report

    gates = recipe.gates
    if gates is None:
        return None
    if gates.max_latency_ratio is not None and not gates.baseline:
        raise InputError(f"{recipe_path}: gates.max_latency_ratio needs gates.baseline (a report.json)")
    return load_report(recipe_path.parent / gates.baseline) if gates.baseline else None


def _evaluate(recipe: Recipe, baseline, artifact: Path, final: Path, events: Events):
    """Evaluate the assembled artifact before it is renamed into place, write its report into it, and check the
    recipe's gates. Returns the gate results."""
    from toolchain.evaluate.run import evaluate_artifact, write_report
    from toolchain.evaluate.settings import EvalSettings
    from toolchain.gates import check_gates

    events.stage_started("eval", "", False)
    t0 = time.perf_counter()
    report = evaluate_artifact(artifact, recipe.eval or EvalSettings(), display_path=final, log=events.log)
    results = []
    if recipe.gates:
        results = check_gates(report, recipe.gates, baseline)
        report.gates = results
    write_report(report, artifact)
    events.stage_finished("eval", time.perf_counter() - t0, False)
    return results


def cache_damage(target: Path) -> str | None:
    """None when the cache entry is complete and every file has the hash recorded when it was written; else
    what is wrong ("absent" when there is no finished entry)."""
    record = target / STAGE_RECORD
    if not record.is_file():
        return "absent"
    try:
        recorded = json.loads(record.read_text())["files"]
        if not isinstance(recorded, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return f"unreadable {STAGE_RECORD}"
    actual = file_hashes(target, exclude=(STAGE_RECORD, MARKER))
    changed = [f"changed {n}" for n in sorted(recorded) if n in actual and actual[n] != recorded[n]]
    changed += [f"missing {n}" for n in sorted(set(recorded) - set(actual))]
    changed += [f"extra {n}" for n in sorted(set(actual) - set(recorded))]
    return ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else "") if changed else None


def _run_stage(stage: Stage, input_dir: Path | None, target: Path, stage_id: str, parent: str, log) -> None:
    """Run a stage into the cache. The stage writes its own directory atomically; stage.json, written last,
    marks the entry complete and records the sha256 of every file, which is checked before any reuse."""
    (target / STAGE_RECORD).unlink(missing_ok=True)
    stage.run(input_dir, target, log)
    (target / STAGE_RECORD).write_text(json.dumps({"name": stage.name, "id": stage_id, "parent": parent,
                                                   "config": stage.config,
                                                   "files": file_hashes(target, exclude=(STAGE_RECORD, MARKER))},
                                                  indent=2) + "\n")


def _read_report(path: Path) -> dict:
    return json.loads(path.read_text())
