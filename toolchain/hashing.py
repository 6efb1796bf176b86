"""Hashes of files and of JSON documents: the manifest's file hashes (sha256), the stage cache's (BLAKE3), and the
digests that stage ids, manifests and reports carry of themselves."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def blake3_file(path: Path) -> str:
    """BLAKE3 of a file on every core (the stage cache's hash: toolchain/stages/runner.py), read 16 MB at a time
    into one buffer: memory-mapping it (blake3's update_mmap, 2x faster) puts the whole file in the process's
    resident set while it is hashed, 14.5 GiB for an R1-Distill-Qwen-7B export."""
    import blake3

    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            hasher.update(view[:n])
    return hasher.hexdigest()


def file_hashes(root: Path, exclude: tuple[str, ...] = (),
                hash_file: Callable[[Path], str] = sha256_file) -> dict[str, str]:
    """The hash of every file below root (sha256 unless ``hash_file`` says otherwise), by relative POSIX path."""
    return {p.relative_to(root).as_posix(): hash_file(p)
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).as_posix() not in exclude}


def digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def self_digest(document: dict) -> str:
    """sha256 of a JSON document without its own ``digest`` field."""
    return digest({k: v for k, v in document.items() if k != "digest"})
