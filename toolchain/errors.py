"""The toolchain's error hierarchy.

The CLI prints a DstcError as one line and exits with its ``exit_code``; any other exception is a bug: it keeps its
traceback, followed by one line asking for a bug report, and exits with INTERNAL_ERROR_EXIT.
"""


class DstcError(Exception):
    """Base of every error the toolchain reports to its user."""

    exit_code = 1


class InputError(DstcError):
    """Bad input from the user: a model that is not one, an unknown name, an unwritable path, a bad recipe."""

    exit_code = 2


class UnsupportedModelError(InputError):
    """The checkpoint is a model, but of an architecture or variant the toolchain does not export."""


class RecipeError(InputError):
    """A recipe that does not parse or validate; the message names the file and the key."""


class ParityError(DstcError):
    """The exported model disagrees with the PyTorch reference beyond tolerance."""

    exit_code = 3


class OptimizeError(DstcError):
    """A pass failed, left an invalid graph, or fused less than the target's expectations require.

    The message names the pass and, for a missed expectation, its closest near-miss.
    """

    exit_code = 4

    def __init__(self, message: str, pass_name: str | None = None, near_miss: str | None = None) -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.near_miss = near_miss


class OutputError(InputError):
    """An output that cannot be written: a full disk, a read-only or denied path. Nothing is left half-written."""


class RuntimeCrashError(DstcError):
    """The compiled artifact crashed (killed by a signal), hung, failed or produced non-finite logits when run at
    its runtime's deployment defaults, in the compile stage's smoke inference (toolchain/verify/smoke.py). The
    message names the signal or error and the step (prompt length, batch); nothing is written."""

    exit_code = 5

    def __init__(self, message: str, signal: str | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.signal = signal
        self.where = where


class CompressionError(DstcError):
    """The compress stage lost a weight: its relative error is above the recipe's ``max_weight_error`` (an expert
    written as zeros, a scale that underflowed). The message names the worst weight; nothing is written."""

    exit_code = 6


# Exit codes that are no DstcError's (README "Exit codes"): an unexpected exception is a bug (EX_SOFTWARE of
# sysexits.h, apart from every documented failure), Ctrl-C is 128 + SIGINT.
INTERNAL_ERROR_EXIT = 70
INTERRUPTED_EXIT = 130
