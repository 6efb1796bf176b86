"""Parity of an exported graph with the PyTorch model: prefill then greedy decode through the KV cache.

Both sides are Decoders (toolchain/runtime) run by the runtime's one greedy loop, each feeding back its own tokens
and its own KV cache, on the same prompts; logits are compared at every step on the positions that are real tokens
(left padding excluded), and the greedy token sequences must be identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from toolchain.interface.graph import cache_dtype, graph_cache_spec, graph_metadata
from toolchain.runtime.decoder import Decoder, StatelessDecoder
from toolchain.runtime.engines import GraphRunner
from toolchain.runtime.generate import greedy_logits
from toolchain.tokenizer_loading import load_tokenizer

# ONNX Runtime runs the graph with fp32 kernels close to PyTorch's: the issue's bound, 1e-4 of the logits' range.
ORT_TOLERANCE = 1e-4
# OpenVINO's CPU plugin at f32 inference precision uses its own kernels (oneDNN/brgemm MatMul blocking, its own
# vectorised exp/softmax and fused RMSNorm), so rounding differs from PyTorch by more than ORT's; the error
# grows with depth. 1e-3 of the logits' range stays far below the margins that decide greedy tokens, and the
# tokens themselves must still be identical.
OPENVINO_TOLERANCE = 1e-3

TOLERANCES = {"onnxruntime": ORT_TOLERANCE, "openvino": OPENVINO_TOLERANCE}
# A cache stored in float16 (export.cache_dtype) rounds every cached entry to 11 significant bits, a relative error
# of up to 2^-11 (4.9e-4) in each key and value every later position reads; measured 4.1e-4 of the logits' range on
# deepseek-v3-tiny (ONNX Runtime). The bound is 2e-3, four times that rounding, where float32 compute alone stays
# within 1e-4 (ORT): the greedy tokens must still be identical.
CACHE_TOLERANCES = {"float32": 0.0, "float16": 2e-3}


def tolerance(backend: str, cache_dtype: str = "float32") -> float:
    """The parity bound, relative to the logits' range, of a graph on ``backend`` whose cache is ``cache_dtype``."""
    return max(TOLERANCES[backend], CACHE_TOLERANCES[cache_dtype])

# An end-to-end check holds the fp32 PyTorch model and one runtime's copy of the graph at once (about 8 bytes per
# parameter); above this many bytes of fp32 weights it is skipped (a streaming build's memory is the point).
FULL_PARITY_BYTES = 1 << 30


def too_large_for_end_to_end(source_path: Path) -> str | None:
    """Why the end-to-end check against the whole fp32 model is not run on this checkpoint, or None."""
    # torch loads only where a checkpoint is read
    from toolchain.checkpoint.reader import open_checkpoint

    with open_checkpoint(source_path) as reader:
        size = reader.parameters() * 4
    if size <= FULL_PARITY_BYTES:
        return None
    return (f"the fp32 reference ({size / 2**30:.1f} GiB) is above the end-to-end check's budget of "
            f"{FULL_PARITY_BYTES / 2**30:.1f} GiB")


@dataclass
class Case:
    name: str
    prompts: list[list[int]]  # several prompts form one left-padded batch


@dataclass
class CaseResult:
    name: str
    batch: int
    prompt_lengths: list[int]
    steps: int
    max_abs_diff: float
    logits_range: float
    tokens_identical: bool
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def relative_diff(self) -> float:
        return self.max_abs_diff / self.logits_range if self.logits_range else float("inf")


def compare_decoders(reference: Decoder | Callable[[], Decoder], candidate: Decoder | Callable[[], Decoder],
                     cases: list[Case], new_tokens: int, pad_id: int, tolerance: float) -> dict:
    """Greedy runs of a reference and a candidate decoder on every case (each case starts from an empty cache),
    compared at every step and real position. Given as factories, the reference runs every case and is let go
    before the candidate is made, so that two large models are never loaded at once."""
    ref_runs = _runs(reference, cases, new_tokens, pad_id)
    runs = _runs(candidate, cases, new_tokens, pad_id)
    results = []
    for case, (ref_tokens, ref_logits), (tokens, logits) in zip(cases, ref_runs, runs):
        diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits))
        span = max(float(r.max() - r.min()) for r in ref_logits)
        results.append(CaseResult(case.name, len(case.prompts), [len(p) for p in case.prompts], new_tokens, diff,
                                  span, bool((tokens == ref_tokens).all()), tokens.tolist()))
    passed = all(r.relative_diff <= tolerance and r.tokens_identical for r in results)
    return {
        "passed": passed,
        "tolerance_relative_to_logits_range": tolerance,
        "max_relative_diff": max(r.relative_diff for r in results),
        "max_abs_diff": max(r.max_abs_diff for r in results),
        "tokens_identical": all(r.tokens_identical for r in results),
        "cases": [dict(vars(r), relative_diff=r.relative_diff) for r in results],
    }


@runtime_checkable
class _Forward(Protocol):
    """A decoder, as opposed to a factory of one (a decoder may be callable too)."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, logits_to_keep: int = 0) -> np.ndarray: ...


def _runs(decoder: Decoder | Callable[[], Decoder], cases: list[Case], new_tokens: int, pad_id: int) -> list:
    made = decoder() if callable(decoder) and not isinstance(decoder, _Forward) else decoder
    return [greedy_logits(made, case.prompts, new_tokens, pad_id) for case in cases]


def graph_decoder(path: Path, backend: str) -> StatelessDecoder:
    """A graph file (ONNX, or a stateless OpenVINO IR) run stateless at exact numerics, as a Decoder; the runner
    appends the new cache entries itself where the graph allows (toolchain/runtime/appending_cache.py)."""
    return StatelessDecoder(GraphRunner(path, backend, appending=True), graph_cache_spec(path),
                            metadata=graph_metadata(path))


def compare(reference: Decoder, path: Path, backend: str, cases: list[Case], new_tokens: int, pad_id: int) -> dict:
    """A graph file on one backend against the PyTorch reference (a TorchDecoder)."""
    return compare_decoders(reference, lambda: graph_decoder(path, backend), cases, new_tokens, pad_id,
                            tolerance(backend, cache_dtype(graph_metadata(path))))


PROMPTS = (
    "12+345=",
    "the old man walked to the market with a basket of apples, and the children followed him along the river "
    "because they wanted to see the boats. 607+58=",
    "where is the red book?",
)


def parity_cases(source_path: Path, vocab_size: int) -> list[Case]:
    """Prompts of several lengths, alone and as a left-padded batch of two; text when the checkpoint has a
    tokenizer, seeded random ids otherwise."""
    prompts = []
    if (source_path / "tokenizer.json").is_file():
        tok = load_tokenizer(source_path)
        prompts = [[t for t in tok(p, add_special_tokens=False)["input_ids"] if t < vocab_size] for p in PROMPTS]
    if not prompts or not all(prompts):
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, vocab_size, n).tolist() for n in (5, 48, 11)]
    short, long, other = prompts
    return [Case("short", [short]), Case("long", [long]), Case("batch2-left-padded", [other, short])]
