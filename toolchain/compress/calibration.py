"""Calibration inputs: text from the project's corpus or from the user's files (never a download), tokenized
with the source checkpoint's tokenizer, turned into graph feeds (prefill with an empty KV cache)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from toolchain.errors import InputError
from toolchain.interface.graph import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
from toolchain.models.corpus import calibration_texts
from toolchain.tokenizer_loading import load_tokenizer

EMBEDDED = "embedded"
# per sequence: enough context for every layer's statistics, small enough for 2 CPU cores
MAX_TOKENS = 64


def load_texts(dataset: str | Path, n: int) -> list[str]:
    """``n`` texts: "embedded" is the project's corpus; a path is a JSONL file (a "text" field per line), a plain
    text file (one text per non-empty line) or a directory of such files (sorted by name)."""
    if str(dataset) == EMBEDDED:
        return calibration_texts(n)
    path = Path(dataset)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    if not path.exists():
        raise InputError(f"calibration dataset {path} does not exist (give a JSONL or text file, or 'embedded')")
    texts: list[str] = []
    for file in files:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read calibration file {file}: {e}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if file.suffix in (".jsonl", ".json"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{file}:{number}: not JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise InputError(f"{file}:{number}: a JSONL calibration line needs a string \"text\" field")
                texts.append(record["text"])
            else:
                texts.append(line)
            if len(texts) >= n:
                return texts
    if not texts:
        raise InputError(f"calibration dataset {path} holds no text")
    return texts


def token_sequences(texts: list[str], checkpoint: Path | None, vocab_size: int,
                    seed: int = 0) -> tuple[list[list[int]], str]:
    """Token ids of each text (at most MAX_TOKENS) and how they were made.

    With no tokenizer beside the checkpoint (the random test checkpoints), seeded random ids of the texts'
    lengths stand in: the statistics then describe random tokens, and compression.json says so.
    """
    if checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        tok = load_tokenizer(checkpoint)
        ids = [[t for t in tok(text)["input_ids"] if t < vocab_size][:MAX_TOKENS] for text in texts]
        return [s for s in ids if len(s) >= 2], "checkpoint tokenizer"
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, max(2, min(MAX_TOKENS, len(t.split()) * 2))).tolist() for t in texts], \
        "seeded random ids (the checkpoint has no tokenizer)"


def feeds(ids: list[int], past_specs: dict[str, tuple[int, int]], cache_dtype: str = "float32") \
        -> dict[str, np.ndarray]:
    """Prefill feeds for one sequence (batch 1, empty cache). past_specs: the graph's cache spec
    (toolchain/interface/graph.py cache_spec); cache_dtype: its element type (NNCF feeds them to the graph as
    they are)."""
    n = len(ids)
    out = {INPUT_IDS: np.asarray([ids], np.int64), ATTENTION_MASK: np.ones((1, n), np.int64),
           POSITION_IDS: np.arange(n, dtype=np.int64)[None]}
    for name, (heads, dim) in past_specs.items():
        out[name] = np.zeros((1, heads, 0, dim), cache_dtype)
    return out

