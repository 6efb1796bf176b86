"""Self-speculative drafts from DeepSeek's MTP layer (toolchain/export/mtp.py): the artifact's mtp/ graph run by
dstc's decoders with its own KV cache, fed the main graph's final-normed hidden states (DeepSeek-V4's: its
hyper-connection streams, one more axis, which nothing here reads: toolchain/export/deepseek_v4_mtp.py).

MTP position i reads the main model's hidden state at i and token i + 1 and drafts token i + 2. After a verify
step, the main decoder's ``hidden_states`` output at the accepted positions (``extras``) ends at position n - 2 of
the n known tokens: the drafter runs the MTP layer over the positions it has not yet seen, up to n - 2, and its
logits there draft token n. Further drafts chain the layer on itself (vLLM's recursive use of one MTP layer): the
previous draft as the token and the layer's own output hidden state (``mtp_hidden_states``) in place of the main
model's, which is not known yet. Cache entries made that way are speculative and dropped by the next ``propose``
whatever the verify step accepted; ``rollback(keep)`` drops more. Every cache tensor of the graph is cut alike
(the decoders' ``rollback``): DeepSeek-V3.2's MTP layer caches its indexer's keys beside the latent; DeepSeek-V4's
block one K=V entry per position, its sliding window a mask over them, cut as its main graph's cache is.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from toolchain.errors import InputError
from toolchain.interface.files import MODEL_XML, MTP_DIR, ONNX_MODEL
from toolchain.interface.graph import HIDDEN_STATES, MTP_HIDDEN, graph_cache_spec
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.decoder import OnnxRuntimeDecoder, StatelessDecoder
from toolchain.runtime.engines import GraphRunner
from toolchain.runtime.prefill_chunks import PrefillChunking


class CacheDecoder(Protocol):
    """A runtime decoder (toolchain/runtime/decoder.py) whose cache can be cut back."""

    extras: dict[str, np.ndarray]

    def reset(self) -> None: ...

    def rollback(self, keep: int) -> None: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0,
                inputs: dict[str, np.ndarray] | None = None) -> np.ndarray: ...


class MtpDrafter:
    """The Drafter of the speculative loop (reset / propose / rollback) over a decoder of the MTP graph that returns
    its ``mtp_hidden_states`` output in ``extras``. One sequence (batch 1)."""

    draft_probs: list[np.ndarray] | None = None  # greedy drafts: one-hot for speculative sampling

    def __init__(self, decoder: CacheDecoder) -> None:
        self.decoder = decoder
        self.reset()

    def reset(self) -> None:
        self.decoder.reset()
        self._real = 0  # MTP positions computed from the main model's hidden state and the true next token
        self._cached = 0  # positions in the MTP layer's cache (the real ones, then speculative ones)

    def propose(self, tokens: list[int], extras: dict[str, np.ndarray], k: int) -> list[int]:
        """Up to ``k`` drafts of the tokens after ``tokens``. ``extras[HIDDEN_STATES]``: [1, a, H], the main model's
        hidden states at positions n-1-a .. n-2 (n = len(tokens)); those before n-1-a must have been given to an
        earlier propose."""
        n = len(tokens)
        hidden = extras[HIDDEN_STATES]
        first = n - 1 - hidden.shape[1]
        if first > self._real:
            raise ValueError(f"the MTP layer has seen positions up to {self._real - 1}, and the hidden states given "
                             f"start at {first}")
        if k < 1 or n - 1 <= self._real:
            return []
        if self._cached > self._real:
            self.decoder.rollback(self._real)
        start = self._real
        ids = np.asarray([tokens[start + 1:n]], np.int64)
        logits = self.decoder.forward(ids, np.ones((1, n - 1), np.int64), logits_to_keep=1,
                                      inputs={HIDDEN_STATES: np.ascontiguousarray(hidden[:, start - first:])})
        self._real = self._cached = n - 1
        drafts = [int(logits[0, -1].argmax())]
        while len(drafts) < k:
            own = self.decoder.extras[MTP_HIDDEN][:, -1:]
            logits = self.decoder.forward(np.asarray([[drafts[-1]]], np.int64),
                                          np.ones((1, self._cached + 1), np.int64), logits_to_keep=1,
                                          inputs={HIDDEN_STATES: np.ascontiguousarray(own)})
            self._cached += 1
            drafts.append(int(logits[0, -1].argmax()))
        return drafts

    def rollback(self, keep: int) -> None:
        """Keep the cache's first ``keep`` positions (cut at the next propose, with any speculative ones)."""
        self._real = min(self._real, keep)


def open_mtp_drafter(artifact: Artifact, *, threads: int | None = None, openvino_f32: bool = False) -> MtpDrafter:
    """The drafter over an artifact's mtp/ graph (built with the recipe's ``export.mtp``), on its backend."""
    directory = artifact.path / MTP_DIR
    # its first propose runs the layer over the whole prompt: chunked as the main model's prefill
    chunking = PrefillChunking.for_model(artifact.config, artifact.size_bytes)
    if artifact.backend == "openvino":
        if not (directory / MODEL_XML).is_file():
            raise InputError(f"{artifact.path} has no MTP layer ({MTP_DIR}/{MODEL_XML}); build it with export.mtp")
        # a stateless IR (toolchain/stages/compile.py _compile_mtp says why): the cache is kept here as arrays
        runner = GraphRunner(directory / MODEL_XML, "openvino", numerics="exact" if openvino_f32 else "deployment",
                             threads=threads)
        return MtpDrafter(StatelessDecoder(runner, graph_cache_spec(directory / MODEL_XML), (MTP_HIDDEN,), chunking))
    if not (directory / ONNX_MODEL).is_file():
        raise InputError(f"{artifact.path} has no MTP layer ({MTP_DIR}/{ONNX_MODEL}); build it with export.mtp")
    return MtpDrafter(OnnxRuntimeDecoder(directory / ONNX_MODEL, threads, (MTP_HIDDEN,), chunking))
