"""Refusing a load that cannot fit in memory before it starts, in one line (exit 2), instead of the kernel's OOM
killer ending the process minutes later (exit 137, no message).

Each load of a model estimates what it will hold and compares that with the memory available at that moment
(toolchain/hardware.py available_memory_bytes: MemAvailable, or DSTC_MEMORY_LIMIT_BYTES): an artifact opened by its
runtime (toolchain/runtime/memory.py, what a runtime holds: `dstc generate`, `eval`, `compare`; `dstc serve` at
startup) and the whole fp32 PyTorch reference (here; toolchain/source.py load: `dstc eval`, `compare`, the export's
end-to-end parity). Checked at each load, against what is available then, what an earlier load still holds (eval's
reference, then its artifact) is counted by the kernel's own figure.
"""

from __future__ import annotations

import os
from pathlib import Path

from toolchain.errors import InputError
from toolchain.hardware import MEMORY_LIMIT_ENV, available_memory_bytes

# The whole reference over its float32 values' bytes: 1.01x loaded, 1.30x at the peak of a 4 x 256-token forward
# (logits and activations), on R1-Distill-Qwen-1.5B widths x 4 layers (2.44 GiB of values).
REFERENCE_FACTOR = 1.3
RETRY = f"or set {MEMORY_LIMIT_ENV} to the bytes to assume available (e.g. with swap) to try anyway"


def size(n: float) -> str:
    """Bytes as a person reads them: 23.1 GiB, 5.2 MiB."""
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024**power:
            return f"{n / 1024**power:.1f} {unit}"
    return f"{n:.0f} B"


def require_memory(need_bytes: int, what: str, way_out: str) -> None:
    """InputError when ``what`` needs more than the memory available now: both figures, and ``way_out``."""
    available = available_memory_bytes()
    if need_bytes > available:
        figure = MEMORY_LIMIT_ENV if os.environ.get(MEMORY_LIMIT_ENV) else "MemAvailable"
        raise InputError(f"{what} needs about {size(need_bytes)} of memory and {size(available)} is available "
                         f"({figure}): {way_out}")


def reference_bytes(source_path: Path | str) -> int:
    """What the whole fp32 PyTorch reference of a checkpoint holds, from its tensors' shapes (the headers alone)."""
    # torch loads only where a checkpoint is read: running an artifact needs none
    from toolchain.checkpoint.reader import open_checkpoint

    with open_checkpoint(Path(source_path)) as reader:
        return int(reader.parameters() * 4 * REFERENCE_FACTOR)


def require_reference_memory(source_path: Path | str, spec: str) -> None:
    """Before the whole fp32 reference of ``spec`` is loaded."""
    need = reference_bytes(source_path)
    require_memory(need, f"loading the fp32 PyTorch reference of {spec} whole ({size(need / REFERENCE_FACTOR)} of "
                         f"float32 values, x{REFERENCE_FACTOR:g} to run it)",
                   f"free memory or run it on a machine with more, {RETRY}")
