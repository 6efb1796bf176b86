"""Rolling back a cache that holds no entry per position by replay: DeepSeek-V4's compressed layout (a bounded
sliding window, pooled entries, the incomplete window's tail: toolchain/export/deepseek_v4_attention.py) cannot be
cut on its sequence axis, since the window has shifted out entries a shorter cache would still hold and a pooled
entry or the tail mixes positions that are kept with ones that are not.

A decoder of such a graph keeps a checkpoint instead: the cache as it was before its last forward of more than one
position (nothing: an empty cache, before a prefill) and every position fed since (their ids and further inputs).
``rollback(keep)`` restores the checkpoint and feeds its positions again up to ``keep`` in one forward, which gives
the cache those positions would have left: the compressed layout is exact whatever the prefill / decode split
(its parity tests feed prompts in chunks of any size). A speculative verify step (its fed token and drafts) is such
a forward, and a rollback after it replays the accepted positions: one forward of 1 + accepted positions per
rejection, instead of a cut. Decoding one position at a time takes no checkpoint (it only logs the ids), so plain
decoding costs nothing more; the checkpoint holds the arrays or OrtValues the runtime returned (no copy), or on
OpenVINO's stateful request a copy of its variables, which are bounded in this layout but for the pooled entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toolchain.runtime.prefill_chunks import ChunkedForward


@dataclass
class Checkpoint:
    held: int  # cache columns (attention mask's) when it was taken
    state: object | None  # the decoder's cache then (None: empty)
    ids: list[np.ndarray] = field(default_factory=list)  # each forward's input ids since
    inputs: list[dict[str, np.ndarray]] = field(default_factory=list)  # and its further inputs
    mask: np.ndarray | None = None  # the last forward's attention mask (each extends the one before)

    @property
    def fed(self) -> int:
        return sum(ids.shape[1] for ids in self.ids)


class ReplayRollback(ChunkedForward):
    """The checkpoint and replay of a decoder over ChunkedForward (module doc), for a graph whose cache is not
    positional (``replays``); a decoder supplies ``_state`` and ``_restore`` of its cache."""

    replays = False  # the graph's cache has length rules (cache_lengths): rolled back by replay
    _checkpoint: Checkpoint | None = None

    def _state(self) -> object:
        raise NotImplementedError

    def _restore(self, state: object | None) -> None:
        """The cache as ``state`` (None: empty)."""
        raise NotImplementedError

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0,
                inputs: dict[str, np.ndarray] | None = None) -> np.ndarray:
        if self.replays:
            held = attention_mask.shape[1] - input_ids.shape[1]
            if input_ids.shape[1] > 1 or self._checkpoint is None:
                self._checkpoint = Checkpoint(held, self._state() if held else None)
            checkpoint = self._checkpoint
            checkpoint.ids.append(np.array(input_ids))
            checkpoint.inputs.append({name: np.array(value) for name, value in (inputs or {}).items()})
            checkpoint.mask = np.array(attention_mask)
        return super().forward(input_ids, attention_mask, logits_to_keep, inputs)

    def _replay(self, keep: int) -> None:
        """The cache of its first ``keep`` columns, by replay from the checkpoint (ValueError if it was taken after
        them)."""
        checkpoint = self._checkpoint
        held = checkpoint.held + checkpoint.fed if checkpoint is not None else 0
        if checkpoint is None or not checkpoint.held <= keep <= held:
            first = checkpoint.held if checkpoint is not None else held
            raise ValueError(f"cannot keep {keep} positions of a cache that holds {held} and was checkpointed at "
                             f"{first} (a compressed cache is rolled back by replay from its last multi-position "
                             "forward)")
        if keep == held:
            return
        assert checkpoint.mask is not None
        extras = self.extras  # the rolled-back forward's, as a cut cache leaves them
        self._restore(checkpoint.state)
        replayed = keep - checkpoint.held
        self._checkpoint = Checkpoint(checkpoint.held, checkpoint.state)
        if replayed:
            ids = np.concatenate(checkpoint.ids, axis=1)[:, :replayed]
            names = checkpoint.inputs[0]
            inputs = {name: np.concatenate([part[name] for part in checkpoint.inputs], axis=1)[:, :replayed]
                      for name in names}
            self._checkpoint.ids, self._checkpoint.inputs = [ids], [inputs]
            self._checkpoint.mask = checkpoint.mask[:, :keep]
            super().forward(ids, checkpoint.mask[:, :keep], 1, inputs or None)
        self.extras = extras
