"""Expectations on what a pass achieves, e.g. ``{"fuse-attention": {"min": 4}}``.

A spec is a mapping with ``min`` and/or ``max`` (inclusive bounds) and an optional ``count`` naming one of the
pass's counts; without ``count`` the bounds apply to the sum of its counts (over every run of the pass in the
pipeline). A shortfall is reported with the pass's closest near-miss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from passes.base import NearMiss
from passes.errors import ExpectationError, PassError

_KEYS = {"min", "max", "count"}


@dataclasses.dataclass(frozen=True)
class Expectation:
    min: int | None = None
    max: int | None = None
    count: str | None = None

    @classmethod
    def parse(cls, pass_name: str, spec: Mapping[str, object]) -> Expectation:
        if not isinstance(spec, Mapping) or not spec or set(spec) - _KEYS:
            raise PassError(
                f"expectation for pass {pass_name!r} must be a mapping with keys among {sorted(_KEYS)}, got {spec!r}",
                pass_name=pass_name,
            )
        bounds = {}
        for key in ("min", "max"):
            value = spec.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise PassError(f"expectation {key!r} for pass {pass_name!r} must be an int >= 0", pass_name=pass_name)
            bounds[key] = value
        count = spec.get("count")
        if count is not None and not isinstance(count, str):
            raise PassError(f"expectation 'count' for pass {pass_name!r} must be a string", pass_name=pass_name)
        if bounds["min"] is None and bounds["max"] is None:
            raise PassError(f"expectation for pass {pass_name!r} sets neither 'min' nor 'max'", pass_name=pass_name)
        return cls(bounds["min"], bounds["max"], count)

    def actual(self, counts: Mapping[str, int]) -> int:
        return counts.get(self.count, 0) if self.count else sum(counts.values())

    def describe(self) -> str:
        what = f"'{self.count}' count" if self.count else "total count"
        if self.min is not None and self.max is not None:
            return f"{what} in [{self.min}, {self.max}]"
        return f"{what} >= {self.min}" if self.min is not None else f"{what} <= {self.max}"


def parse_expectations(
    expectations: Mapping[str, Mapping[str, object]] | None, pass_names: Sequence[str]
) -> dict[str, Expectation]:
    parsed = {}
    for name, spec in (expectations or {}).items():
        if name not in pass_names:
            raise PassError(f"expectation for pass {name!r}, which is not in the pipeline", pass_name=name)
        parsed[name] = Expectation.parse(name, spec)
    return parsed


def check_expectation(
    pass_name: str,
    expectation: Expectation,
    counts: Mapping[str, int],
    near_misses: Callable[[], list[NearMiss]],
) -> None:
    """Raise :class:`ExpectationError` if ``counts`` break ``expectation``; only then are near-misses computed."""
    actual = expectation.actual(counts)
    too_few = expectation.min is not None and actual < expectation.min
    too_many = expectation.max is not None and actual > expectation.max
    if not (too_few or too_many):
        return
    message = f"pass {pass_name!r}: expected {expectation.describe()}, got {actual} (counts: {dict(counts)})"
    near_miss = None
    if too_few:
        try:
            misses = near_misses()
        except Exception as e:  # diagnostics must not hide the real failure
            misses, message = [], f"{message}; collecting near-misses failed: {e}"
        if misses:
            near_miss = str(misses[0])
            message = f"{message}; closest near-miss: {near_miss}"
        else:
            message = f"{message}; no near-miss was recorded"
    raise ExpectationError(message, pass_name=pass_name, actual=actual, near_miss=near_miss)
