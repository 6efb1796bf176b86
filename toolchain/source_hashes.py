"""The sha256 of every file of a source checkpoint: the manifest's ``source.files`` and the export stage's parent.

Each file's hash is remembered across builds by its stat (device, inode, size, mtime and ctime in ns), as git's
index remembers file contents, in ``DSTC_CACHE_DIR/source-hashes.json``: at 1.5 GB/s a rebuild of DeepSeek-V3
(690 GB) would otherwise spend 8 minutes hashing a checkpoint that did not change. A file written since has a new
mtime and ctime, and is hashed again; a file modified less than ``SETTLED_S`` before it was hashed is not
remembered (a second write within the same timestamp tick would leave its stat unchanged: git's "racy clean").
Each entry carries the digest of its path, stat and hash: an entry edited, damaged or moved under another path does
not match, and its file is hashed again. `dstc build` starts hashing (``Hashing``) before it imports transformers
to check the config, which takes seconds the hash can use (sha256 releases the GIL).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from toolchain.cache import cache_dir
from toolchain.hashing import digest, file_hashes, sha256_file

SETTLED_S = 2.0


def _store() -> Path:
    return cache_dir() / "source-hashes.json"


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _digest(name: str, stat: str, sha: str) -> str:
    return digest({"path": name, "stat": stat, "sha256": sha})


def checkpoint_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root`` by relative POSIX path, each hashed unless its stat is remembered."""
    store = _store()
    try:
        known = json.loads(store.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}  # absent, or damaged by hand: hash again
    seen: dict[str, dict[str, str]] = {}

    def hashed(path: Path) -> str:
        st = path.stat()
        name, key = str(path.resolve()), _key(st)
        entry = known.get(name)
        if isinstance(entry, dict) and entry.get("stat") == key and isinstance(entry.get("sha256"), str) and \
                entry.get("digest") == _digest(name, key, entry["sha256"]):
            return entry["sha256"]
        started = time.time()
        sha = sha256_file(path)
        if st.st_mtime < started - SETTLED_S:
            seen[name] = {"stat": key, "sha256": sha, "digest": _digest(name, key, sha)}
        return sha

    hashes = file_hashes(root, hash_file=hashed)
    if seen:
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_name(f".{store.name}.{os.getpid()}.tmp")
            kept = {name: entry for name, entry in known.items() if os.path.exists(name)}  # not deleted ones
            tmp.write_text(json.dumps({**kept, **seen}, indent=0, sort_keys=True))
            tmp.replace(store)  # a concurrent build's entries may be lost: they are hashed again, no more
        except OSError:
            pass  # a read-only cache: the hashes are right, only not remembered
    return hashes


class Hashing:
    """``checkpoint_hashes(root)`` on a thread; ``result()`` waits for it. A daemon thread: a build that fails
    meanwhile exits at once instead of waiting for a large checkpoint's hash."""

    def __init__(self, root: Path):
        self._result: dict[str, str] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(root,), name="checkpoint-hashes", daemon=True)
        self._thread.start()

    def _run(self, root: Path) -> None:
        try:
            self._result = checkpoint_hashes(root)
        except BaseException as e:  # re-raised in the caller's thread by result()
            self._error = e

    def result(self) -> dict[str, str]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
