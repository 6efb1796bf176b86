"""Calibration inputs: text from the project's corpus or from the user's files (never a download), tokenized
with the source checkpoint's tokenizer, turned into graph feeds (prefill with an empty KV cache)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from toolchain.errors import InputError

EMBEDDED = "embedded"
MAX_TOKENS = 64
# per sequence: enough context for every layer's statistics, small enough for 2 CPU cores
FALLBACK_TEXTS = ["The old man walked to the market with a basket of apples.", "321+654=9750",
                  "Where is the red book? It was on the table in the kitchen.", "706+85=7941",
                  "The children followed him along the river to see the boats in the morning."]


def load_texts(dataset: str | Path, n: int) -> list[str]:
    """``n`` texts: "embedded" is the project's corpus; a path is a JSONL file (a "text" field per line), a plain
    text file (one text per non-empty line) or a directory of such files (sorted by name)."""
    if str(dataset) == EMBEDDED:
        try:
            from toolchain.models.corpus import calibration_texts
        except ImportError:  # the corpus module is not in this tree: a few fixed lines of the same two kinds
            return [FALLBACK_TEXTS[i % len(FALLBACK_TEXTS)] for i in range(n)]
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
        from toolchain.source import load_tokenizer

        tok = load_tokenizer(checkpoint)
        ids = [[t for t in tok(text)["input_ids"] if t < vocab_size][:MAX_TOKENS] for text in texts]
        return [s for s in ids if len(s) >= 2], "checkpoint tokenizer"
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, max(2, min(MAX_TOKENS, len(t.split()) * 2))).tolist() for t in texts], \
        "seeded random ids (the checkpoint has no tokenizer)"


def feeds(ids: list[int], past_specs: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Prefill feeds for one sequence (batch 1, empty cache). past_specs: input name -> (heads, head dim)."""
    n = len(ids)
    out = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
           "position_ids": np.arange(n, dtype=np.int64)[None]}
    for name, (heads, dim) in past_specs.items():
        out[name] = np.zeros((1, heads, 0, dim), np.float32)
    return out


def past_specs(model_inputs) -> dict[str, tuple[int, int]]:
    """From (name, shape) pairs of the graph's inputs: past_key_values.* -> (heads, head dim)."""
    return {name: (int(shape[1]), int(shape[3])) for name, shape in model_inputs if name.startswith("past_key_values.")}
