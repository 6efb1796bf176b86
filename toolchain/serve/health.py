"""Health: latency percentiles over a recent window, judged against thresholds into ok / warn / alert.

A threshold names a metric (``ttft_p99_ms``, ``itl_p90_ms``, ``queue_depth``, ...; higher is worse) and up to
three limits: ``warn`` (above it: warn), ``alert`` (above it: alert) and ``ok`` (a warn or alert clears only once
the value is back below it; default: ``warn``). So ``ttft_p99_ms:warn=350,ok=250`` turns to warn when the P99 time
to first token passes 350 ms and back to ok below 250 ms, not on every sample around 350 ms. An alert drops to warn
once the value is no longer above ``warn``. A metric without samples in the window is ok.

Thresholds come from the artifact's recipe (a ``serve: thresholds:`` mapping, read from manifest.json's resolved
recipe where present) and from ``dstc serve --threshold``; a flag replaces the recipe's threshold of that metric.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from toolchain.errors import InputError
from toolchain.settings.serve_health import ServeSection, check_threshold

STATUSES = ("ok", "warn", "alert")


@dataclass(frozen=True)
class Threshold:
    metric: str
    warn: float
    ok: float | None = None  # back to ok below this; None: warn
    alert: float | None = None

    def __post_init__(self) -> None:
        check_threshold(self.metric, self.warn, self.ok, self.alert)

    @property
    def clear(self) -> float:
        return self.warn if self.ok is None else self.ok

    def judge(self, value: float | None, previous: str) -> str:
        """The status for ``value`` given the status before (the hysteresis)."""
        if value is None:
            return "ok"
        if self.alert is not None and value > self.alert:
            return "alert"
        if value > self.warn:
            return "warn"
        if previous in ("warn", "alert") and value >= self.clear:
            return "warn"
        return "ok"

    def describe(self) -> dict:
        return {"warn": self.warn, "ok": self.clear, "alert": self.alert}


DEFAULT_THRESHOLDS = (Threshold("ttft_p99_ms", warn=350, ok=250, alert=1000),
                      Threshold("itl_p99_ms", warn=100, ok=75, alert=500))

_FLAG = re.compile(r"^\s*([a-z0-9_]+)\s*:\s*(.+)$")


def parse_threshold(text: str) -> Threshold:
    """``METRIC:warn=X[,ok=Y][,alert=Z]`` (the --threshold flag)."""
    match = _FLAG.match(text)
    if not match:
        raise InputError(f"bad threshold {text!r}: expected METRIC:warn=X[,ok=Y][,alert=Z]")
    limits = {}
    for part in match.group(2).split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("warn", "ok", "alert") or key in limits:
            raise InputError(f"bad threshold {text!r}: {part.strip()!r} is not one of warn=, ok=, alert= (once each)")
        try:
            limits[key] = float(value)
        except ValueError:
            raise InputError(f"bad threshold {text!r}: {value.strip()!r} is not a number") from None
    if "warn" not in limits:
        raise InputError(f"bad threshold {text!r}: warn= is required")
    return Threshold(match.group(1), **limits)


def recipe_thresholds(serve: ServeSection | None) -> list[Threshold]:
    """The thresholds of the recipe the artifact was built from: its ``serve: {thresholds: {METRIC: {warn, ok,
    alert}}}`` section, from manifest.json's recipe (none without one), checked when the recipe loaded."""
    if serve is None:
        return []
    return [Threshold(metric, limits.warn, limits.ok, limits.alert) for metric, limits in serve.thresholds.items()]


def merge_thresholds(*layers: list[Threshold] | tuple[Threshold, ...]) -> list[Threshold]:
    """Later layers replace earlier ones metric by metric."""
    merged: dict[str, Threshold] = {}
    for layer in layers:
        for threshold in layer:
            merged[threshold.metric] = threshold
    return list(merged.values())


class HealthMonitor:
    """Recent TTFT / ITL samples and rejections; the live gauges come from ``gauges()`` (the engine's state)."""

    def __init__(self, thresholds: list[Threshold], *, window_s: float = 60.0, max_samples: int = 20000,
                 gauges=dict) -> None:
        self.thresholds = list(thresholds)
        self.window_s = window_s
        self._gauges = gauges
        self._lock = threading.Lock()
        self._ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._itl: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._rejected: collections.deque[float] = collections.deque(maxlen=max_samples)
        self._status = {t.metric: "ok" for t in self.thresholds}

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.append((time.monotonic(), seconds))

    def observe_itl(self, seconds: float, tokens: int = 1) -> None:
        now = time.monotonic()
        with self._lock:
            self._itl.extend([(now, seconds)] * tokens)

    def observe_rejected(self) -> None:
        with self._lock:
            self._rejected.append(time.monotonic())

    def _recent(self, samples, now: float) -> list[float]:
        return [value for at, value in samples if now - at <= self.window_s]

    def values(self) -> dict[str, float | None]:
        now = time.monotonic()
        with self._lock:
            series = {"ttft": self._recent(self._ttft, now), "itl": self._recent(self._itl, now)}
            rejected = sum(1 for at in self._rejected if now - at <= 60.0)
        values: dict[str, float | None] = {}
        for kind, samples in series.items():
            for q in (50, 90, 99):
                values[f"{kind}_p{q}_ms"] = float(np.percentile(samples, q)) * 1e3 if samples else None
        values["rejected_per_minute"] = float(rejected)
        values.update({k: float(v) for k, v in self._gauges().items()})
        return values

    def report(self) -> dict:
        """{"status", "checks": [...], "values", "window_s"}; updates each threshold's hysteresis state."""
        values = self.values()
        checks = []
        with self._lock:
            for threshold in self.thresholds:
                value = values.get(threshold.metric)
                status = threshold.judge(value, self._status[threshold.metric])
                self._status[threshold.metric] = status
                checks.append({"metric": threshold.metric, "value": value, "status": status, **threshold.describe()})
        worst = max((STATUSES.index(c["status"]) for c in checks), default=0)
        return {"status": STATUSES[worst], "checks": checks, "values": values, "window_s": self.window_s}
