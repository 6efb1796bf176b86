"""The source checkpoint's sha256, remembered across builds by each file's stat (toolchain/source_hashes.py)."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

from toolchain import hashing, source_hashes


@pytest.fixture
def counted(monkeypatch, tmp_path):
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []
    real = hashing.sha256_file
    monkeypatch.setattr(source_hashes, "sha256_file", lambda p: calls.append(p.name) or real(p))
    return calls


def write(path, data: bytes, age_s: float) -> None:
    path.write_bytes(data)
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_a_rebuild_hashes_only_the_files_that_changed(counted, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    write(root / "config.json", b'{"model_type": "qwen2"}', 3600)
    write(root / "model.safetensors", b"a" * 4096, 3600)
    first = source_hashes.checkpoint_hashes(root)
    assert first == {"config.json": hashlib.sha256(b'{"model_type": "qwen2"}').hexdigest(),
                     "model.safetensors": hashlib.sha256(b"a" * 4096).hexdigest()}
    assert sorted(counted) == ["config.json", "model.safetensors"]
    counted.clear()
    assert source_hashes.checkpoint_hashes(root) == first and counted == []
    write(root / "model.safetensors", b"b" * 4096, 1800)  # same size, new contents
    second = source_hashes.checkpoint_hashes(root)
    assert counted == ["model.safetensors"]
    assert second["model.safetensors"] == hashlib.sha256(b"b" * 4096).hexdigest()
    assert second["config.json"] == first["config.json"]


def test_a_file_written_just_now_is_hashed_again_and_a_damaged_store_is_ignored(counted, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"fresh")  # a second write in the same timestamp tick could follow
    source_hashes.checkpoint_hashes(root)
    source_hashes.checkpoint_hashes(root)
    assert counted == ["model.safetensors"] * 2
    write(root / "model.safetensors", b"settled", 3600)
    (tmp_path / "cache").mkdir(exist_ok=True)
    (tmp_path / "cache" / "source-hashes.json").write_text("{not json")
    assert source_hashes.checkpoint_hashes(root) == {"model.safetensors": hashlib.sha256(b"settled").hexdigest()}


def test_hashing_beside_the_caller_returns_the_same_and_raises_in_the_caller(counted, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    root.mkdir()
    write(root / "w.bin", b"x" * 100, 3600)
    assert source_hashes.Hashing(root).result() == {"w.bin": hashlib.sha256(b"x" * 100).hexdigest()}
    write(root / "w.bin", b"y" * 100, 1800)

    def unreadable(path):
        raise PermissionError(f"{path}: denied")

    monkeypatch.setattr(source_hashes, "sha256_file", unreadable)
    with pytest.raises(PermissionError, match="denied"):
        source_hashes.Hashing(root).result()


def test_the_stage_cache_hash_holds_a_buffer_not_the_file(tmp_path):
    """BLAKE3 of a 256 MB file (as of a stage's GBs of output) is blake3's own digest, and the hashing process's
    peak RSS grows by far less than the file (memory-mapping it put the whole file in the resident set: 14.5 GiB
    for a 7B export)."""
    import subprocess
    import sys

    import blake3

    data = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    path = tmp_path / "model.onnx.data"
    data.tofile(path)
    expected = blake3.blake3(data.tobytes()).hexdigest()
    del data
    code = ("import sys; from pathlib import Path; from toolchain.hashing import blake3_file\n"
            "def hwm():\n"
            "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
            "before = hwm(); digest = blake3_file(Path(sys.argv[1])); print(digest, (hwm() - before) * 1024)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                         timeout=300).stdout.split()
    assert out[0] == expected
    assert int(out[1]) < 64 << 20, f"peak RSS grew by {int(out[1]) >> 20} MiB hashing a 256 MiB file"
