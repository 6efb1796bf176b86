"""The reference cache: a ReferenceRecord stored under a key of everything it depends on, beside the stage cache.

The key hashes the source checkpoint's file hashes, the data's tokens (EvalData.digest), the settings that change
the reference's side (not latency, threads or the artifact's runtime: settings.ARTIFACT_ONLY) and the code that
computes the record, so an entry is reused exactly when the reference would compute the same thing. An entry is
``<key>.npz`` and ``<key>.json`` (written last: the npz's BLAKE3 and what the entry was made from); an entry whose
npz does not hash to what its json recorded is computed again, as the stage cache treats a damaged stage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from toolchain.cache import cache_dir
from toolchain.evaluate.dataset import EvalData
from toolchain.evaluate.reference_record import ReferenceRecord
from toolchain.hashing import blake3_file, digest
from toolchain.manifest import code_digest
from toolchain.settings.evaluation import ARTIFACT_ONLY, TASK_SETTINGS, EvalSettings

SCHEMA = "dstc.reference/1"


def cache_root() -> Path:
    return cache_dir() / "references"


def reference_key(source_files: dict[str, str], data: EvalData, settings: EvalSettings) -> str:
    return digest({"schema": SCHEMA, "source": source_files, "data": data.digest,
                   "settings": settings.model_dump(mode="json", exclude={*ARTIFACT_ONLY, *TASK_SETTINGS, "dataset"}),
                   "code": code_digest("toolchain.evaluate.reference_record")})


def task_key(source_files: dict[str, str], task_files: dict[str, str], settings: EvalSettings) -> str:
    """The key of the reference's lm-eval scores: the checkpoint, the task data's file hashes, the tasks' settings
    and the harness's code."""
    return digest({"schema": SCHEMA, "source": source_files, "task_files": task_files,
                   "settings": {k: getattr(settings, k) for k in ("tasks", "task_limit", "num_fewshot")},
                   "code": code_digest("toolchain.evaluate.harness")})


def load_tasks(key: str) -> dict | None:
    path = cache_root() / f"tasks-{key}.json"
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry.get("scores") if isinstance(entry, dict) and entry.get("key") == key else None


def store_tasks(key: str, scores: dict) -> None:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tasks-{key}.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"schema": SCHEMA, "key": key, "scores": scores}, indent=2) + "\n")
    os.replace(tmp, root / f"tasks-{key}.json")


def load_cached(key: str) -> tuple[ReferenceRecord | None, str | None]:
    """The entry under ``key``, or None and why not ("absent", or what is damaged)."""
    meta, data = cache_root() / f"{key}.json", cache_root() / f"{key}.npz"
    if not meta.is_file():
        return None, "absent"
    try:
        recorded = json.loads(meta.read_text())
        if recorded.get("schema") != SCHEMA or recorded.get("key") != key:
            return None, "written by another version"
        if not data.is_file() or blake3_file(data) != recorded.get("blake3"):
            return None, f"{data.name} does not match its record"
        return ReferenceRecord.load(data), None
    except (OSError, ValueError, KeyError) as e:
        return None, f"unreadable ({type(e).__name__})"


def store(key: str, record: ReferenceRecord, about: dict) -> Path:
    """Write the entry (npz to a temporary name, renamed; then its json): a reader never takes half of one."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    data, meta = root / f"{key}.npz", root / f"{key}.json"
    tmp = root / f".{key}.npz.tmp-{os.getpid()}"
    try:
        record.save(tmp)
        os.replace(tmp, data)
    finally:
        tmp.unlink(missing_ok=True)
    text = json.dumps({"schema": SCHEMA, "key": key, "blake3": blake3_file(data),
                       "seconds": record.seconds, **about}, indent=2) + "\n"
    tmp_meta = root / f".{key}.json.tmp-{os.getpid()}"
    tmp_meta.write_text(text)
    os.replace(tmp_meta, meta)
    return data
