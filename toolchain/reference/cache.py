"""The reference cache: a ReferenceRecord stored under a key of everything it depends on, beside the stage cache.

The key hashes the source checkpoint's file hashes, the data's tokens (EvalData.digest), the settings that change
the reference's side (not latency, threads or the artifact's runtime: settings.ARTIFACT_ONLY) and the code that
computes the record, so an entry is reused exactly when the reference would compute the same thing. An entry is
``<key>.npz`` and ``<key>.json`` (written last: the key, the npz's BLAKE3 and what the entry was made from, under a
digest of all of it); the lm-eval scores' entry is ``tasks-<key>.json``, the key and the scores under their digest.
The key inside what is digested binds an entry's files to it: an entry edited, damaged, or moved under another key
(its recorded key rewritten or not) no longer matches, and is computed again, as the stage cache treats a damaged
stage.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

from toolchain.cache import cache_dir
from toolchain.hashing import blake3_file, digest, self_digest
from toolchain.manifest import code_digest
from toolchain.reference.data import EvalData
from toolchain.reference.record import ReferenceRecord
from toolchain.settings.evaluation import ARTIFACT_ONLY, TASK_SETTINGS, EvalSettings

SCHEMA = "dstc.reference/2"  # /2: each entry under a digest of its key and contents


def cache_root() -> Path:
    return cache_dir() / "references"


def reference_key(source_files: dict[str, str], data: EvalData, settings: EvalSettings) -> str:
    return digest({"schema": SCHEMA, "source": source_files, "data": data.digest,
                   "settings": settings.model_dump(mode="json", exclude={*ARTIFACT_ONLY, *TASK_SETTINGS, "dataset"}),
                   "code": code_digest("toolchain.reference.record")})


def task_key(source_files: dict[str, str], task_files: dict[str, str], settings: EvalSettings) -> str:
    """The key of the reference's lm-eval scores: the checkpoint, the task data's file hashes, the tasks' settings
    and the harness's code."""
    return digest({"schema": SCHEMA, "source": source_files, "task_files": task_files,
                   "settings": {k: getattr(settings, k) for k in ("tasks", "task_limit", "num_fewshot")},
                   "code": code_digest("toolchain.evaluate.harness")})


def _recorded(path: Path, key: str) -> tuple[dict | None, str | None]:
    """The JSON document of an entry, if it is this key's and matches its digest; else None and why not."""
    if not path.is_file():
        return None, "absent"
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        return None, f"{path.name} unreadable ({type(e).__name__})"
    if not isinstance(recorded, dict) or recorded.get("schema") != SCHEMA:
        return None, f"{path.name} written by another version"
    if recorded.get("key") != key:
        return None, f"{path.name} holds another key's entry"
    if recorded.get("digest") != self_digest(recorded):
        return None, f"{path.name} does not match its digest"
    return recorded, None


def _write(path: Path, document: dict) -> None:
    """``document`` with its digest (of what a reader will parse), to a temporary name renamed into place."""
    document = json.loads(json.dumps(document))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({**document, "digest": self_digest(document)}, indent=2) + "\n")
    os.replace(tmp, path)


def load_tasks(key: str) -> tuple[dict | None, str | None]:
    """The lm-eval scores under ``key``, or None and why not ("absent", or what is damaged)."""
    recorded, why = _recorded(cache_root() / f"tasks-{key}.json", key)
    if recorded is None:
        return None, why
    scores = recorded.get("scores")
    return (scores, None) if isinstance(scores, dict) else (None, "no scores")


def store_tasks(key: str, scores: dict) -> None:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    _write(root / f"tasks-{key}.json", {"schema": SCHEMA, "key": key, "scores": scores})


def load_cached(key: str) -> tuple[ReferenceRecord | None, str | None]:
    """The entry under ``key``, or None and why not ("absent", or what is damaged)."""
    recorded, why = _recorded(cache_root() / f"{key}.json", key)
    if recorded is None:
        return None, why
    data = cache_root() / f"{key}.npz"
    try:
        if not data.is_file() or blake3_file(data) != recorded.get("blake3"):
            return None, f"{data.name} does not match its record"
        return ReferenceRecord.load(data), None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        return None, f"{data.name} unreadable ({type(e).__name__})"


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
    _write(meta, {**about, "schema": SCHEMA, "key": key, "blake3": blake3_file(data), "seconds": record.seconds})
    return data
