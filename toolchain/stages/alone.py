"""Each stage run alone, in this process and without the stage cache (tests, benchmarks): its section's fields as
keywords, planned by the one planner (toolchain/stages/choices.py) as the single-stage commands plan them, then the
stage itself with its one signature, ``stage(input, output, section, context)``."""

from __future__ import annotations

from pathlib import Path

from toolchain.recipe import CompileSection, CompressSection, ExportSection, PassesSection
from toolchain.stages import choices
from toolchain.stages.context import StageContext


def _quiet(_: str) -> None:
    return None


def export(spec: str, out_dir: Path, *, revision: str | None = None, defer_weights: bool = False,
           weights_read_by: str | None = None, log=_quiet, **fields) -> dict:
    """``fields``: the export section's (``parity``: a tuple as well; None for the default)."""
    # the stage's code (torch, onnx_ir, the runtimes) loads when it runs
    from toolchain.stages.export import export as export_stage

    if fields.get("parity", ()) is None:
        del fields["parity"]
    elif "parity" in fields:
        fields["parity"] = list(fields["parity"])
    plan = choices.plan_export(spec, ExportSection.check(fields), revision)
    plan = plan.model_copy(update={"defer_weights": defer_weights, "weights_read_by": weights_read_by})
    assert plan.export is not None
    return export_stage(None, Path(out_dir), plan.export, StageContext(plan, log=log))


def optimize(in_dir: Path, out_dir: Path, target: str, passes: list[str] | None = None,
             expectations: dict | None = None, *, parity: bool = True, new_tokens: int | None = None,
             source: Path | None = None, log=_quiet) -> dict:
    # the stage's code (torch, onnx_ir, the runtimes) loads when it runs
    from toolchain.stages.optimize import optimize as optimize_stage, pass_names

    pass_names(target, passes)  # an unknown target's message, as `dstc optimize` checks it first
    plan = choices.plan_passes(PassesSection(target=target, passes=passes, expect=expectations), parity)
    assert plan.passes is not None
    return optimize_stage(Path(in_dir), Path(out_dir), plan.passes,
                          StageContext(plan, source, log, check_tokens=new_tokens))


def compress(in_dir: Path, out_dir: Path, section: CompressSection, *, target: str = "onnxruntime",
             source: Path | None = None, parts=None, log=_quiet) -> dict:
    # the stage's code (torch, onnx_ir, the runtimes) loads when it runs
    from toolchain.stages.compress import compress as compress_stage

    plan = choices.plan_compress(section, target)
    assert plan.compress is not None
    return compress_stage(Path(in_dir), Path(out_dir), plan.compress, StageContext(plan, source, log, parts))


def compile_artifact(export_dir: Path, out_dir: Path, backend: str, *, new_tokens: int | None = None,
                     source: Path | None = None, log=_quiet, release_input=None, **fields) -> dict:
    """``fields``: the compile section's but its backend (verify, smoke)."""
    # the stage's code (torch, onnx_ir, the runtimes) loads when it runs
    from toolchain.stages.compile import compile_artifact as compile_stage

    plan = choices.plan_compile(CompileSection.check({"backend": backend, **fields}))
    assert plan.compile is not None
    return compile_stage(Path(export_dir), Path(out_dir), plan.compile,
                         StageContext(plan, source, log, release_input=release_input, check_tokens=new_tokens))
