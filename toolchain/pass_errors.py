"""The graph-rewrite passes' failures as toolchain errors (``passes`` itself never imports ``toolchain``)."""

from __future__ import annotations

from passes.errors import ExpectationError, PassError, PassValidationError
from toolchain.errors import DstcError, InputError, OptimizeError


def to_dstc_error(error: PassError) -> DstcError:
    """InputError for what the user asked wrong (an unknown pass, a malformed expectation); OptimizeError for a
    pass that crashed, broke the graph, or missed its expected count."""
    if isinstance(error, ExpectationError):
        return OptimizeError(str(error), error.pass_name, error.near_miss)
    if isinstance(error, PassValidationError) or error.__cause__ is not None:  # broke the graph / crashed
        return OptimizeError(str(error), error.pass_name)
    return InputError(str(error))
