"""Is the model still valid ONNX? The ONNX checker plus strict, type-checking shape inference."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import CheckerPass

from passes.errors import PassValidationError


def validate_model(model: ir.Model) -> None:
    """Raise :class:`PassValidationError` (``pass_name`` None) if ``model`` fails the checks.

    ``full_check`` makes the checker run shape inference in strict mode, which also rejects shapes recorded on
    values that disagree with what the graph computes. onnx_ir's ``CheckerPass`` lifts large initializers out
    before serialising, so this works on models over 2 GB.
    """
    try:
        CheckerPass(full_check=True)(model)
    except Exception as e:  # onnx raises ValidationError, InferenceError, or serialisation errors
        raise PassValidationError(f"{type(e).__name__}: {str(e).strip()}") from e
