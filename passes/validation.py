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
    _inline_small_external_tensors(model)
    try:
        CheckerPass(full_check=True)(model)
    except Exception as e:  # onnx raises ValidationError, InferenceError, or serialisation errors
        raise PassValidationError(f"{type(e).__name__}: {str(e).strip()}") from e


# CheckerPass leaves initializers up to this size in the proto it checks (onnx_ir's _BIG_TENSOR_SIZE_LIMIT).
_CHECKED_INLINE_BYTES = 1000


def _inline_small_external_tensors(model: ir.Model) -> None:
    """The ONNX checker resolves external data relative to the current directory, so a small initializer that a
    saved model keeps in external data (onnx-ir writes every tensor above 256 bytes there) fails it with "should
    be stored in model.onnx.data, but it is not regular file". Those few small tensors are read into memory."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= _CHECKED_INLINE_BYTES:
            value.const_value = ir.tensor(tensor.numpy().copy(), name=tensor.name)
