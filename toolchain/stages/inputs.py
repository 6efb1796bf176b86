"""What a stage reads from the directory an earlier stage wrote: its export.json and the source checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

from toolchain.errors import InputError
from toolchain.interface.files import CONFIG, EXPORT_REPORT, MODEL_XML, MTP_DIR, ONNX_MODEL
from toolchain.interface.graph import PAST_PREFIX, REQUIRED_INPUTS, check_onnx_graph
from toolchain.interface.reports import ExportReport


def read_export(export_dir: Path, source: Path | None = None) -> tuple[dict, Path]:
    """The export's report and its source checkpoint directory, checked before anything is written.

    ``source`` replaces the directory export.json recorded: a build resolves the checkpoint itself, and a stage
    taken from the cache may have been exported from a checkout or cache that no longer exists."""
    if not export_dir.is_dir():
        raise InputError(f"{export_dir} is not a directory (expected the output of dstc export)")
    if not (export_dir / ONNX_MODEL).is_file() and not (export_dir / MODEL_XML).is_file():
        raise InputError(f"{export_dir} has no {ONNX_MODEL}: run dstc export first")
    if not (export_dir / EXPORT_REPORT).is_file():
        raise InputError(f"{export_dir} has no {EXPORT_REPORT}: not a dstc export")
    typed = ExportReport.read(export_dir / EXPORT_REPORT)
    report = typed.dump()
    source = Path(source or typed.source.path)
    inputs = typed.graph.inputs
    failed = [backend for backend, result in typed.parity.items() if not result.passed]
    if failed:
        raise InputError(f"{export_dir} failed its parity check on {', '.join(failed)} (see its export.json); "
                         f"fix the export before compiling it")
    graph = export_dir / ONNX_MODEL
    if graph.is_file():
        check_onnx_graph(graph, typed.graph.deferred.file if typed.graph.deferred else None)
    missing = [n for n in REQUIRED_INPUTS if n not in inputs]
    if missing or not any(n.startswith(PAST_PREFIX) for n in inputs):
        raise InputError(f"{export_dir / ONNX_MODEL} is not a decoder with a KV cache (inputs {inputs})")
    if not (source / CONFIG).is_file():
        raise InputError(f"the export's source checkpoint {source} is gone (no config.json); the compiled artifact "
                         f"needs its config and tokenizer files")
    return report, source


def check_weights_written(report: dict, export_dir: Path, remedy: str) -> None:
    """An InputError, ending in ``remedy``, for an export whose weights file was not written (export.json
    ``graph.deferred``: only a streamed compression reads such an export, recomputing its weights from the
    checkpoint). A later stage's directory carries the export's export.json, and its own weights file."""
    deferred = report.get("graph", {}).get("deferred")
    if deferred and not (export_dir / deferred["file"]).exists():
        raise InputError(f"{export_dir}: its weights file was not written (a build's export for a streamed "
                         f"compression, which reads them from the checkpoint); {remedy}")


def carry_mtp(in_dir: Path, out_dir: Path) -> list[str]:
    """The export's MTP graph (mtp/, toolchain/export/mtp.py) copied on as it is, fp32: the passes and compression
    rewrite the main graph only. The files copied (none without one)."""
    source = Path(in_dir) / MTP_DIR
    if not source.is_dir():
        return []
    shutil.copytree(source, Path(out_dir) / MTP_DIR)
    return sorted(f"{MTP_DIR}/{p.name}" for p in source.iterdir())
