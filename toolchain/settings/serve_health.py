"""The /health thresholds a recipe's ``serve`` section and ``dstc serve --threshold`` hold: which metrics /health
judges (toolchain/serve/health.py measures them) and the rule their limits follow. Settings, at the bottom: the
recipe and the server both read them, neither through the other."""

from __future__ import annotations

from pydantic import Field, model_validator

from toolchain.errors import InputError
from toolchain.settings.section import Section

# The metrics /health judges against thresholds (toolchain/serve/health.py measures them); higher is worse.
LATENCY_METRICS = tuple(f"{kind}_p{q}_ms" for kind in ("ttft", "itl") for q in (50, 90, 99))
HEALTH_METRICS = (*LATENCY_METRICS, "queue_depth", "running_batch", "kv_cache_usage", "rejected_per_minute")


def check_threshold(metric: str, warn: float, ok: float | None, alert: float | None) -> None:
    """InputError unless ``metric`` is one /health judges and its limits are in order (ok <= warn <= alert), the
    rule of a recipe's thresholds and of ``dstc serve --threshold`` alike."""
    if metric not in HEALTH_METRICS:
        raise InputError(f"unknown health metric {metric!r} (one of {', '.join(HEALTH_METRICS)})")
    if ok is not None and ok > warn:
        raise InputError(f"{metric}: ok={ok:g} is above warn={warn:g}")
    if alert is not None and alert < warn:
        raise InputError(f"{metric}: alert={alert:g} is below warn={warn:g}")


class ServeThreshold(Section):
    warn: float = Field(description="/health reports the metric as degraded at or above this.")
    ok: float | None = Field(None, description="Back to ok below this (default: warn).")
    alert: float | None = Field(None, description="/health reports the metric as failing at or above this.")


class ServeSection(Section):
    """What ``dstc serve`` reads from the artifact's manifest: /health thresholds by metric (HEALTH_METRICS);
    ``--threshold`` replaces one at serve time. Not part of any stage id."""

    thresholds: dict[str, ServeThreshold] = Field(default_factory=dict, description=(
        "/health thresholds by metric (ttft_p50_ms ... itl_p99_ms, queue_depth, running_batch, kv_cache_usage, "
        "rejected_per_minute), each {warn, ok, alert}."))

    @model_validator(mode="after")
    def _known_metrics(self) -> ServeSection:
        for metric, limits in self.thresholds.items():
            try:
                check_threshold(metric, limits.warn, limits.ok, limits.alert)
            except InputError as e:
                raise ValueError(str(e)) from None
        return self
