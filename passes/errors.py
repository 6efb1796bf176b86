"""Exceptions raised by the passes package.

The toolchain maps :class:`PassError` to its own error hierarchy; every subclass carries the name of the pass
involved (``None`` when no single pass is to blame, e.g. an unknown name in a pipeline).
"""

from __future__ import annotations


class PassError(Exception):
    """A pass could not be found, failed, broke the model, or did less than expected."""

    def __init__(self, message: str, *, pass_name: str | None = None) -> None:
        super().__init__(message)
        self.pass_name = pass_name


class PassValidationError(PassError):
    """The model fails the ONNX checker or strict shape inference; ``pass_name`` is the pass that broke it."""


class ExpectationError(PassError):
    """A pass made fewer (or more) rewrites than the pipeline's expectations allow.

    ``near_miss`` is the closest failed match the pass reported (a one-line reason), or ``None``.
    """

    def __init__(
        self, message: str, *, pass_name: str, actual: int, near_miss: str | None = None
    ) -> None:
        super().__init__(message, pass_name=pass_name)
        self.actual = actual
        self.near_miss = near_miss
