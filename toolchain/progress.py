"""When a long phase (eval, calibration) writes a progress line: after every part of it while there are few, else
about every tenth of the way, and after the last, so that a CI log shows where the minutes go without a line per
token."""

from __future__ import annotations

import math

LINES = 10  # most progress lines of one phase


def due(done: int, total: int, most: int = LINES) -> bool:
    """Whether a line is written after ``done`` of ``total`` parts (1-based)."""
    return done == total or done % max(1, math.ceil(total / most)) == 0
