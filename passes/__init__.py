"""dstc graph passes: a registry of named in-place passes over onnx_ir models, a pipeline runner that reports
per-pass stats, expectation checks with near-miss reasons, and validation.

Depends only on onnx, onnx-ir, onnxscript and numpy (never on ``toolchain``).
"""

from passes.base import CountedResult, CountingPass, NearMiss
from passes.errors import ExpectationError, PassError, PassValidationError
from passes.pipeline import PassStats, run_pass, run_pipeline
from passes.registry import PassInfo, create_pass, get_pass, list_passes, register
from passes.validation import validate_model

__all__ = [
    "CountedResult",
    "CountingPass",
    "ExpectationError",
    "NearMiss",
    "PassError",
    "PassInfo",
    "PassStats",
    "PassValidationError",
    "create_pass",
    "get_pass",
    "list_passes",
    "register",
    "run_pass",
    "run_pipeline",
    "validate_model",
]
