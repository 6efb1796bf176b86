"""The stage runner: how `dstc build` and the single-stage commands (`dstc export`, `optimize`, `compress`,
`compile`) run a stage, so that both validate, cache and record it alike.

A stage is a name, its configuration (the recipe section it runs with, validated before anything runs), the
function that runs it and the module whose import closure is its code. Its id hashes its parent's id, its
configuration and that code (as Olive chains pass ids). A finished stage directory holds stage.json
(toolchain/interface/reports.py StageRecord): the id, parent and configuration, and the BLAKE3 of every file, checked
before the directory is reused. Finished stages are kept in the stage cache under their id.

`dstc build` runs each stage into its cache entry (the first parent is the checkpoint's file hashes) and
assembles the artifact from the last one. A single-stage command runs its stage into the directory it was given,
with stage.json, and keeps a copy in the cache, or copies an intact cached one there; the parent is the
checkpoint's file hashes for an export, else the hashes of the input directory and of its source checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from toolchain import source as sources
from toolchain.atomic import MARKER, atomic_output_dir, check_writable_dir, check_writable_target, lock_file
from toolchain.build_plan import BuildPlan
from toolchain.cache import cache_dir
from toolchain.errors import InputError
from toolchain.hashing import blake3_file, digest, file_hashes, self_digest
from toolchain.interface.files import STAGE_RECORD
from toolchain.interface.reports import (
    STAGE_REPORTS,
    CompileReport,
    CompressionReport,
    ExportReport,
    PassesReport,
    StageRecord,
    StageReport,
    read_json_file,
)
from toolchain.manifest import code_digest
from toolchain.recipe import CompileSection, CompressSection, ExportSection, PassesSection
from toolchain.settings.section import Section
from toolchain.source_hashes import checkpoint_hashes
from toolchain.stages import choices
from toolchain.stages.compile import compile_artifact
from toolchain.stages.context import StageContext
from toolchain.stages.inputs import read_export

if TYPE_CHECKING:  # the stage's code (onnx_ir, the exporter's graph module) loads when the stage runs
    from toolchain.stages.compress_parts import PartRunner

R = TypeVar("R", bound=StageReport)
Log = Callable[[str], None]


def cache_root() -> Path:
    return cache_dir() / "stages"


@dataclass
class Stage:
    """A stage of a plan: its function, called as ``function(input, output, section, context)``, the section it runs
    with (the plan's, resolved) and the configuration that goes into its id."""

    name: str
    config: dict
    function: Callable[..., dict]  # (input, output, section, context)
    section: Section
    plan: BuildPlan
    module: str  # the stage's code, whose import closure goes into its id
    source: Path | None = None  # the checkpoint the build resolved (None: the one the input records)
    parts: PartRunner | None = None
    # a stage that may give up its input's files as it reads them (the input entry is deleted after it), and what
    # it calls before it touches them (releasing())
    releases_input: bool = False
    release: Callable[[], None] | None = None

    def id(self, parent: str) -> str:
        return digest({"stage": self.name, "config": self.config, "parent": parent,
                       "code": code_digest(self.module)})

    def run(self, input_dir: Path | None, out_dir: Path, log: Log) -> dict:
        return self.function(input_dir, out_dir, self.section,
                             StageContext(self.plan, self.source, log, self.parts, self.release))


def stages_of(plan: BuildPlan, source: Path, parts: PartRunner | None = None) -> list[Stage]:
    """The plan's stages in order. Later stages read the checkpoint the build resolved (``source``), not the path
    an earlier, perhaps cached, stage recorded. ``parts``: a streamed compression is written in parts by its tasks
    (the same bytes)."""
    stages = [export_stage(plan)]
    if plan.passes:
        stages.append(passes_stage(plan, source))
    if plan.compress:
        stages.append(compress_stage(plan, source, parts))
    stages.append(compile_stage(plan, source))
    return stages


def export_stage(plan: BuildPlan) -> Stage:
    """The export of the plan's checkpoint; its ``defer_weights`` (the next stage is a streamed compression, which
    reads the weights from the checkpoint) is a configuration of its own, since the entry then holds no weights
    file."""
    # each stage's code loads when its stage is made: `dstc compile` needs no exporter
    from toolchain.stages.export import export

    section = plan.export
    assert section is not None  # every plan has an export but those of stages run alone on a directory
    config = section.model_dump(mode="json")
    if not config["mtp"]:  # a recipe without the MTP layer keeps the stage configuration it had before the option
        del config["mtp"]
    if config["v4_cache"] is None:  # likewise a recipe without a V4 cache layout
        del config["v4_cache"]
    if config["cache_dtype"] == "float32":  # ... and one with a float32 cache the configuration it had before
        del config["cache_dtype"]
    if plan.defer_weights:  # the configuration of an export that writes its weights is what it was before the option
        config["defer_weights"] = True
    return Stage("export", {"model": plan.model, **config}, export, section, plan, "toolchain.stages.export")


def passes_stage(plan: BuildPlan, source: Path) -> Stage:
    """The plan's ``passes_parity`` off (`dstc optimize --no-parity`) is part of the configuration only when off (a
    build always checks: its stage id is what it was before the option existed)."""
    # each stage's code loads when its stage is made: `dstc compile` needs no exporter
    from toolchain.stages.optimize import optimize

    section = plan.passes
    assert section is not None
    config = {**section.model_dump(mode="json"), **({} if plan.passes_parity else {"parity": False})}
    return Stage("passes", config, optimize, section, plan, "toolchain.stages.optimize", source)


def compress_stage(plan: BuildPlan, source: Path, parts: PartRunner | None = None) -> Stage:
    """``parts``: a streamed compression is written in parts by its tasks (toolchain/stages/compress_parts.py), the
    same bytes: not part of the configuration. Its section's prefill_int8 is the plan's, so that the stage's id and
    report say what was built."""
    # each stage's code loads when its stage is made: `dstc compile` needs no exporter
    from toolchain.stages.compress import compress

    section = plan.compress
    assert section is not None
    return Stage("compress", {"target": plan.backend, **section.model_dump(mode="json")}, compress, section, plan,
                 "toolchain.stages.compress", source, parts)


def compile_stage(plan: BuildPlan, source: Path) -> Stage:
    """smoke is part of the configuration only when off (a build's stage id is what it was before the option
    existed)."""
    section = plan.compile
    assert section is not None
    config = section.model_dump(mode="json", exclude={"smoke"} if section.smoke else set())
    return Stage("compile", config, compile_artifact, section, plan, "toolchain.stages.compile", source,
                 releases_input=True)


def releasing(stage: Stage, entry: Path) -> Stage:
    """``stage`` run on the cache entry ``entry``, which the build deletes once the stage has read it (it keeps no
    stages): with the run that may give up the entry's files as it reads them, the entry marked incomplete (under
    its lock) before the first byte goes. ``stage`` itself when it has no such run."""
    if not stage.releases_input:
        return stage

    def release() -> None:
        with _entry_lock(entry):
            (entry / STAGE_RECORD).unlink(missing_ok=True)

    return replace(stage, release=release)


def cache_damage(target: Path, stage_id: str | None = None) -> str | None:
    """None when the stage directory is complete, its stage.json is ``stage_id``'s (when given) and matches its
    digest, and every file has the hash recorded when it was written; else what is wrong ("absent" when there is
    no finished stage). The digest covers the id with the files' hashes: files moved from another entry, with or
    without its stage.json (its id rewritten or not), do not match."""
    if not (target / STAGE_RECORD).is_file():
        return "absent"
    try:
        document = read_json_file(target / STAGE_RECORD, STAGE_RECORD)
        record = StageRecord.parse(document, str(target / STAGE_RECORD))
    except InputError:
        return f"unreadable {STAGE_RECORD}"
    if stage_id is not None and record.id != stage_id:
        return f"{STAGE_RECORD} is another stage's ({record.name} {record.id[:12]})"
    if document["digest"] != self_digest(document):
        return f"{STAGE_RECORD} does not match its digest"
    recorded = record.files
    actual = file_hashes(target, exclude=(STAGE_RECORD, MARKER), hash_file=blake3_file)
    changed = [f"changed {n}" for n in sorted(recorded) if n in actual and actual[n] != recorded[n]]
    changed += [f"missing {n}" for n in sorted(set(recorded) - set(actual))]
    changed += [f"extra {n}" for n in sorted(set(actual) - set(recorded))]
    return ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else "") if changed else None


def _entry(stage: Stage, stage_id: str) -> Path:
    root = check_writable_dir(cache_root(), f"the stage cache {cache_dir()}",
                              "set DSTC_CACHE_DIR to a writable directory")
    return root / f"{stage.name}-{stage_id[:20]}"


def _entry_lock(target: Path):
    """One writer per cache entry: a second run of the same stage waits, then reuses it."""
    return lock_file(target.parent / f".{target.name}.build.lock", wait=True, what=target)


def _run_stage(stage: Stage, input_dir: Path | None, target: Path, stage_id: str, parent: str, log: Log) -> None:
    """Run a stage into ``target``. The stage writes its directory atomically; stage.json, written last, marks it
    complete and records the BLAKE3 of every file."""
    (target / STAGE_RECORD).unlink(missing_ok=True)
    stage.run(input_dir, target, log)
    files = file_hashes(target, exclude=(STAGE_RECORD, MARKER), hash_file=blake3_file)
    # the digest of what a reader parses (JSON, not the Python values)
    document = json.loads(json.dumps({"schema": StageRecord.SCHEMA, "name": stage.name, "id": stage_id,
                                      "parent": parent, "config": stage.config, "files": files}))
    document["digest"] = self_digest(document)
    StageRecord.parse(document)  # a field the record lacks fails here, not when the next build reads it
    (target / STAGE_RECORD).write_text(json.dumps(document, indent=2) + "\n")


def _intact(stage: Stage, target: Path, stage_id: str, log: Log) -> bool:
    """Whether the cache entry ``target`` holds ``stage_id``'s finished stage; one line when it is there but
    damaged."""
    damage = cache_damage(target, stage_id)
    if damage and damage != "absent":
        log(f"the stage cache entry {target} does not match what was recorded when it was written ({damage}); "
            f"running the {stage.name} stage again")
    return damage is None


def run_cached(stage: Stage, input_dir: Path | None, parent: str, *, use_cache: bool, log: Log,
               started: Callable[[str, bool], None] = lambda _id, _cached: None) -> tuple[Path, str, bool]:
    """Run ``stage`` into its cache entry unless an intact one exists (or ``use_cache`` is off): the entry, the
    stage id and whether it was reused. ``started(stage id, reused)`` is called before it runs."""
    stage_id = stage.id(parent)
    target = _entry(stage, stage_id)
    with _entry_lock(target):
        cached = use_cache and _intact(stage, target, stage_id, log)
        started(stage_id, cached)
        if not cached:
            _run_stage(stage, input_dir, target, stage_id, parent, log)
    return target, stage_id, cached


def copy_stage_files(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """Copies, not hard links: onnx and onnx-ir refuse external data with more than one link ("potential hardlink
    attack"), so a linked model.onnx.data would not load there."""
    for item in sorted(source.iterdir()):
        if item.name != MARKER and item.name not in skip:
            (shutil.copytree if item.is_dir() else shutil.copyfile)(item, target / item.name)


def move_stage_files(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """copy_stage_files for an entry that is dropped after (a build that keeps no stages): its files renamed into
    ``target`` (copied and deleted one at a time across file systems), then the entry deleted."""
    with _entry_lock(source):
        (source / STAGE_RECORD).unlink(missing_ok=True)  # an entry being emptied is incomplete to any reader
        for item in sorted(source.iterdir()):
            if item.name != MARKER and item.name not in skip:
                shutil.move(item, target / item.name)
        shutil.rmtree(source)


def drop_entry(entry: Path) -> int:
    """Delete a stage cache entry (a build that keeps no stages, once the next stage has read it); its bytes."""
    size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
    with _entry_lock(entry):
        (entry / STAGE_RECORD).unlink(missing_ok=True)  # an entry being deleted is incomplete to any reader
        shutil.rmtree(entry)
    return size


def _run_into(stage: Stage, input_dir: Path | None, parent: str, out_dir: Path, report: type[R], *,
              use_cache: bool, log: Log) -> tuple[R, bool]:
    """A single-stage command: ``stage`` run into ``out_dir`` (or its intact cache entry copied there), its report
    and whether it came from the cache."""
    check_writable_target(out_dir)
    stage_id = stage.id(parent)
    target = _entry(stage, stage_id)
    name = next(file for file, kind in STAGE_REPORTS.items() if kind is report)
    with _entry_lock(target):
        cached = use_cache and _intact(stage, target, stage_id, log)
        if cached:
            log(f"stage {stage_id[:12]} reused from the stage cache ({target})")
            with atomic_output_dir(out_dir) as tmp:
                copy_stage_files(target, tmp)
        else:
            _run_stage(stage, input_dir, out_dir, stage_id, parent, log)
            with atomic_output_dir(target, wait=True) as tmp:
                copy_stage_files(out_dir, tmp)
    return report.read(out_dir / name), cached


def _input_parent(input_dir: Path) -> tuple[Path, str]:
    """The source checkpoint of a stage's input directory (checked as the stage checks it) and the parent id of
    what is run on it: its files' hashes and the checkpoint's."""
    _, source = read_export(input_dir)
    files = file_hashes(input_dir, exclude=(STAGE_RECORD, MARKER), hash_file=blake3_file)
    return source, digest({"input": files, "source": digest(checkpoint_hashes(source))})


def run_export(model: str, section: ExportSection, out_dir: Path, *, use_cache: bool = True,
               log: Log = lambda _: None) -> tuple[ExportReport, bool]:
    source = sources.resolve(model)
    return _run_into(export_stage(choices.plan_export(model, section)), None, digest(checkpoint_hashes(source.path)),
                     out_dir, ExportReport, use_cache=use_cache, log=log)


def run_passes(input_dir: Path, section: PassesSection, out_dir: Path, *, parity: bool = True,
               use_cache: bool = True, log: Log = lambda _: None) -> tuple[PassesReport, bool]:
    # the stage's code (onnx_ir) loads only when its options are checked
    from toolchain.stages.optimize import pass_names

    pass_names(section.target, section.passes)  # before the input is read, as the stage itself does
    plan = choices.plan_passes(section, parity)
    source, parent = _input_parent(Path(input_dir))
    return _run_into(passes_stage(plan, source), Path(input_dir), parent, out_dir, PassesReport,
                     use_cache=use_cache, log=log)


def run_compress(input_dir: Path, section: CompressSection, target: str, out_dir: Path, *, use_cache: bool = True,
                 log: Log = lambda _: None) -> tuple[CompressionReport, bool]:
    plan = choices.plan_compress(section, target)  # the cross-field rules, before the input is read
    source, parent = _input_parent(Path(input_dir))
    return _run_into(compress_stage(plan, source), Path(input_dir), parent, out_dir, CompressionReport,
                     use_cache=use_cache, log=log)


def run_compile(input_dir: Path, section: CompileSection, out_dir: Path, *, use_cache: bool = True,
                log: Log = lambda _: None) -> tuple[CompileReport, bool]:
    source, parent = _input_parent(Path(input_dir))
    return _run_into(compile_stage(choices.plan_compile(section), source), Path(input_dir), parent, out_dir,
                     CompileReport, use_cache=use_cache, log=log)
