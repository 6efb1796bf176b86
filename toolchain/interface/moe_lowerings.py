"""The MoE lowerings' names and the runtimes that run each (toolchain/export/moe.py builds them): data a recipe
validates against without importing the exporter, whose torch and onnx-ir a serve-only install does not have."""

from __future__ import annotations

from toolchain.errors import InputError

LOWERINGS = ("dispatch", "fused-onnxruntime", "fused-openvino")
BACKENDS = ("onnxruntime", "openvino")
# The runtimes that can run each lowering's graph.
RUNS_ON = {"dispatch": BACKENDS, "fused-onnxruntime": ("onnxruntime",), "fused-openvino": BACKENDS}
# A recipe's default: the lowering chosen for its backend, expert count and compression (export/moe.py auto_lowering).
AUTO = "auto"


def parity_backends(lowering: str, requested: tuple[str, ...] | None) -> tuple[str, ...]:
    """The backends to check an export of ``lowering`` on: ``requested``, or when None every backend that runs it.
    A requested backend that cannot run the graph is an InputError."""
    # auto: resolved for a build's backend before its export runs (auto_lowering); until then any backend
    runs_on = BACKENDS if lowering == AUTO else RUNS_ON[lowering]
    if requested is None:
        return runs_on
    refused = [b for b in requested if b not in runs_on]
    if refused:
        raise InputError(f"the {lowering} MoE lowering runs on {', '.join(runs_on)} only (com.microsoft.MoE has no "
                         f"OpenVINO conversion); drop {', '.join(refused)} from the parity backends")
    return tuple(requested)
