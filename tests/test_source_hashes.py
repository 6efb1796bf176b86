"""The source checkpoint's sha256, remembered across builds by each file's stat (toolchain/source_hashes.py)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from toolchain import manifest, source_hashes


@pytest.fixture
def counted(monkeypatch, tmp_path):
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []
    real = manifest.sha256_file
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
