"""The `dstc` command line: parses, calls the pipeline, prints. No logic lives here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from toolchain import __version__
from toolchain.errors import DstcError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
    from toolchain.models.registry import list_embedded

    rows = list_embedded()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        click.echo(f"{row['name']:<24} {row['model_type']:<12} {row['parameters']:>10,} params  {row['path']}")


@models.command("make")
@click.argument("names", nargs=-1)
@click.option("-o", "--out", "out_root", type=click.Path(path_type=Path), default=None,
              help="Where to write the checkpoints (default: the package's embedded model folder).")
def models_make(names: tuple[str, ...], out_root: Path | None) -> None:
    """Build, train and save the embedded models deterministically (all of them when no NAMES are given)."""
    from toolchain.models.make import make_models

    for name, path, metrics in make_models(list(names) or None, out_root):
        click.echo(f"{name}: {path}  " + "  ".join(f"{k}={v}" for k, v in metrics.items()))


@models.command("shape-faithful")
@click.argument("reference")
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True)
@click.option("--layers", type=int, default=4, show_default=True, help="Number of decoder layers to keep.")
@click.option("--experts", type=int, default=None, help="Routed experts to keep (MoE models; default: all).")
@click.option("--seed", type=int, default=0, show_default=True)
def models_shape_faithful(reference: str, out_dir: Path, layers: int, experts: int | None, seed: int) -> None:
    """Write a random-weight checkpoint with a real model's widths (REFERENCE: see `dstc models list`)."""
    from toolchain.models.shape_faithful import make_shape_faithful

    path = make_shape_faithful(reference, out_dir, num_layers=layers, num_experts=experts, seed=seed)
    click.echo(str(path))


def main() -> None:
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("dstc: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2)
    except DstcError as e:
        click.echo(f"dstc: error: {e}", err=True)
        sys.exit(e.exit_code)
