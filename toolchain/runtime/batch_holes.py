"""Speculative decoding in a running batch: every row fed several tokens in one forward (``verify``), each keeping
a prefix of them (``keep``), what it does not keep left in the KV cache as a hole.

A hole is a cache column whose attention_mask is 0: positions come from the mask's cumsum, so a row's next token
has its right position, and dstc's graphs ignore the column (toolchain/export/blocks.py attention_mask: causal over
columns, padding from the mask, which DeepSeek-V3.2's indexer adds to its scores before its top-k). Holes cost
attention work and memory until a compaction (each row's held columns, right-aligned) cuts them; the batch compacts
when they fill half of what its rows hold, and on the rebuilds that joins make anyway. DeepSeek-V4's per-token
cache pools its compressed windows over a row's columns after its left padding, which a hole would shift: a batch
of it compacts after every step that leaves one (``compact_each_step``, :func:`holds_holes`), which leaves each
row as left-padded as a row that joined with its accepted tokens.

:class:`Holes` is the bookkeeping both batched runners share (ONNX Runtime's PersistentBatch, OpenVINO's
StatefulBatch); each compacts its own cache (``_compact``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from toolchain.errors import InputError
from toolchain.interface.graph import KV_CACHE, LATENT, PER_HEAD


def compacted(mask: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the mask of each row's held columns right-aligned, each row's held column indices)."""
    held = mask.astype(bool)
    columns = [np.flatnonzero(row) for row in held]
    width = max((len(taken) for taken in columns), default=0)
    out = np.zeros((len(mask), width), mask.dtype)
    for row, taken in enumerate(columns):
        out[row, width - len(taken):] = 1
    return out, columns


def compact_cache(cache: np.ndarray, columns: list[np.ndarray], width: int) -> np.ndarray:
    """A cache tensor [rows, heads, positions, dim] with each row's ``columns`` right-aligned in ``width``."""
    out = np.zeros((len(columns), cache.shape[1], width, cache.shape[3]), cache.dtype)
    for row, taken in enumerate(columns):
        out[row, :, width - len(taken):] = cache[row][:, taken]
    return out


def holds_holes(metadata: Mapping[str, str]) -> bool:
    """Whether the cache of a graph (its metadata) can keep holes between steps: per-head and latent caches, whose
    attention reads the mask; not DeepSeek-V4's per-token one (module doc)."""
    return metadata.get(KV_CACHE) in (None, PER_HEAD, LATENT)


class Holes:
    """The verify/keep bookkeeping of a batch whose rows (``_rows``, None a row that left) and ``_mask`` [rows,
    columns] follow its cache."""

    _rows: list[Hashable | None]
    _mask: np.ndarray
    extras: dict[str, np.ndarray]
    pad_id: int
    _fed = 0  # columns of the last verify, until keep
    _spans: dict[Hashable, tuple[int, int, int]]  # each sequence's (row, columns) in ``extras``
    compact_each_step = False  # a cache that cannot keep holes (holds_holes): cut them after every keep / forget
    # the cache tensors that hold no entry per position (the compressed V4 cache's), which holes would break
    _lengths: Mapping[str, tuple[str, int]] = {}

    def holes(self) -> int:
        """Masked-out columns after each live row's first held one."""
        live = self._mask[[row for row, key in enumerate(self._rows) if key is not None]]
        if not live.size:
            return 0
        first = np.where(live.any(axis=1), live.argmax(axis=1), live.shape[1])
        return int((live.shape[1] - first).sum() - live.sum())

    def _verify_feeds(self, fed: dict[Hashable, list[int]], inputs: dict[str, dict[Hashable, np.ndarray]] | None
                      ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """(ids [rows, the most fed], the mask of those columns, further inputs [rows, the most fed, ...]): each
        row's tokens from the left, padded with holes on the right (a row that left: one pad token)."""
        if not all(fed.values()):
            raise ValueError("a verify step feeds every running sequence at least one token")
        if self._lengths:
            raise InputError("speculative decoding's verify steps leave holes in a running batch's cache, and "
                             "DeepSeek-V4's compressed cache cannot hold them: build with export.v4_cache: per-token")
        width = max(len(tokens) for tokens in fed.values())
        ids = np.full((len(self._rows), width), self.pad_id, np.int64)
        new = np.zeros((len(self._rows), width), np.int64)
        extra = {}
        for name, value in (inputs or {}).items():
            sample = next(iter(value.values()))
            extra[name] = np.zeros((len(self._rows), width, *sample.shape[1:]), sample.dtype)
        for row, key in enumerate(self._rows):
            tokens = [self.pad_id] if key is None else fed[key]
            ids[row, :len(tokens)] = tokens
            # DeepSeek-V4 finds a row's slots from its count of held columns, as if every other one were left
            # padding: there its padding on the right is held for this forward (causal, so its tokens do not see
            # it) and turns into holes at keep
            new[row, :width if self.compact_each_step else len(tokens)] = 1
            if key is not None:
                for name, value in (inputs or {}).items():
                    extra[name][row, :len(tokens)] = value[key]
        self._fed = width
        self._spans = {key: (row, 0, len(fed[key])) for row, key in enumerate(self._rows) if key is not None}
        return ids, new, extra

    def keep(self, kept: dict[Hashable, int]) -> None:
        """After ``verify``: each sequence keeps the cache of its first ``kept`` tokens fed, the rest turn into
        holes (a row that left keeps what it had)."""
        span = self._mask[:, self._mask.shape[1] - self._fed:]
        for row, key in enumerate(self._rows):
            if key is not None:
                span[row, kept[key]:] = 0
        self._fed = 0
        self._compact_if_sparse()

    def forget(self, columns: int | dict[Hashable, int]) -> None:
        """The last ``columns`` positions of every row (or of each sequence its own count) become holes: the chained
        drafts of an MTP layer, which the next verify step replaces by what the main model accepted, or those a
        draft model drafted past what was accepted."""
        width = self._mask.shape[1]
        if isinstance(columns, int):
            self._mask[:, width - columns:] = 0
        else:
            for row, key in enumerate(self._rows):
                if key is not None and columns.get(key, 0):
                    self._mask[row, width - columns[key]:] = 0
        self._compact_if_sparse()

    def row_extras(self, name: str) -> dict[Hashable, np.ndarray]:
        """An extra output of the last join (each joining sequence's prompt positions) or verify (each sequence's
        fed tokens), per sequence."""
        value = self.extras[name]
        return {key: value[row, start:stop] for key, (row, start, stop) in self._spans.items()}

    def _compact_if_sparse(self) -> None:
        held = int(self._mask[[row for row, key in enumerate(self._rows) if key is not None]].sum())
        holes = self.holes()
        if held and (holes >= held or (self.compact_each_step and holes)):
            self._compact()

    def _compact(self) -> None:
        raise NotImplementedError
