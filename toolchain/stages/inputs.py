"""What a stage reads from the directory an earlier stage wrote: its export.json and the source checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from toolchain.compile.openvino_ir import MODEL_XML
from toolchain.errors import InputError
from toolchain.stages.reports import ExportReport

REQUIRED_INPUTS = ("input_ids", "attention_mask", "position_ids")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object")
    return data


def read_export(export_dir: Path, source: Path | None = None) -> tuple[dict, Path]:
    """The export's report and its source checkpoint directory, checked before anything is written.

    ``source`` replaces the directory export.json recorded: a build resolves the checkpoint itself, and a stage
    taken from the cache may have been exported from a checkout or cache that no longer exists."""
    if not export_dir.is_dir():
        raise InputError(f"{export_dir} is not a directory (expected the output of dstc export)")
    if not (export_dir / "model.onnx").is_file() and not (export_dir / MODEL_XML).is_file():
        raise InputError(f"{export_dir} has no model.onnx: run dstc export first")
    if not (export_dir / "export.json").is_file():
        raise InputError(f"{export_dir} has no export.json: not a dstc export")
    typed = ExportReport.read(export_dir / "export.json")
    report = typed.dump()
    source = Path(source or typed.source.path)
    inputs = typed.graph.inputs
    failed = [backend for backend, result in typed.parity.items() if not result.passed]
    if failed:
        raise InputError(f"{export_dir} failed its parity check on {', '.join(failed)} (see its export.json); "
                         f"fix the export before compiling it")
    graph = export_dir / "model.onnx"
    if graph.is_file():
        check_onnx_graph(graph)
    missing = [n for n in REQUIRED_INPUTS if n not in inputs]
    if missing or not any(n.startswith("past_key_values.") for n in inputs):
        raise InputError(f"{export_dir / 'model.onnx'} is not a decoder with a KV cache (inputs {inputs})")
    if not (source / "config.json").is_file():
        raise InputError(f"the export's source checkpoint {source} is gone (no config.json); the compiled artifact "
                         f"needs its config and tokenizer files")
    return report, source


def check_onnx_graph(path: Path) -> None:
    """InputError unless ``path`` parses as an ONNX model whose external weights are all present: a truncated
    or foreign file fails here, in one line, instead of deep inside a runtime or NNCF."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path} is not a readable ONNX model: {reason}") from None
    if not model.graph.node:
        raise InputError(f"{path} is not a readable ONNX model: its graph is empty")
    ends: dict[str, int] = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        name = info.get("location", "")
        end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        ends[name] = max(ends.get(name, 0), end)
    for name, end in ends.items():
        data = path.parent / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise InputError(f"{path} refers to weights outside its directory ({name})")
        if not data.is_file():
            raise InputError(f"{path} needs its weights file {data}, which is missing")
        if data.stat().st_size < end:
            raise InputError(f"{data} is truncated: {data.stat().st_size} bytes, the graph reads up to byte {end}")
