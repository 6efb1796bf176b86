"""The graph-rewrite passes' failures as toolchain errors (``passes`` itself never imports ``toolchain``)."""

from __future__ import annotations

from passes.errors import ExpectationError, PassError, PassValidationError
from toolchain.errors import DstcError, InputError


class OptimizeError(DstcError):
    """A pass failed, left an invalid graph, or fused less than the target's expectations require.

    The message names the pass and, for a missed expectation, its closest near-miss.
    """

    exit_code = 4

    def __init__(self, message: str, pass_name: str | None = None, near_miss: str | None = None) -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.near_miss = near_miss


def to_dstc_error(error: PassError) -> DstcError:
    """InputError for what the user asked wrong (an unknown pass, a malformed expectation); OptimizeError for a
    pass that crashed, broke the graph, or missed its expected count."""
    if isinstance(error, ExpectationError):
        return OptimizeError(str(error), error.pass_name, error.near_miss)
    if isinstance(error, PassValidationError) or error.__cause__ is not None:  # broke the graph / crashed
        return OptimizeError(str(error), error.pass_name)
    return InputError(str(error))
