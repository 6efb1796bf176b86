"""The way in to the fp32 reference: ``open_reference`` (the checkpoint's reference, whole or layer by layer,
refused in one line where it does not fit) and ``reference_record`` (its outputs on evaluation data, from the
reference cache or computed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from toolchain.memory_guard import RETRY, require_memory, size
from toolchain.reference.choice import resolve_reference
from toolchain.reference.data import EvalData
from toolchain.settings.evaluation import EvalSettings
from toolchain.source_hashes import checkpoint_hashes

if TYPE_CHECKING:
    from toolchain.reference.layered import LayeredReference
    from toolchain.reference.record import ReferenceRecord
    from toolchain.reference.whole import TorchDecoder
    from toolchain.source import Source


def require_layered_reference_memory(source: Source, data: EvalData | None = None) -> None:
    """Before the layer-by-layer reference runs: what it holds at most (toolchain/reference/layered.py
    memory_need, the data's hidden states up to a group) against the memory available, refused in one line."""
    # torch loads only where the reference runs: a cached reference's outputs need none
    from toolchain.export.reference import reference_config
    from toolchain.reference.layered import memory_need
    from toolchain.reference.record import GROUP_BYTES

    tokens = max((len(s.ids) for s in data.sequences), default=0) if data is not None else 0
    hidden = min(GROUP_BYTES, tokens * 4 * int(reference_config(source.path).hidden_size))
    need = memory_need(source.path, hidden)
    require_memory(need, f"the fp32 reference of {source.spec}, one layer at a time ({size(need)} with its "
                         "embedding table, head and hidden states)",
                   f"free memory, evaluate on a machine with more, {RETRY}")


def open_reference(source: Source, threads: int | None, choice: dict,
                   data: EvalData | None = None) -> LayeredReference | TorchDecoder:
    """The layer-by-layer reference, or for an architecture whose layers it does not run (DeepSeek-V4's own
    skeleton) the whole model in fp32 (toolchain/reference/whole.py; refused in one line where it does not fit);
    first, what the layer-by-layer reference would hold on ``data`` is checked against the memory available."""
    # torch loads only where the reference runs
    from toolchain.export.reference import shared_decoder_layers
    from toolchain.reference.layered import LayeredReference
    from toolchain.reference.whole import TorchDecoder

    require_layered_reference_memory(source, data)
    if shared_decoder_layers(source.config["model_type"]):
        return LayeredReference(source, threads, choice)
    return TorchDecoder(source, threads, choice)


def reference_record(artifact, data: EvalData, settings: EvalSettings, *, reference: str | None = None,
                     records: dict | None = None, eos_ids: list[int], pad_id: int, newline_id: int | None,
                     log: Callable[[str], None] = lambda _: None) -> tuple[ReferenceRecord, dict]:
    """The reference's record on ``data``: from ``records`` (what `dstc compare` computed for an earlier artifact),
    from the reference cache, or computed by the layer-by-layer reference (released before it returns, so that it
    and the artifact are never in memory together). Returns it and what the report records of the reference."""
    # torch loads only where the reference runs: a cached reference's outputs need none
    from toolchain.export.reference import shared_decoder_layers
    from toolchain.reference import cache as reference_cache

    source, choice = resolve_reference(artifact.manifest, reference)
    key = reference_cache.reference_key(checkpoint_hashes(source.path), data, settings)
    how = "layer by layer" if shared_decoder_layers(source.config["model_type"]) else "whole model"
    about = {"model": source.spec, "path": str(source.path), "runtime": f"pytorch eager fp32, {how}", **choice}
    record: ReferenceRecord | None = (records or {}).get(key)
    why: str | None = "absent"
    reused = record is not None
    if record is None and settings.reference_cache:
        record, why = reference_cache.load_cached(key)
        reused = record is not None
        if why not in (None, "absent"):
            log(f"the reference cache entry {key[:16]} is not usable ({why}); computing the reference again")
    if record is None:
        record = _computed(source, choice, data, settings, eos_ids=eos_ids, pad_id=pad_id, newline_id=newline_id,
                           log=log)
        if settings.reference_cache:
            reference_cache.store(key, record, {"model": source.spec, "data": data.description})
    else:
        log(f"reference: {source.spec}, outputs reused from the reference cache ({key[:16]})")
    if records is not None:
        records[key] = record
    about["cache"] = {"key": key, "reused": reused, "enabled": settings.reference_cache,
                      "compute_seconds": round(record.seconds, 3)}
    return record, about


def _computed(source: Source, choice: dict, data: EvalData, settings: EvalSettings, *, eos_ids: list[int],
              pad_id: int, newline_id: int | None, log: Callable[[str], None]) -> ReferenceRecord:
    # torch loads only where the reference runs
    from toolchain.reference.record import compute_record

    ref = open_reference(source, settings.threads, choice, data)
    try:
        log(f"reference: {source.spec} (PyTorch fp32, eager, "
            f"{'layers kept built' if ref.resident else 'one layer at a time'}) from {source.path}")
        return compute_record(ref, data, settings, eos_ids=eos_ids, pad_id=pad_id, newline_id=newline_id, log=log)
    finally:
        ref.close()
        del ref
