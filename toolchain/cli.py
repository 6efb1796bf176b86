"""The `dstc` command line: parses, calls the pipeline, prints. No logic lives here."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from toolchain import __version__, interrupts, stdout_guard
from toolchain.atomic import (
    check_writable_file,
    check_writable_target,
    ensure_output_dir,
    is_write_error,
    write_file_atomically,
)
from toolchain.cli_options import former_name, given_section, section_options, take_former_names
from toolchain.deployment import ORT_GENAI
from toolchain.errors import INTERNAL_ERROR_EXIT, INTERRUPTED_EXIT, DstcError, InputError
from toolchain.extras import missing_extra
from toolchain.gates import GateFailed, GateLimits, check_gates
from toolchain.interface.reports import CompileReport, CompressionReport, ExportReport, PassesReport
from toolchain.manifest import read_manifest, sign_artifact, verify_artifact
from toolchain.manifest_schema import Manifest
from toolchain.recipe import CompileSection, CompressSection, ExportSection, PassesSection, load_recipe
from toolchain.report.comparison import comparison_rows, render_comparison_html, render_comparison_text
from toolchain.report.markdown import render_summary
from toolchain.report.schema import load_report
from toolchain.runtime.artifact import open_artifact
from toolchain.runtime.memory import require_artifact_memory
from toolchain.serve.auth import load_api_keys
from toolchain.serve.settings import SERVE_SPELLINGS, ServeSettings
from toolchain.settings.evaluation import EvalSettings
from toolchain.settings.speculation import SpeculationSettings
from toolchain.signing import generate_keys
from toolchain.stdout_guard import echo, own_stdout, print_json, stdout_held

if TYPE_CHECKING:
    from rich.status import Status


class _Command(click.Command):
    """A command whose work runs with stdout held for dstc's own output (toolchain/stdout_guard.py): what
    libraries, runtimes and child processes print goes to stderr. Parsing and --help are not held."""

    def invoke(self, ctx):
        with stdout_held():
            return super().invoke(ctx)


class _Group(click.Group):
    command_class = _Command
    group_class = type  # subgroups (models, passes) are _Groups too

    def list_commands(self, ctx):
        """In the order of the work (SUMMARIES), not alphabetical."""
        prefix = f"{ctx.command_path.removeprefix(ctx.find_root().command_path)} ".lstrip()
        order = [name.removeprefix(prefix) for name in SUMMARIES if name.startswith(prefix)]
        return sorted(self.commands, key=lambda n: order.index(n) if n in order else len(order))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dstc")
def cli() -> None:
    """dstc: export DeepSeek language models to ONNX, optimise, compress and compile them for CPU inference.

    MODEL arguments accept an embedded model name (see `dstc models list`), a local Hugging Face checkpoint
    directory, or a hub id already in the local Hugging Face cache (nothing is downloaded).
    """


@cli.group()
def models() -> None:
    """The embedded tiny DeepSeek models and shape-faithful random models."""


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def models_list(as_json: bool) -> None:
    """List the embedded models with their architecture, size and training metrics."""
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.models.catalog import list_embedded

    rows = list_embedded()
    if as_json:
        print_json(rows)
        return
    name, kind, size = (max(len(f"{row[k]:,}" if k == "parameters" else str(row[k])) for row in rows)
                        for k in ("name", "model_type", "parameters"))
    name, kind, size = max(name, len("model")), max(kind, len("model_type")), max(size, len("parameters"))
    for heading, rows_of_kind in (("Embedded models (trained, buildable as they are):",
                                   [r for r in rows if r["kind"] != "reference"]),
                                  ("Real models' configs (for `dstc models shape-faithful`; their weights come from "
                                   "your checkpoint):", [r for r in rows if r["kind"] == "reference"])):
        echo(heading)
        echo(f"  {'model':<{name}}  {'model_type':<{kind}}  {'parameters':>{size}}  path")
        for row in rows_of_kind:  # columns as wide as their longest entry: a real model's name and size are longer
            echo(f"  {row['name']:<{name}}  {row['model_type']:<{kind}}  {row['parameters']:>{size},}  {row['path']}")


@models.command("make")
@click.argument("names", nargs=-1)
@click.option("-o", "--out", "out_root", type=click.Path(path_type=Path), required=True,
              help="Directory to write the checkpoints into (DIR/<name>); the installed package's own models are "
                   "never overwritten.")
def models_make(names: tuple[str, ...], out_root: Path) -> None:
    """Build, train and save the embedded models deterministically (all of them when no NAMES are given)."""
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.models.make import make_models

    for name, path, metrics in make_models(list(names) or None, out_root):
        echo(f"{name}: {path}  " + "  ".join(f"{k}={v}" for k, v in metrics.items()))


@models.command("shape-faithful")
@click.argument("reference")
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory to write the checkpoint into.")
@click.option("--layers", type=int, default=4, show_default=True, help="Number of decoder layers to keep.")
@click.option("--experts", type=int, default=None, help="Routed experts to keep (MoE models; default: all).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--fp8", is_flag=True, help="DeepSeek-V3 in the hub's FP8 layout (e4m3 projections with 128x128 block "
                                          "scales), as the real checkpoint ships.")
def models_shape_faithful(reference: str, out_dir: Path, layers: int, experts: int | None, seed: int,
                          fp8: bool) -> None:
    """Write a random-weight checkpoint with a real model's widths (REFERENCE: see `dstc models list`)."""
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.models.shape_faithful import make_shape_faithful

    path = make_shape_faithful(reference, out_dir, num_layers=layers, num_experts=experts, seed=seed, fp8=fp8)
    echo(str(path))


# The stage options come from the sections (toolchain/cli_options.py), help included (each field's description):
# a recipe's keys with their types, choices, bounds, defaults and help.
# a mapping of pass -> expected counts: a recipe's passes.expect, not a command-line value
PASSES_EXCLUDED = ("expect",)
# one name for the runtime a stage builds for, as compile's: passes.target is --backend (--target: its former name)
PASSES_SPELLINGS = {"target": "--backend"}
PASSES_ALIASES: dict[str, str | tuple[str, bool]] = {"target": "--target"}


def _backend_option(default: str | None, help: str):
    """--backend, and --target, its former name in optimize, compress and passes list, still taken (hidden)."""

    def decorate(command):
        command = click.option("--target", "target_alias", type=click.Choice(["onnxruntime", "openvino"]),
                               default=None, hidden=True)(command)
        return click.option("--backend", type=click.Choice(["onnxruntime", "openvino"]), default=default,
                            show_default=default is not None, help=help)(command)

    return decorate


def _backend(backend: str | None, target_alias: str | None) -> str | None:
    if target_alias is None:
        return backend
    if click.get_current_context().get_parameter_source("backend") is not ParameterSource.DEFAULT:
        raise InputError("--backend given twice (also by its former name --target)")
    click.echo("dstc: warning: --target is now --backend", err=True)
    return target_alias
COMPRESS_SPELLINGS = {"sym": "--sym/--asym"}


def _stage_command(report_file: str):
    """The options every single-stage command has besides its section's: output, cache, JSON."""

    def decorate(command):
        command = click.option("--json", "as_json", is_flag=True,
                               help=f"Print {report_file} to stdout instead of the summary.")(command)
        command = click.option("--no-cache", is_flag=True,
                               help="Run the stage again instead of reusing the same stage (same input, options and "
                                    "code) from the stage cache (DSTC_CACHE_DIR, default ~/.cache/dstc).")(command)
        return command

    return decorate


_OUT = click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True,
                    help="Output directory (created; replaced atomically if it holds an earlier dstc output).")


@cli.command("export")
@click.argument("model")
@_OUT
@section_options(ExportSection)
@_stage_command("export.json")
def export_cmd(model: str, out_dir: Path, no_cache: bool, as_json: bool, **options) -> None:
    """Export MODEL to OUT/model.onnx with a KV cache, and check it against PyTorch (written to OUT/export.json).

    Exit codes: 0 parity passed; 2 bad input (nothing written); 3 parity failed (output kept for inspection).

    Runs as a stage of `dstc build`: the options are a recipe's export: keys, checked by the same rules; the same
    stage (same input, options and code) is reused from the stage cache unless --no-cache; OUT/stage.json records
    the stage's id, parent and configuration.
    """
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.stages.runner import run_export

    report, _ = run_export(model, given_section(ExportSection, options), out_dir, use_cache=not no_cache,
                           log=_logger("export"))
    if as_json:
        print_json(report.dump())
        return
    src, graph = report.source, report.graph
    echo(f"{src.spec} ({src.model_type}, {src.parameters:,} parameters) -> {out_dir / 'model.onnx'}  "
               f"[{graph.nodes} nodes, {graph.size_bytes / 1e6:.1f} MB, {graph.weights} weights]")
    for backend, r in report.parity.items():
        if r.mode == "layer by layer":
            echo(f"parity {backend:<11} {'PASS' if r.passed else 'FAIL'}  layer by layer: max diff "
                       f"{r.max_relative_diff:.2e} of the reference's range (limit "
                       f"{r.tolerance_relative_to_logits_range:.0e}) over {len(r.pieces or {})} pieces")
            continue
        cases = ", ".join(f"{c['name']} {c['relative_diff']:.1e}" for c in r.cases)
        echo(f"parity {backend:<11} {'PASS' if r.passed else 'FAIL'}  max |diff| {r.max_abs_diff:.2e} "
                   f"= {r.max_relative_diff:.2e} of logits range (limit {r.tolerance_relative_to_logits_range:.0e}); "
                   f"greedy tokens {'identical' if r.tokens_identical else 'DIFFER'}  [{cases}]")


@cli.command("optimize")
@click.argument("in_dir", metavar="IN", type=click.Path(path_type=Path))
@_OUT
@section_options(PassesSection, spellings=PASSES_SPELLINGS, aliases=PASSES_ALIASES, comma=("passes",),
                 exclude=PASSES_EXCLUDED)
@click.option("--no-parity", is_flag=True, help="Skip the parity check of the optimised graph against PyTorch.")
@_stage_command("passes.json")
def optimize_cmd(in_dir: Path, out_dir: Path, no_parity: bool, no_cache: bool, as_json: bool, **options) -> None:
    """Rewrite the output of `dstc export` (IN) for a runtime; per-pass statistics go to OUT/passes.json.

    Exit codes: 0 done; 2 bad input; 3 the optimised graph disagrees with PyTorch; 4 a pass failed or fused
    less than the target expects (the message names the pass and its closest near-miss).

    Runs as a stage of `dstc build`: the options are a recipe's passes: keys, checked by the same rules; the same
    stage (same input, options and code) is reused from the stage cache unless --no-cache; OUT/stage.json records
    the stage's id, parent and configuration.
    """
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.stages.runner import run_passes

    section = given_section(PassesSection, options, PASSES_SPELLINGS)
    report, _ = run_passes(in_dir, section, out_dir, parity=not no_parity, use_cache=not no_cache,
                           log=_logger("optimize"))
    if as_json:
        print_json(report.dump())
        return
    echo(f"{report.target}: {report.input['nodes']} -> {report.output['nodes']} nodes -> "
               f"{out_dir / 'model.onnx'}")
    for stat in report.passes:
        counts = ", ".join(f"{k} {v}" for k, v in stat["counts"].items())
        echo(f"  {stat['name']:<28} {stat['nodes_before']:>6} -> {stat['nodes_after']:<6} {counts}")
    for fusion, count in (report.openvino_fusions or {}).items():
        echo(f"  OpenVINO runtime {fusion}: {count}")
    for backend, r in (report.parity or {}).items():
        echo(f"parity {backend}: {'PASS' if r.passed else 'FAIL'}, max relative logit diff "
                   f"{r.max_relative_diff:.1e}, greedy tokens {'identical' if r.tokens_identical else 'DIFFER'}")


@cli.command("compress")
@click.argument("in_dir", metavar="IN", type=click.Path(path_type=Path))
@_OUT
@_backend_option("onnxruntime", "onnxruntime: MatMulNBits in model.onnx; openvino: compressed openvino_model.xml (a "
                                 "recipe's compile.backend).")
@section_options(CompressSection, spellings=COMPRESS_SPELLINGS, defaults={"scheme": "int4-grouped"})
@_stage_command("compression.json")
def compress_cmd(in_dir: Path, out_dir: Path, backend: str, target_alias: str | None, no_cache: bool, as_json: bool,
                 **options) -> None:
    """Compress the weights of IN (an export or optimize output) through NNCF; errors measured where they
    happen (per layer, per head, MoE routing agreement) go to OUT/compression.json.

    Exit codes: 0 done; 2 bad input or options a recipe would refuse (nothing written).

    Runs as a stage of `dstc build`: the options are a recipe's compress: keys, checked by the same rules; the same
    stage (same input, options and code) is reused from the stage cache unless --no-cache; OUT/stage.json records
    the stage's id, parent and configuration.
    """
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.stages.runner import run_compress

    target = _backend(backend, target_alias) or backend  # --backend has a default here
    section = given_section(CompressSection, options, COMPRESS_SPELLINGS)
    report, _ = run_compress(in_dir, section, target, out_dir, use_cache=not no_cache, log=_logger("compress"))
    if as_json:
        print_json(report.dump())
        return
    # input_size_bytes: every compress stage records it
    echo(f"{report.scheme} for {target} -> {out_dir}: {report.input_size_bytes / 1e6:.1f} MB -> "  # type: ignore[operator]
               f"{report.size_bytes / 1e6:.1f} MB, {report.weights.bits_per_weight:.2f} bits/weight")
    model = report.model
    if model.top1_agreement is None:
        echo(f"weight errors measured per weight; {model.note or 'the model was not run'}")
        return
    echo(f"vs uncompressed on {model.tokens} calibration tokens: top-1 agreement {model.top1_agreement:.3f}, "
               f"mean KL {model.kl_mean:.2e}" + (f", min MoE routing agreement {report.routing_agreement_min:.3f}"
                                                 if report.routing_agreement_min is not None else ""))


@cli.command("compile")
@click.argument("export_dir", metavar="IN", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Artifact directory.")
@section_options(CompileSection)
@_stage_command("compile.json")
def compile_cmd(export_dir: Path, out_dir: Path, no_cache: bool, as_json: bool, **options) -> None:
    """Compile the output of `dstc export` (IN) into an artifact for one runtime.

    openvino: stateful IR (KV cache in ReadValue/Assign, beam_idx) with tokenizer IR, for openvino_genai's
    LLMPipeline and optimum-intel's OVModelForCausalLM. onnxruntime: the graph with external weights and a
    genai_config.json for onnxruntime-genai where its config can describe the model.

    Runs as a stage of `dstc build`: the options are a recipe's compile: keys, checked by the same rules; the same
    stage (same input, options and code) is reused from the stage cache unless --no-cache; OUT/stage.json records
    the stage's id, parent and configuration.
    """
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.stages.runner import run_compile

    section = given_section(CompileSection, options)
    report, _ = run_compile(export_dir, section, out_dir, use_cache=not no_cache, log=_logger("compile"))
    if as_json:
        print_json(report.dump())
        return
    echo(f"{report.backend} artifact for {report.model_type} -> {out_dir} ({len(report.files)} files)")
    verification = report.verification
    if verification and verification.get("skipped"):
        echo(f"verification skipped: {verification['skipped']}")
    elif verification:
        echo(f"verified against {verification['reference']}: {'PASS' if verification['passed'] else 'FAIL'}, "
                   f"max relative logit diff {verification['max_relative_diff']:.1e}, greedy tokens "
                   f"{'identical' if verification['tokens_identical'] else 'DIFFER'}")


_STARTED = time.monotonic()


def _elapsed() -> str:
    """The time since the command started, at the head of each progress line: a CI log shows where the minutes
    went before a stage ends."""
    seconds = time.monotonic() - _STARTED
    return f"{int(seconds // 60):02d}:{seconds % 60:04.1f}"


def _logger(stage: str):
    """Progress lines of a stage, on stderr so that --json output stays clean."""
    return lambda msg: click.echo(f"{_elapsed()} [{stage}] {msg}", err=True)


class _BuildDisplay:
    """Rich progress for `dstc build`: a spinner per running stage, stage logs dimmed, one line per finished stage."""

    def __init__(self) -> None:
        from rich.console import Console

        # outside a terminal (a CI log) no width applies: a line is not broken at 80 columns, mid-path
        self.console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
        self.status: Status | None = None

    def stage_started(self, name: str, stage_id: str, cached: bool) -> None:
        if cached:
            return
        stage = f" (stage {stage_id[:12]})" if stage_id else ""
        self.status = self.console.status(f"[bold]{name}[/] running{stage}")
        self.status.start()

    def stage_finished(self, name: str, seconds: float, cached: bool) -> None:
        if self.status:
            self.status.stop()
            self.status = None
        note = "[cyan]reused from the stage cache[/]" if cached else f"[green]done[/] in {seconds:.1f} s"
        self.console.print(f"{_elapsed()}  {name:<9} {note}", highlight=False)

    def log(self, message: str) -> None:
        from rich.markup import escape

        self.console.print(f"[dim]{_elapsed()}    {escape(message)}[/]", highlight=False)

    def close(self) -> None:
        if self.status:
            self.status.stop()


def _parity_line(results: dict) -> str:
    return "; ".join(f"{b} {r.max_relative_diff:.1e} {'ok' if r.passed else 'FAIL'}" for b, r in results.items())


def _stage_check(name: str, provenance) -> str:
    """One line of what a stage checked, from its report in the manifest's provenance."""
    if name == "export" and (export := provenance.report("export", ExportReport)):
        layers = " layer by layer" if export.parity_mode == "layer by layer" else ""
        return f"parity{layers} " + _parity_line(export.parity)
    if name == "compress" and (compression := provenance.report("compress", CompressionReport)):
        routing, model = compression.routing_agreement_min, compression.model
        bits = f"{compression.weights.bits_per_weight:.2f} bits/w"
        if model.top1_agreement is None:
            return f"{bits}, streamed (weight errors only)"
        return (f"{bits}, top-1 {model.top1_agreement:.3f}, "
                f"KL {model.kl_mean:.1e}" + (f", routing {routing:.3f}" if routing is not None else ""))
    if name == "passes" and (passes := provenance.report("passes", PassesReport)):
        fused = ", ".join(f"{k} {v}" for counts in passes.counts.values() for k, v in counts.items()
                          if k != "values_annotated")
        if passes.parity_skipped:
            return f"{fused or 'no fusions'}; parity skipped (model above the end-to-end budget)"
        return f"{fused or 'no fusions'}; parity " + _parity_line(passes.parity or {})
    compiled = provenance.report("compile", CompileReport) if name == "compile" else None
    if compiled and compiled.verification:
        v = compiled.verification
        if v.get("skipped"):
            return "verification skipped (model above the end-to-end budget)"
        return f"greedy vs {v['reference']} {'identical' if v['passed'] else 'DIFFER'}"
    return ""


def _loads_with_line(manifest) -> str:
    """Which runtimes load the artifact (manifest.loads_with), and why not onnxruntime-genai when compile wrote no
    genai_config.json (docs/serve.md "Which runtimes load an artifact")."""
    compiled = manifest.provenance.report("compile", CompileReport)
    reason = (compiled.onnxruntime or {}).get("genai_unsupported_reason") if compiled else None
    why = f" (not onnxruntime-genai: {reason})" if reason and ORT_GENAI not in manifest.loads_with else ""
    return f"loads with: {', '.join(manifest.loads_with)}{why}"


def _print_build_summary(manifest, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    recipe, prov = manifest.recipe, manifest.provenance
    table = Table(title=f"{recipe.name}: {recipe.model} -> {recipe.compile.backend}", title_justify="left")
    for column in ("stage", "id", "time", "check"):
        table.add_column(column)
    for stage in manifest.stages:
        cached = "cached" if stage.name in prov.cached_stages else f"{prov.durations_s[stage.name]:.1f} s"
        table.add_row(stage.name, stage.id[:12], cached, _stage_check(stage.name, prov))
    console = Console(file=own_stdout())
    console.print(table)
    size = sum((out_dir / f).stat().st_size for f in manifest.files)
    console.print(f"artifact {out_dir}  ({len(manifest.files)} files, {size / 1e6:.1f} MB, "
                  f"built in {prov.durations_s['total']:.1f} s)")
    if manifest.loads_with is not None:
        echo(_loads_with_line(manifest))
    if (out_dir / "report.json").is_file():
        report = load_report(out_dir / "report.json")
        echo(render_summary(report))  # plain text: its own line breaks, not the console's wrapping
        if report.gates:
            _print_gates(report.gates)
        echo(f"report: {(out_dir / 'report.html').resolve()}")


# --ray without an address
_LOCAL_RAY = "local"


@cli.command("build")
@click.argument("recipes", metavar="RECIPE...", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Artifact directory (default: artifacts/<recipe name>); with several recipes, the directory "
                   "of their artifacts, each in DIR/<recipe name>.")
@click.option("--model", default=None, help="Build the recipe on another checkpoint (name, directory or hub id).")
@click.option("--no-cache", is_flag=True, help="Run every stage again instead of reusing the stage cache.")
@click.option("--no-keep-stages", is_flag=True,
              help="Keep none of the build's stage outputs in the stage cache: each is deleted once the next stage "
                   "has read it, and the last one is moved into the artifact, so the disk holds the checkpoint, the "
                   "artifact and at most two stages' outputs at once (nothing is left for a rebuild to reuse). One "
                   "recipe, on this machine.")
@click.option("--ray", "ray_address", is_flag=False, flag_value=_LOCAL_RAY, default=None, metavar="[ADDRESS]",
              help="Build each recipe as a Ray task: on a local Ray started for the run (no ADDRESS), or on the "
                   "cluster at ADDRESS (auto, ray://HOST:PORT or HOST:PORT). DSTC_CACHE_DIR, the recipes and -o "
                   "must be on storage every node sees, at the same path.")
@click.option("--split", "parts", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --ray: a streamed compression (large models) writes its weights in N Ray tasks, one range "
                   "of layers each, assembled into the bytes one process writes (default: the cluster's CPUs; 1: "
                   "one task).")
@click.option("--json", "as_json", is_flag=True, help="Print manifest.json to stdout instead of the summary "
                                                      "(with several recipes or --ray: a list, one per recipe).")
def build_cmd(recipes: tuple[Path, ...], out_dir: Path | None, model: str | None, no_cache: bool,
              no_keep_stages: bool, ray_address: str | None, parts: int | None, as_json: bool) -> None:
    """Run every stage RECIPE names (export, passes, compression, compile, evaluation) into a verified artifact.

    A recipe's eval section writes report.json/.md/.html into the artifact; its gates section makes the build
    exit 1 when a gate fails (the artifact and report are kept).

    Finished stages are cached by id (DSTC_CACHE_DIR, default ~/.cache/dstc) and reused when their inputs
    and configuration are unchanged. The artifact is assembled beside its target and renamed into place at the
    end: an interrupted build leaves the previous artifact as it was.

    Several recipes are all checked before the first is built (a bad one: exit 2, nothing built), then built one
    after another, or with --ray as Ray tasks sharing the stage cache; a failed recipe prints its error and the
    others go on; the exit code is the worst of them.
    """
    if ray_address is not None and ray_address.endswith((".yaml", ".yml")):
        # `--ray a.yaml b.yaml`: the option's value is optional and click took the first recipe for it
        recipes, ray_address = (Path(ray_address), *recipes), _LOCAL_RAY
    if no_keep_stages and (len(recipes) > 1 or ray_address is not None):
        # several builds share the stage cache, and one may be reading what another would delete
        raise InputError("--no-keep-stages builds one recipe on this machine, without --ray")
    if parts is not None and ray_address is None:
        raise InputError("--split N splits a build's streamed compression over Ray workers: use it with --ray")
    if len(recipes) > 1 or ray_address is not None:
        _build_set(list(recipes), out_dir, model, not no_cache, ray_address, as_json, parts)
        return
    recipe = recipes[0]
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.build import build

    display = _BuildDisplay()
    try:
        # _BuildDisplay has the methods of build's Events
        manifest = build(recipe, out_dir, model=model, use_cache=not no_cache, keep_stages=not no_keep_stages,
                         events=display)  # type: ignore[arg-type]
    except GateFailed:
        # The artifact and its report were kept: show them before the one-line error and exit 1.
        display.close()
        if not as_json:
            final = out_dir or Path("artifacts") / load_recipe(recipe, model).name
            _print_build_summary(read_manifest(final), final)
        raise
    finally:
        display.close()
    if as_json:
        print_json(manifest)
    else:
        typed = Manifest.parse(manifest)
        _print_build_summary(typed, Path(typed.provenance.output))


def _build_set(recipes: list[Path], out_dir: Path | None, model: str | None, use_cache: bool,
               ray_address: str | None, as_json: bool, parts: int | None = None) -> None:
    # loaded when the command runs: the CLI starts without numpy, torch, the runtimes or Ray
    from toolchain.build_set import plan_jobs, run_local, worst

    jobs = plan_jobs(recipes, out_dir, model)
    if ray_address is None:
        outcomes = run_local(jobs, model, use_cache)
    else:
        # loaded when the command runs: Ray is imported only for --ray
        from toolchain.distributed.ray_builds import run_on_ray

        outcomes = run_on_ray(jobs, None if ray_address == _LOCAL_RAY else ray_address, model, use_cache, parts)
    if as_json:
        print_json([{"recipe": o.name, "output": str(o.out_dir), "exit_code": o.exit_code, "error": o.error,
                     "manifest": o.manifest or None} for o in outcomes])
    for o in outcomes:
        if o.exit_code == 0:
            seconds = o.manifest["provenance"]["durations_s"]["total"]
            runtimes = ", ".join(o.manifest.get("loads_with") or [])
            click.echo(f"{o.name}: built {o.out_dir} ({len(o.manifest['files'])} files, {seconds:.1f} s)"
                       + (f"; loads with: {runtimes}" if runtimes else ""), err=True)
        else:
            click.echo(f"{o.name}: error (exit {o.exit_code}): {o.error}", err=True)
    if code := worst(outcomes):
        sys.exit(code)


@cli.command("verify")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--public-key", type=click.Path(path_type=Path), default=None,
              help="Also check manifest.json.sig: an Ed25519 signature of manifest.json by this key (PEM).")
def verify_cmd(artifact: Path, public_key: Path | None) -> None:
    """Check ARTIFACT: manifest.json against its own digest (and its signature, with --public-key), every file
    against manifest.json, and the report files against report.json. Exit 0 if all match, 1 naming each
    changed, missing or extra file, 2 if ARTIFACT is not an artifact."""
    problems = verify_artifact(artifact, public_key)
    for problem in problems:
        echo(problem)
    if problems:
        sys.exit(1)
    signed = " and is signed by that key" if public_key else ""
    echo(f"{artifact}: every file matches manifest.json{signed}")


@cli.command("sign")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--key", "key", type=click.Path(path_type=Path), required=True,
              help="Ed25519 private key (PEM, unencrypted), e.g. from `dstc keygen` or "
                   "`openssl genpkey -algorithm ed25519 -out key.pem`.")
def sign_cmd(artifact: Path, key: Path) -> None:
    """Sign ARTIFACT's manifest.json with an Ed25519 key (manifest.json.sig), after checking every file against
    it. `dstc verify ARTIFACT --public-key PUB` checks the signature."""
    echo(str(sign_artifact(artifact, key)))


@cli.command("keygen")
@click.argument("private_key", type=click.Path(path_type=Path))
@click.argument("public_key", type=click.Path(path_type=Path))
def keygen_cmd(private_key: Path, public_key: Path) -> None:
    """Write a new Ed25519 key pair (PEM) for `dstc sign` and `dstc verify --public-key`; existing files are
    never overwritten."""
    generate_keys(private_key, public_key)
    echo(f"private key {private_key} (mode 0600), public key {public_key}")


EVAL_SPELLINGS = {"reference_cache": "--reference-cache/--no-reference-cache", "latency": "--latency/--no-latency"}
EVAL_ALIASES: dict[str, str | tuple[str, bool]] = {"openvino_f32": ("--deployment-defaults", False)}  # as serve's


def _eval_options(command):
    """Options shared by `dstc eval` and `dstc compare`: the reference, and how much to measure (a recipe's
    `eval:` section, toolchain/settings/evaluation.py)."""
    command = section_options(EvalSettings, spellings=EVAL_SPELLINGS, aliases=EVAL_ALIASES,
                              comma=("tasks", "prompt_lengths", "batches"))(command)
    return click.option("--reference", default=None,
                        help="fp32 PyTorch reference checkpoint (default: the source model named in the "
                             "manifest).")(command)


def _eval_settings(options: dict) -> EvalSettings:
    if options.get("tasks") and options.get("task_data") is None:  # the option to give, not the recipe key
        raise click.BadParameter("give the tasks' data with --task-data DIR (dstc never downloads)",
                                 param_hint="--tasks")
    settings = given_section(EvalSettings, options, EVAL_SPELLINGS)
    if settings.dataset is not None and not Path(settings.dataset).is_file():
        raise click.BadParameter(f"{settings.dataset} is not a file", param_hint="--dataset")
    return settings


@cli.command("eval")
@click.argument("artifact", type=click.Path(path_type=Path))
@_eval_options
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Where to write report.json/.md/.html (default: inside ARTIFACT, unless it holds its build's "
                   "gated report: then beside it, in ARTIFACT-eval).")
@click.option("--json", "as_json", is_flag=True, help="Print report.json to stdout instead of the summary.")
def eval_cmd(artifact: Path, reference: str | None, out_dir: Path | None, as_json: bool, **options) -> None:
    """Measure ARTIFACT against the fp32 PyTorch reference of its source model, and its latency.

    Accuracy, on the embedded corpus's held-out split or on --dataset: perplexity, exact match (the embedded task,
    or the data's prompt/answer records), KL and top-1 agreement of next-token distributions, greedy-continuation
    match, MoE routing agreement. The reference runs one decoder layer at a time from the checkpoint, and its
    outputs are kept in the reference cache for the next artifact of the same model and data. Latency (in a fresh
    process): load time, time to first token P50/P90/P99, inter-token latency P50/P90, tokens/s, peak RSS, for
    every prompt length x batch. Writes report.json, report.md and report.html. Progress on stderr, plain lines
    with the elapsed time: each reference layer, the accuracy pass in steps, each latency case and run.
    """
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.evaluate.run import evaluate_artifact, write_report

    settings = _eval_settings(options)
    if out_dir is None and _holds_gated_report(artifact):
        out_dir = artifact.with_name(f"{artifact.name}-eval")
        click.echo(f"{artifact} holds its build's gated report, which eval does not replace: this report goes to "
                   f"{out_dir} (-o {artifact} replaces it)", err=True)
    if out_dir is not None:
        check_writable_target(out_dir)  # before the work, not after it
    require_artifact_memory(open_artifact(artifact))  # whole, and fits, before the reference is loaded
    report = evaluate_artifact(artifact, settings, reference=reference, log=_logger("eval"))
    written = write_report(report, ensure_output_dir(out_dir) if out_dir is not None else artifact)
    if as_json:
        print_json(report.dump())
        return
    echo(render_summary(report))
    echo(f"report: {written[-1]}")


def _holds_gated_report(artifact: Path) -> bool:
    """Whether ARTIFACT's report.json carries gate verdicts (a build's with a recipe's gates:), which a release was
    judged by; a report that cannot be read is no such report (eval replaces it, as before)."""
    try:
        return bool(json.loads((artifact / "report.json").read_text()).get("gates"))
    except (OSError, ValueError, AttributeError):
        return False


@cli.command("compare")
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(path_type=Path))
@_eval_options
@click.option("--html", "html_out", type=click.Path(path_type=Path), default=None,
              help="Also write the table and the overlaid plots to this HTML file.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison rows and every report as JSON.")
def compare_cmd(artifacts: tuple[Path, ...], reference: str | None, html_out: Path | None, as_json: bool,
                **options) -> None:
    """Evaluate several ARTIFACTS in one run with the same prompts (typically one recipe built for ONNX Runtime
    and OpenVINO) and print them side by side, with each value's ratio to the first artifact's.

    Their latency runs alternate, A, B, A, B (a round is one run of every case of each), when they fit in memory
    together, else one artifact after the other. The output says what else differs between the builds (scheme,
    method, bits per weight, MoE lowering, cache), the CPU and threads, and names a better value only where the
    values differ as shown. Progress on stderr: a line per latency case and run, with the elapsed time."""
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.evaluate.compare import build_facts, compare_artifacts, labels_for

    if len(artifacts) < 2:
        raise click.BadParameter("give at least two artifacts", param_hint="ARTIFACTS")
    if html_out is not None:
        check_writable_file(html_out)
    for path in artifacts:  # each whole, and fitting, before the reference is loaded
        require_artifact_memory(open_artifact(path))
    settings = _eval_settings(options)
    reports = compare_artifacts(list(artifacts), settings, reference=reference,
                                log=lambda a, m: click.echo(f"{_elapsed()} [compare {a}] {m}", err=True))
    labels = labels_for(reports)
    facts = [build_facts(open_artifact(path).manifest) for path in artifacts]
    if html_out:
        write_file_atomically(html_out, render_comparison_html(reports, labels, facts))
    if as_json:
        print_json({"labels": labels, "rows": comparison_rows(reports, labels), "builds": facts,
                    "reports": [r.dump() for r in reports]})
        return
    echo(render_comparison_text(reports, labels, facts))
    if html_out:
        echo(f"comparison: {html_out}")


GATE_SPELLINGS = {"allow_unmeasured": "--allow-unmeasured/--no-allow-unmeasured",
                  "allow_other_model": "--allow-other-model/--no-allow-other-model",
                  "allow_other_machine": "--allow-other-machine/--no-allow-other-machine"}
# the names before the options were spelled as the recipe's gates: keys
GATE_ALIASES: dict[str, str | tuple[str, bool]] = {
    "max_perplexity_increase": "--max-ppl-increase", "min_top1_agreement": "--min-top1",
    "max_exact_match_drop": "--max-em-drop", "max_kl_mean": "--max-kl"}


@cli.command("gate")
@click.argument("report_path", metavar="REPORT", type=click.Path(path_type=Path))
@section_options(GateLimits, spellings=GATE_SPELLINGS, aliases=GATE_ALIASES)
@click.option("--json", "as_json", is_flag=True, help="Print the gate results as JSON.")
def gate_cmd(report_path: Path, as_json: bool, **options) -> None:
    """Check REPORT (a report.json or an artifact) against release gates, the options of a recipe's `gates:`.
    Exit 0 when every gate passes, 1 when any fails, 2 for bad input (no gates given, a limit that is not a finite
    number, an unreadable report, a baseline of another model or machine, latency medians whose confidence
    intervals make the ratio meaningless: docs/evaluate-and-gate.md)."""
    limits = given_section(GateLimits, options, GATE_SPELLINGS)
    if not limits.any():
        raise click.UsageError("no gates given: set at least one --max-*/--min-* option")
    baseline = load_report(Path(limits.baseline)) if limits.baseline else None
    results = check_gates(load_report(report_path), limits, baseline)
    if as_json:
        print_json([r.model_dump() for r in results])
        _warn_gates(results)
    else:
        _print_gates(results)
    if not all(r.passed for r in results):
        sys.exit(1)


def _print_gates(results) -> None:
    """The gate table as plain text: CI logs keep it whole, where a console table would wrap."""
    rows = [("gate", "value", "limit", "verdict", "against")]
    rows += [(r.name, "n/a" if r.value is None else f"{r.value:.4g}", f"{r.limit:g}",
              ("skipped" if r.passed else "FAIL") if r.skipped else ("pass" if r.passed else "FAIL"), r.detail)
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    _warn_gates(results)


def _warn_gates(results) -> None:
    """A gate whose verdict may not mean much (a latency ratio within its medians' noise), on stderr."""
    for r in results:
        if r.warning:
            click.echo(f"dstc: warning: {r.warning}", err=True)


@cli.command("generate")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--new-tokens", type=click.IntRange(1), default=64, show_default=True,
              help="Stop after this many new tokens (or at an end-of-sequence token).")
@former_name("new_tokens", "--max-new-tokens", click.IntRange(1))  # as eval's and export's --new-tokens now
@click.option("--chat/--raw", default=None,
              help="Wrap PROMPT in the tokenizer's chat template (default when it has one) or send it as is. "
                   "The embedded models were trained on raw text: use --raw with them.")
@click.option("--threads", type=click.IntRange(1), default=None, help="Runtime threads (default: every core).")
@click.option("--openvino-runtime-cache", "runtime_cache", type=click.IntRange(0), default=None, metavar="ENTRIES",
              help="OpenVINO: entries of the CPU plugin's cache of kernels built per input shape "
                   "(CPU_RUNTIME_CACHE_CAPACITY). Default: dstc's choice, bounded (with oneDNN's primitive cache) "
                   "for a large latent-MLA, V3.2 or V4 model, recorded by --json (docs/deepseek-generations.md "
                   "\"Long prompts\").")
@section_options(SpeculationSettings)
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object when done (tokens, text, time, speculation's acceptance per draft "
                   "position) instead of streaming the text.")
def generate_cmd(artifact: Path, prompt: str, chat: bool | None, threads: int | None, runtime_cache: int | None,
                 as_json: bool, **options) -> None:
    """Generate greedily from PROMPT with ARTIFACT, streaming tokens as they come."""
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.runtime.decoder import open_decoder
    from toolchain.runtime.generate import answer_record, prompt_ids, stream_text
    from toolchain.runtime.speculative import open_speculation

    take_former_names(options)
    max_new_tokens = options.pop("new_tokens")
    settings = given_section(SpeculationSettings, options)
    art = open_artifact(artifact)
    if runtime_cache is not None and art.backend != "openvino":
        raise InputError(f"--openvino-runtime-cache is the OpenVINO CPU plugin's; {artifact} is an {art.backend} "
                         "artifact")
    if chat is None:
        chat = bool(getattr(art.tokenizer(), "chat_template", None))
    prompt_tokens = len(prompt_ids(art, prompt, chat=chat))
    art.check_length(prompt_tokens, max_new_tokens)  # before the model is loaded
    speculation = open_speculation(settings, art, threads=threads, context=prompt_tokens + max_new_tokens)
    decoder = open_decoder(art, threads=threads, extra_outputs=speculation.main_outputs if speculation else (),
                           openvino_runtime_cache=runtime_cache)
    if as_json:
        print_json(answer_record(art, decoder, prompt, max_new_tokens=max_new_tokens, chat=chat,
                                 speculation=speculation))
        return
    for piece in stream_text(art, decoder, prompt, max_new_tokens=max_new_tokens, chat=chat,
                             speculation=speculation):
        echo(piece, nl=False)
    echo()
    if speculation is not None:
        rates = " ".join(f"{r:.2f}" for r in speculation.acceptance.rates)
        click.echo(f"speculation: {speculation.acceptance.steps} verify steps, acceptance per draft position "
                   f"{rates or 'n/a'}", err=True)


@cli.group("recipe")
def recipe_group() -> None:
    """Recipes: write a first one for your model (every key: docs/recipe.md)."""


@recipe_group.command("init")
@click.argument("model")
@click.option("--backend", type=click.Choice(["openvino", "onnxruntime"]), required=True,
              help="The runtime the artifact is for.")
@click.option("--scheme", type=click.Choice(["int4-grouped", "int8-per-channel", "int8-per-head", "fp32"]),
              default="int4-grouped", show_default=True, help="Weight compression (fp32: none).")
@click.option("--name", default=None, help="The recipe's and artifact's name (default: from MODEL, backend and "
                                          "scheme).")
@click.option("-o", "--out", "out_file", type=click.Path(path_type=Path), default=None,
              help="Write the recipe to this file (default: stdout); an existing file is not overwritten.")
def recipe_init(model: str, backend: str, scheme: str, name: str | None, out_file: Path | None) -> None:
    """Write a recipe that builds MODEL for a backend and scheme, to edit or to build as it is."""
    # loaded when the command runs: the recipe's models bring pydantic and the settings
    from toolchain.recipe_template import recipe_text

    text = recipe_text(model, backend, scheme, name)  # type: ignore[arg-type]  # click's Choice gives a Backend
    if out_file is None:
        echo(text.rstrip("\n"))
        return
    if out_file.exists():
        raise InputError(f"{out_file} exists: dstc recipe init does not overwrite a file")
    write_file_atomically(out_file, text)
    click.echo(f"wrote {out_file}; build it with: dstc build {out_file}", err=True)


@cli.group("passes")
def passes_group() -> None:
    """Graph-rewrite passes (see `dstc optimize`)."""


@passes_group.command("list")
@_backend_option(None, "Only the passes usable for this backend.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def passes_list(backend: str | None, target_alias: str | None, as_json: bool) -> None:
    """List the registered passes: name, targets, one-line description."""
    target = _backend(backend, target_alias)
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from passes.registry import list_passes

    rows = list_passes(target)
    if as_json:
        print_json(rows)
        return
    for row in rows:  # a row's targets: a list of names
        echo(f"{row['name']:<28} {','.join(row['targets']):<22} {row['description']}")  # type: ignore[arg-type]


@cli.command("serve")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. One other than the loopback's (127.0.0.1, ::1, localhost) needs an API key "
                   "or --allow-unauthenticated.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free port, printed at startup).")
@click.option("--api-key", envvar="DSTC_API_KEY", default=None, metavar="KEY",
              help="Require this key from clients, as OpenAI's do: Authorization: Bearer KEY (also from "
                   "$DSTC_API_KEY). /health and /metrics stay open.")
@click.option("--api-key-file", type=click.Path(path_type=Path), default=None, metavar="FILE",
              help="Require one of the keys in FILE (one per line), as --api-key; keeps the key off the command "
                   "line.")
@section_options(ServeSettings, spellings=SERVE_SPELLINGS, exclude=("api_keys",))
def serve_cmd(artifact: Path, host: str, port: int, api_key: str | None, api_key_file: Path | None,
              **options) -> None:
    """Serve ARTIFACT over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models; streaming
    as server-sent events), continuous batching, /health and Prometheus /metrics, until interrupted."""
    # loaded when the command runs: the CLI starts without numpy, torch or the runtimes
    from toolchain.serve.server import serve

    settings = given_section(ServeSettings, options, SERVE_SPELLINGS)
    settings = settings.model_copy(update={"api_keys": load_api_keys(api_key, api_key_file)})
    serve(artifact, settings, host=host, port=port, log=lambda m: click.echo(m, err=True))


# Each command's line in `dstc --help`, whole, in the order of the work: build, measure, gate, serve; then the
# single stages and the tools.
SUMMARIES = {
    "build": "Build an artifact from a recipe: export, passes, compress, compile, eval, gates.",
    "recipe": "Write a first recipe for your model.",
    "recipe init": "Write a recipe that builds MODEL for a backend and scheme.",
    "eval": "Measure an artifact against the fp32 PyTorch reference, and its latency.",
    "compare": "Evaluate several artifacts in one run, side by side.",
    "gate": "Check a report against release gates: exit 0 pass, 1 a gate failed.",
    "generate": "Generate text from a prompt with an artifact, streamed.",
    "serve": "Serve an artifact over HTTP with OpenAI's API.",
    "verify": "Check an artifact's files and report against its manifest (and signature).",
    "sign": "Sign an artifact's manifest with an Ed25519 key.",
    "keygen": "Write a new Ed25519 key pair for sign and verify.",
    "export": "Stage 1: export a model to ONNX with a KV cache, checked against PyTorch.",
    "optimize": "Stage 2: rewrite an export's graph for a runtime (passes).",
    "compress": "Stage 3: compress an export's weights through NNCF.",
    "compile": "Stage 4: compile an export into a runtime artifact, verified.",
    "models": "The embedded tiny models, real models' configs, shape-faithful checkpoints.",
    "models list": "List the embedded models and the real models' configs.",
    "models make": "Retrain the embedded models deterministically into a directory.",
    "models shape-faithful": "Write a random checkpoint with a real model's widths.",
    "passes": "The graph-rewrite passes.",
    "passes list": "List the registered passes.",
}

# Each command's --help ends with examples that run as written from the repository's root (tests/test_cli_help.py
# parses each), in one place so that they read alike.
EXAMPLES = {
    "build": ["dstc build recipes/deepseek-v3-tiny-openvino-int4.yaml",
              "dstc build recipes/deepseek-v3-tiny-openvino-int4.yaml --model ./my-checkpoint -o out/mine --json"],
    "export": ["dstc export deepseek-v3-tiny -o out/export"],
    "optimize": ["dstc optimize out/export -o out/passes --backend openvino"],
    "compress": ["dstc compress out/passes -o out/int4 --backend openvino --scheme int4-grouped --group-size 128"],
    "compile": ["dstc compile out/int4 -o out/artifact --backend openvino"],
    "eval": ["dstc eval artifacts/deepseek-v3-tiny-openvino-int4 -o out/report",
             "dstc eval ARTIFACT --dataset my-data.jsonl --no-latency --json > report.json",
             "dstc eval ARTIFACT --tasks arc_easy --task-data ./task-data --task-limit 50"],
    "compare": ["dstc compare artifacts/deepseek-v3-tiny-onnxruntime-int4 artifacts/deepseek-v3-tiny-openvino-int4 "
                "--html compare.html"],
    "gate": ["dstc gate artifacts/deepseek-v3-tiny-openvino-int4 --max-kl-mean 1e-3 --min-top1-agreement 0.85",
             "dstc gate ARTIFACT --baseline baselines/deepseek-v3-tiny-openvino-int4.json "
             "--max-perplexity-increase 0.02 --json > gates.json"],
    "generate": ["dstc generate artifacts/deepseek-v3-tiny-openvino-int4 \"The capital of\" --raw --new-tokens 16"],
    "serve": ["dstc serve artifacts/deepseek-v3-tiny-openvino-int4 --port 8000 --api-key \"$KEY\""],
    "verify": ["dstc verify artifacts/deepseek-v3-tiny-openvino-int4 --public-key release.pub"],
    "sign": ["dstc sign artifacts/deepseek-v3-tiny-openvino-int4 --key release.key"],
    "keygen": ["dstc keygen release.key release.pub"],
    "models list": ["dstc models list --json"],
    "models make": ["dstc models make deepseek-v3-tiny -o out/models"],
    "models shape-faithful": ["dstc models shape-faithful deepseek-v3 -o out/v3-4-layers --layers 4 --experts 16"],
    "passes list": ["dstc passes list --backend openvino"],
    "recipe init": ["dstc recipe init ./my-checkpoint --backend openvino --scheme int4-grouped -o my.yaml"],
}


def _add_help(group: click.Group, prefix: str = "") -> None:
    for name, command in group.commands.items():
        command.short_help = SUMMARIES.get(f"{prefix}{name}")
        if isinstance(command, click.Group):
            _add_help(command, f"{prefix}{name} ")
        elif f"{prefix}{name}" in EXAMPLES:
            # \b keeps click from joining the lines into one paragraph
            command.epilog = "\b\nExamples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[f"{prefix}{name}"])


_add_help(cli)


def _exit(message: str, code: int, as_json: bool, prefix: str = "dstc: error: ") -> None:
    """One line on stderr, the failure's JSON document on stdout with --json, and the exit code."""
    click.echo(f"{prefix}{message}", err=True)
    if as_json:
        stdout_guard.print_json_error(message, code)
    sys.exit(code)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: checkpoints come from disk or the HF cache
    interrupts.install()
    as_json = stdout_guard.json_requested(sys.argv[1:])
    stdout_guard.start()
    try:
        cli(standalone_mode=False)
        interrupts.raise_if_interrupted()
    except (click.exceptions.Abort, KeyboardInterrupt):
        _exit("interrupted", INTERRUPTED_EXIT, as_json, prefix="dstc: ")
    except click.ClickException as e:
        # one line, as for every other bad input (click's own form spreads it over a usage block)
        ctx = getattr(e, "ctx", None)  # a UsageError's
        command = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _exit(f"{e.format_message()}{command}", InputError.exit_code, as_json)
    except DstcError as e:
        _exit(str(e), e.exit_code, as_json)
    except OSError as e:
        if not is_write_error(e):
            _internal_error(e, as_json)
        _exit(f"{e.strerror}: {e.filename}", InputError.exit_code, as_json)  # a full disk is not a bug: no traceback
    except ModuleNotFoundError as e:
        # an install without an extra the command needs (pyproject.toml): how to add it, not a traceback
        message = missing_extra(e)
        if message is None:
            _internal_error(e, as_json)
        else:
            _exit(message, InputError.exit_code, as_json)
    except Exception as e:
        _internal_error(e, as_json)


def _internal_error(error: Exception, as_json: bool) -> None:
    """A bug: its traceback, then one line saying so, exit 70 (EX_SOFTWARE) apart from every documented failure."""
    traceback.print_exception(error)
    what = " ".join(f"{type(error).__name__}: {error}".split())[:300]  # one line: the traceback has it whole
    _exit(f"internal error ({what}): a bug in dstc; please report it with the command line and the traceback above",
          INTERNAL_ERROR_EXIT, as_json, prefix="dstc: ")
