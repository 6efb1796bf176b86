"""What running an artifact holds, and refusing to load one that does not fit (toolchain/memory_guard.py, exit 2),
before its runtime loads it: open_decoder (toolchain/runtime/decoder.py), `dstc serve` at startup, `dstc compare`."""

from __future__ import annotations

from toolchain.memory_guard import RETRY, require_memory, size
from toolchain.runtime.artifact import Artifact

# Resident memory a runtime adds to hold an artifact and run it, over the artifact's model file bytes, with a margin
# over what was measured (peak RSS over the process's before loading, a 512-token prefill and 32 steps, INT4
# artifacts of R1-Distill-Qwen-1.5B widths x 4 layers, 0.53 GiB each): ONNX Runtime 1.06x; OpenVINO 1.47x (0.13x
# once compiled, the rest from the first inference on; 1.85x for the 7B widths' 4.3 GB IR, toolchain/stages/compile.py).
RUNTIME_FACTOR = {"onnxruntime": 1.5, "openvino": 2.0}


def artifact_runtime_bytes(artifact: Artifact) -> int:
    """What running ``artifact`` on its runtime holds, from the size of its model files."""
    return int(artifact.size_bytes * RUNTIME_FACTOR[artifact.backend])


def require_artifact_memory(artifact: Artifact, copies: int = 1) -> None:
    """Before ``artifact`` is loaded by its runtime, ``copies`` times at once on this machine (`dstc serve
    --replicas N`: each replica's engine loads its own)."""
    factor = RUNTIME_FACTOR[artifact.backend]
    times = f"{copies} copies of it, each " if copies > 1 else ""
    require_memory(copies * artifact_runtime_bytes(artifact),
                   f"running {artifact.path} on {artifact.backend} ({times}{size(artifact.size_bytes)} of model "
                   f"files, x{factor:g})",
                   f"free memory, build a smaller artifact (INT4: compress.scheme int4-grouped)"
                   f"{', run fewer replicas' if copies > 1 else ''}, {RETRY}")
