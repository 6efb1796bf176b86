"""dstc graph passes: a registry of named in-place passes over onnx_ir models, a pipeline runner that reports
per-pass stats, expectation checks with near-miss reasons, and validation.

Depends only on onnx, onnx-ir, onnxscript and numpy (never on ``toolchain``).
"""

from __future__ import annotations

import importlib

# Each name is imported from its module when first asked for: the graph contract's keys (passes/graph_contract.py)
# are read by dstc's base install, which serves artifacts without onnx-ir (the build extra), and importing
# passes.graph_contract runs this file first.
_MODULE_OF = {
    "CountedResult": "passes.base",
    "CountingPass": "passes.base",
    "NearMiss": "passes.base",
    "ExpectationError": "passes.errors",
    "PassError": "passes.errors",
    "PassValidationError": "passes.errors",
    "PassStats": "passes.pipeline",
    "run_pass": "passes.pipeline",
    "run_pipeline": "passes.pipeline",
    "PassInfo": "passes.registry",
    "create_pass": "passes.registry",
    "get_pass": "passes.registry",
    "list_passes": "passes.registry",
    "register": "passes.registry",
    "validate_model": "passes.validation",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'passes' has no attribute {name!r}")
