"""Every cache dstc keeps (DSTC_CACHE_DIR: the stage cache, the reference cache, the reference's lm-eval scores,
the checkpoints' file hashes) checks an entry before it is used: a byte flipped, a file truncated, emptied or
replaced by garbage, an entry's files swapped with another key's (their recorded key as it was, or rewritten to
this one) is not taken; the entry is computed again, the stage cache saying so in one line. The intact entry is
reused (the control that each check can fail)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from toolchain.build_plan import BuildPlan
from toolchain.hashing import digest
from toolchain.recipe import CompileSection
from toolchain.reference import cache as reference_cache
from toolchain.reference.record import ReferenceRecord
from toolchain.source_hashes import checkpoint_hashes
from toolchain.stages.runner import Stage, cache_damage, run_cached

FILE_DAMAGE = ["flip", "truncate", "empty", "garbage"]
ENTRY_DAMAGE = ["swap", "rekey"]


@dataclass
class Entries:
    """Two entries of one cache, A (the one damaged and read back) and B (another key's)."""

    files_a: dict[str, Path]  # role -> file
    files_b: dict[str, Path]
    key_a: str  # the key as its record file spells it
    key_b: str
    record: str  # the role of the file that records the key
    needles: dict[str, list[str]]  # role -> where in a JSON file the value to flip a digit of starts
    reread: object  # () -> None; asserts the value read back is A's own (recomputed or reused)
    notes: list[str] = field(default_factory=list)


def flip(path: Path, needles: list[str]) -> None:
    """A JSON file: the first digit after the needles, changed into another digit (still valid JSON, a different
    value); a binary file: its middle byte inverted."""
    data = bytearray(path.read_bytes())
    if needles:
        at = 0
        for needle in needles:
            at = data.index(needle.encode(), at) + len(needle)
        while not chr(data[at]).isdigit():
            at += 1
        data[at] ^= 1  # '0' <-> '1', ..., '8' <-> '9'
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def damage(entries: Entries, role: str, kind: str) -> None:
    path = entries.files_a.get(role)
    if kind == "flip":
        flip(path, entries.needles.get(role, []))
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(random.Random(0).randbytes(max(path.stat().st_size, 64)))
    else:  # every file of A replaced by B's; "rekey": B's record rewritten to name A's key
        for name, source in entries.files_b.items():
            shutil.copyfile(source, entries.files_a[name])
        if kind == "rekey":
            record = entries.files_a[entries.record]
            record.write_text(record.read_text().replace(entries.key_b, entries.key_a))


# -- the caches --------------------------------------------------------------------------------------------------


def stage_entries(cache: Path) -> Entries:
    """Two finished stages of a stage of the test's own (a file per configuration), run through the runner."""
    runs: list[int] = []

    def payload(n: int) -> bytes:
        return bytes(range(256)) * 16 + n.to_bytes(4, "little")

    def stage(n: int) -> Stage:
        def run(_input, out: Path, _section, _context) -> dict:
            out.mkdir(parents=True, exist_ok=True)
            (out / "data.bin").write_bytes(payload(n))
            runs.append(n)
            return {}

        return Stage("fake", {"n": n}, run, CompileSection(backend="onnxruntime"), BuildPlan(), "toolchain.cache")

    parent = digest("checkpoint")
    (a, id_a, _), (b, id_b, _) = (run_cached(stage(n), None, parent, use_cache=True, log=print) for n in (1, 2))
    notes: list[str] = []

    def reread() -> None:
        before = len(runs)
        target, stage_id, cached = run_cached(stage(1), None, parent, use_cache=True, log=notes.append)
        assert (target, stage_id) == (a, id_a)
        assert (target / "data.bin").read_bytes() == payload(1) and cache_damage(target, stage_id) is None
        assert cached == (len(runs) == before)

    return Entries({"data": a / "data.bin", "record": a / "stage.json"},
                   {"data": b / "data.bin", "record": b / "stage.json"}, id_a, id_b, "record",
                   {"record": ['"files": {']}, reread, notes)


def records(seed: int) -> ReferenceRecord:
    rng = np.random.default_rng(seed)
    return ReferenceRecord(vocab=8, top_k=8, top_ids=[rng.permutation(8)[None].astype(np.int32).repeat(3, 0)],
                           top_logp=[rng.normal(size=(3, 8)).astype(np.float32)],
                           target_logp=[rng.normal(size=2)], routes={1: [np.sort(rng.integers(0, 8, (4, 2)), -1)]},
                           greedy=[[1, 2, 3]], answers=[[4, 5]], seconds=1.5)


def same_record(a: ReferenceRecord, b: ReferenceRecord) -> bool:
    arrays = ("top_ids", "top_logp", "target_logp")
    return (a.vocab, a.top_k, a.greedy, a.answers, a.seconds) == (b.vocab, b.top_k, b.greedy, b.answers, b.seconds) \
        and all(np.array_equal(x, y) for name in arrays for x, y in zip(getattr(a, name), getattr(b, name))) \
        and a.routes.keys() == b.routes.keys() \
        and all(np.array_equal(x, y) for layer in a.routes for x, y in zip(a.routes[layer], b.routes[layer]))


def reference_entries(cache: Path) -> Entries:
    key_a, key_b = digest("reference a"), digest("reference b")
    reference_cache.store(key_a, records(1), {"model": "m", "data": {"texts": 3}})
    reference_cache.store(key_b, records(2), {"model": "m", "data": {"texts": 3}})
    root = reference_cache.cache_root()
    notes: list[str] = []

    def reread() -> None:
        record, why = reference_cache.load_cached(key_a)
        if record is not None:
            assert why is None and same_record(record, records(1))
        else:
            assert why not in (None, "absent")
            notes.append(why)

    return Entries({"data": root / f"{key_a}.npz", "record": root / f"{key_a}.json"},
                   {"data": root / f"{key_b}.npz", "record": root / f"{key_b}.json"}, key_a, key_b, "record",
                   {"record": ['"blake3": "']}, reread, notes)


SCORES = {"arc_easy": {"metrics": {"acc,none": 0.6, "acc_norm,none": 0.25}, "stderr": {"acc,none": 0.24}}}


def task_entries(cache: Path) -> Entries:
    key_a, key_b = digest("tasks a"), digest("tasks b")
    reference_cache.store_tasks(key_a, SCORES)
    reference_cache.store_tasks(key_b, {"arc_easy": {"metrics": {"acc,none": 0.2}, "stderr": {}}})
    root = reference_cache.cache_root()
    notes: list[str] = []

    def reread() -> None:
        scores, why = reference_cache.load_tasks(key_a)
        if scores is not None:
            assert why is None and scores == SCORES
        else:
            assert why not in (None, "absent")
            notes.append(why)

    return Entries({"record": root / f"tasks-{key_a}.json"}, {"record": root / f"tasks-{key_b}.json"}, key_a, key_b,
                   "record", {"record": ['"acc,none": ']}, reread, notes)


def source_entries(cache: Path) -> Entries:
    """The checkpoints' file hashes: one JSON file of entries by path; A's and B's are two files' entries in it."""
    checkpoint = cache.parent / "checkpoint"
    checkpoint.mkdir()
    for name, text in (("a.safetensors", "weights a"), ("b.safetensors", "weights b")):
        (checkpoint / name).write_text(text)
        settled = time.time() - 60  # remembered only when not written within the last SETTLED_S
        os.utime(checkpoint / name, (settled, settled))
    truth = {n: hashlib.sha256((checkpoint / n).read_bytes()).hexdigest() for n in ("a.safetensors",
                                                                                   "b.safetensors")}
    assert checkpoint_hashes(checkpoint) == truth
    store = cache / "source-hashes.json"
    path_a, path_b = (str((checkpoint / n).resolve()) for n in truth)
    assert set(json.loads(store.read_text())) == {path_a, path_b}

    def reread() -> None:
        assert checkpoint_hashes(checkpoint) == truth

    return Entries({"record": store}, {}, path_a, path_b, "record", {"record": [json.dumps(path_a), '"sha256": "']},
                   reread)


def damage_index(entries: Entries, kind: str) -> None:
    """The index's swaps are of entries within its one file: A's entry replaced by B's, its stat kept as A's
    ("rekey": as if the entry had been moved under A's path and stat)."""
    store = entries.files_a["record"]
    index = json.loads(store.read_text())
    stat = index[entries.key_a]["stat"]
    index[entries.key_a] = dict(index[entries.key_b])
    if kind == "rekey":
        index[entries.key_a]["stat"] = stat
    store.write_text(json.dumps(index))


CACHES = {"stage": (stage_entries, ["data", "record"]), "reference": (reference_entries, ["data", "record"]),
          "tasks": (task_entries, ["record"]), "source-hashes": (source_entries, ["record"])}
CASES = [*(pytest.param(cache, role, kind, id=f"{cache}-{role}-{kind}")
           for cache, (_, roles) in CACHES.items() for role in roles for kind in FILE_DAMAGE),
         *(pytest.param(cache, None, kind, id=f"{cache}-{kind}")
           for cache in CACHES for kind in (*ENTRY_DAMAGE, "intact"))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cache_name, role, kind", CASES)
def test_a_damaged_cache_entry_is_computed_again(cache_name, role, kind, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSTC_CACHE_DIR", str(cache))
    entries = CACHES[cache_name][0](cache)
    if kind in ENTRY_DAMAGE and cache_name == "source-hashes":
        damage_index(entries, kind)
    elif kind != "intact":
        damage(entries, role, kind)
    entries.reread()
    if cache_name in ("stage", "reference", "tasks"):
        # what is noted: nothing for the intact entry, one line saying what is damaged for any other
        assert len(entries.notes) == (0 if kind == "intact" else 1), entries.notes
        assert all("\n" not in note and "absent" not in note for note in entries.notes)
