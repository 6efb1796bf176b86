"""How many built kernels OpenVINO's CPU plugin keeps per input shape, and why: dstc's one decision about it.

The plugin builds a graph's kernels for every new set of input shapes and keeps them in two caches: its runtime
cache (``CPU_RUNTIME_CACHE_CAPACITY``, 5000 executors) and, under it, oneDNN's primitive cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 primitives; a process-wide setting oneDNN reads from the environment when
it first needs the cache). A graph whose attention is not one ScaledDotProductAttention (MLA's latent cache, V4's
per-token cache, V3.2's indexer) has shapes that follow the context, so every prefill chunk and decode step adds
entries, and at real widths an entry grows with the context: a 16k-token prompt of a shape-faithful DeepSeek-V3 (2
layers, INT4, 451 chunks) peaked at 8.65 GiB with both defaults, 5.32 GiB with the runtime cache bounded to 16, and
4.34 GiB with oneDNN's at 64 as well (4.24 at 0), within its 2 x (weights + cache) target
(docs/deepseek-generations.md "Long prompts").

A bound costs a rebuild of the kernels of a shape that comes back after it was evicted. The runtime cache at 16
cost nothing measurable in decode at real widths, where oneDNN's cache below it still holds the primitives that
come back (presumably a MoE expert's 0 or 1 tokens); oneDNN's at 16 as well made decode steps ~20 % slower, so its
bound is wider. A step of a small model is about as long as a rebuild (deepseek-v3-tiny serving restarted
sequences: steps 2.7-3.4x slower with the runtime cache bounded), so small models keep the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from toolchain.interface.graph import KV_CACHE, UNPAGEABLE, extra_cache_kinds
from toolchain.runtime.engines import runtime_cache_property

ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
RUNTIME_BOUND = 16  # the plugin's runtime cache where dstc bounds it
ONEDNN_BOUND = 64  # oneDNN's primitive cache then
# Model files from which a step is long next to a kernel rebuild: the shape-faithful DeepSeek-V3 (2.3 GiB) decoded
# as fast bounded as not; deepseek-v3-tiny (2 MB) serving restarted sequences did not.
LARGE_MODEL_BYTES = 1 << 30


def shapes_follow_context(metadata: dict[str, str]) -> bool:
    """Whether a graph's kernels see a new shape at every context length (the graph's exporter metadata): its
    attention is MLA's latent, V4's per-token or V3.2's indexed one, not one ScaledDotProductAttention."""
    return metadata.get(KV_CACHE) in UNPAGEABLE or bool(extra_cache_kinds(metadata))


@dataclass(frozen=True)
class KernelCaches:
    entries: int | None  # the plugin's runtime cache; None: its default
    onednn: int | None  # oneDNN's primitive cache; None: its default or what the environment says
    reason: str

    def properties(self) -> dict[str, int]:
        """The compile properties of this choice."""
        return runtime_cache_property(self.entries)

    def apply(self) -> None:
        """Bound oneDNN's primitive cache, unless the environment sets it already. oneDNN reads it once per process,
        when it first needs the cache: before a decoder's first compile in dstc's commands (generate, eval, the
        server's engine process); a process that built oneDNN kernels before keeps what it read then."""
        if self.onednn is not None:
            os.environ.setdefault(ONEDNN_CACHE, str(self.onednn))

    def record(self) -> dict:
        """What was chosen and why, with oneDNN's setting as this process's environment has it."""
        return {"runtime_cache": self.entries, "onednn_primitive_cache": os.environ.get(ONEDNN_CACHE),
                "reason": self.reason}


def kernel_caches(given: int | None, metadata: dict[str, str], model_bytes: int) -> KernelCaches:
    """The caches' capacities for a graph of this exporter ``metadata`` and model files' size. ``given`` (dstc
    generate / serve --openvino-runtime-cache) is the runtime cache's, and leaves oneDNN's to the environment."""
    if given is not None:
        return KernelCaches(given, None, "given")
    if not shapes_follow_context(metadata):
        return KernelCaches(None, None, "the graph's shapes do not follow the context")
    if model_bytes < LARGE_MODEL_BYTES:
        return KernelCaches(None, None, f"a small model ({model_bytes / 2**20:.0f} MiB): a step is about as long as "
                                        "rebuilding its kernels")
    return KernelCaches(RUNTIME_BOUND, ONEDNN_BOUND,
                        f"a large model ({model_bytes / 2**30:.1f} GiB) whose shapes follow the context: each new "
                        "shape's kernels, kept, grow its memory with the context")
