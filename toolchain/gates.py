"""Release gates on a report: accuracy against the fp32 reference or a baseline report, latency against a baseline.

A gate reads metrics by name from report.json and compares them with a limit; the same limits come from
`dstc gate` options or a recipe's `gates:` section, so CI and `dstc build` decide alike.

A latency gate judges the ratio of two medians, each with its confidence interval (toolchain/evaluate/spread.py);
the ratio's interval runs from the report's low over the baseline's high to the report's high over the baseline's
low. The verdict is the medians' ratio against the limit; the interval says whether it means anything:
- the interval holds both 1 (no change) and a ratio beyond the limit: the measurements cannot tell an unchanged
  artifact from one slower than the limit allows, and the gate is refused (InputError, exit 2);
- the interval straddles the limit (without holding 1): the verdict stands, with a warning that it is within noise;
- an interval is missing (a report of schema /5 or before, one repetition) or below MIN_CONFIDENCE (fewer than 5
  repetitions): the verdict stands, with a warning that its noise is unknown.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from toolchain.errors import DstcError, InputError
from toolchain.report.schema import GateResult, Interval, Metric, Report
from toolchain.settings.section import Section


class GateFailed(DstcError):
    """At least one gate failed; the report (with the gate table) is kept."""

    exit_code = 1


class GateLimits(Section):
    # an infinite limit passes every value: a mistake, refused as nan is (by its bounds)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_perplexity_increase: float | None = Field(
        None, ge=0, description="Largest allowed relative perplexity increase (0.05 = +5 %).")
    min_top1_agreement: float | None = Field(None, ge=0, le=1, description="Smallest allowed top-1 agreement.")
    max_exact_match_drop: float | None = Field(None, ge=0, description="Largest allowed exact-match drop, points.")
    max_kl_mean: float | None = Field(None, ge=0, description="Largest allowed mean KL, nats.")
    max_weight_error: float | None = Field(
        None, ge=0, description="Largest allowed relative error of any compressed weight (1.0: a weight of zeros), "
                                "from the compress stage's measurements.")
    max_task_drop: float | None = Field(
        None, ge=0, description="Largest allowed drop, in points, of each lm-eval task's main metric (eval --tasks).")
    max_latency_ratio: float | None = Field(
        None, gt=0, description="Largest allowed TTFT and ITL P50 ratio to the baseline's (needs a baseline).")
    baseline: str | None = Field(
        None, description="A baseline report.json (or artifact): accuracy and latency are judged against it. Without "
                          "one, accuracy is judged against the fp32 reference inside the report. In a recipe, "
                          "relative to the recipe's directory.")
    allow_unmeasured: bool = Field(
        False, description="Report a gate whose metric the report could not measure (exact match on a model not "
                           "trained on the embedded task) as skipped instead of failed.")
    allow_other_model: bool = Field(
        False, description="Accept a baseline that measured another model than the report (refused otherwise).")
    allow_other_machine: bool = Field(
        False, description="Judge latency against a baseline measured on another CPU or thread count (refused "
                           "otherwise: the ratio would measure the machines, not the artifact).")

    def any(self) -> bool:
        return any(v is not None for k, v in self.model_dump().items()
                   if k not in ("baseline", "allow_unmeasured", "allow_other_model", "allow_other_machine"))


def measured_model(report: Report) -> str | None:
    """The model a report measured, as its build named it (a compile-only artifact's report: its reference's)."""
    return report.artifact.get("model") or report.reference.get("model")


def check_baseline_model(model: str | None, baseline: Report, limits: GateLimits) -> None:
    """InputError when ``baseline`` measured another model than ``model``, unless the limits allow it: another
    model's perplexity, exact match or latency makes a gate pass or fail for no reason of the artifact's."""
    other = measured_model(baseline)
    if limits.allow_other_model or model is None or other is None or model == other:
        return
    raise InputError(f"the baseline is a report of {other} and the report gated is of {model}: gate against a "
                     f"baseline of the same model, or say that another is meant (--allow-other-model; "
                     f"allow_other_model: true under a recipe's gates)")


def machine_of(report: Report) -> tuple:
    """What latency depends on besides the artifact: the CPU (model, ISA extensions) and the threads it ran on."""
    env = report.environment
    return env.cpu.model, tuple(sorted(env.cpu.isa)), env.threads


def machine_difference(report: Report, baseline: Report) -> str | None:
    """How the report's machine differs from the baseline's, in words, or None when they are alike."""
    (model, isa, threads), (b_model, b_isa, b_threads) = machine_of(report), machine_of(baseline)
    differences = []
    if model != b_model:
        differences.append(f"CPU {model or 'unknown'} vs the baseline's {b_model or 'unknown'}")
    elif isa != b_isa:
        differences.append(f"ISA {' '.join(sorted(set(isa) ^ set(b_isa)))} on one side only")
    if threads != b_threads:
        differences.append(f"{threads} threads vs the baseline's {b_threads}")
    return "; ".join(differences) or None


MIN_CONFIDENCE = 0.9  # an interval of fewer repetitions is too narrow by luck to vouch for a verdict


def _interval(metric: Metric | None) -> Interval | None:
    interval = None if metric is None else metric.interval
    return interval if interval is not None and interval.confidence >= MIN_CONFIDENCE else None


def latency_ratio_interval(metric: Metric | None, base: Metric | None) -> tuple[float, float, float] | None:
    """(low, high, the lower confidence of the two medians' intervals) of a latency median's ratio to the
    baseline's, or None when either has no interval of at least MIN_CONFIDENCE."""
    a, b = _interval(metric), _interval(base)
    if a is None or b is None or not b.low:
        return None
    return a.low / b.high, a.high / b.low, min(a.confidence, b.confidence)


def _latency_gate(report: Report, baseline: Report, metric: str, limit: float) -> tuple[str, str]:
    """The latency gate's detail (its interval) and warning under the rule above; InputError when the intervals make
    the ratio meaningless."""
    spread = latency_ratio_interval(report.metrics.get(metric), baseline.metrics.get(metric))
    if spread is None:
        missing = [who for who, r in (("the report", report), ("the baseline", baseline))
                   if _interval(r.metrics.get(metric)) is None] or ["the baseline"]  # or a median of 0 ms
        return "", (f"{metric}: {' and '.join(missing)} {'has' if len(missing) == 1 else 'have'} no confidence "
                    f"interval of the median at {MIN_CONFIDENCE:.0%} (written before dstc.report/6, or fewer than 5 "
                    f"repetitions): how much of the ratio is noise is unknown")
    low, high, confidence = spread
    interval = f"interval {low:.2f}-{high:.2f} (each median's at {confidence:.1%})"
    if low <= min(1, limit) and high > max(1, limit):
        raise InputError(f"the latency gate on {metric} cannot tell: the ratio to the baseline lies in {low:.2f}-"
                         f"{high:.2f} (each median's {confidence:.1%} interval), which holds both 1 (no change) and "
                         f"the far side of the limit {limit:g}; measure with more repetitions (dstc eval "
                         f"--repetitions), on a quieter machine, or both artifacts in one run (dstc compare)")
    warning = (f"{metric}: the ratio's {interval} straddles the limit {limit:g}: the verdict is within the noise"
               if low <= limit < high else "")
    return interval, warning


def _ratio_to(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _task_main_metric(report: Report, task: str) -> str | None:
    """The task's metric its drop is measured on: the first of the task's higher-is-better metrics."""
    return next((n for n, m in report.metrics.items() if n.startswith(f"{task}/") and not n.endswith("/drop")
                 and m.direction == "higher"), None)


def check_gates(report: Report, limits: GateLimits, baseline: Report | None = None) -> list[GateResult]:
    """Each set limit as a GateResult. Without a baseline, accuracy is judged against the report's own fp32
    reference; latency always needs a baseline (InputError otherwise), of the same model (check_baseline_model)."""
    other_machine = None
    if baseline is not None:
        check_baseline_model(measured_model(report), baseline, limits)
        other_machine = machine_difference(report, baseline)
        if other_machine and limits.max_latency_ratio is not None and not limits.allow_other_machine:
            raise InputError(f"the latency gate compares machines, not artifacts: {other_machine}. Gate latency "
                             f"against a baseline made on this machine (dstc compare runs both in one job), or say "
                             f"that another is meant (--allow-other-machine; allow_other_machine: true under gates)")
    results = []

    def gate(name: str, metric: str, value: float | None, limit: float, ok, detail: str, warning: str = "") -> None:
        if value is None:  # not measurable on this model: skipped if the limits allow it, never passed silently
            allowed = limits.allow_unmeasured
            verdict = "allowed" if allowed else "not allowed: set allow_unmeasured to skip it"
            results.append(GateResult(name=name, metric=metric, value=None, limit=limit, passed=allowed,
                                      skipped=True, detail=f"not measured on this model ({verdict})"))
            return
        results.append(GateResult(name=name, metric=metric, value=value, limit=limit,
                                  passed=bool(ok(value, limit)), detail=detail, warning=warning))

    at_most, at_least = (lambda v, lim: v <= lim), (lambda v, lim: v >= lim)
    # accuracy does not depend on the machine as latency does, but the detail says where the baseline came from
    against = ("baseline" + (f" (another machine: {other_machine})" if other_machine else "")) if baseline \
        else "fp32 reference"
    if limits.max_perplexity_increase is not None:
        if baseline:
            ratio = _ratio_to(report.value("perplexity"), baseline.value("perplexity"))
            value = None if ratio is None else ratio - 1
        else:
            value = report.value("perplexity_increase")
        gate("max_perplexity_increase", "perplexity_increase", value, limits.max_perplexity_increase, at_most,
             f"relative, vs the {against}")
    if limits.max_exact_match_drop is not None:
        if baseline:
            em, base = report.value("exact_match"), baseline.value("exact_match")
            value = None if em is None or base is None else 100 * (base - em)
        else:
            value = report.value("exact_match_drop")
        gate("max_exact_match_drop", "exact_match_drop", value, limits.max_exact_match_drop, at_most,
             f"points, vs the {against}")
    if limits.min_top1_agreement is not None:
        gate("min_top1_agreement", "top1_agreement", report.value("top1_agreement"), limits.min_top1_agreement,
             at_least, "vs the fp32 reference")
    if limits.max_kl_mean is not None:
        gate("max_kl_mean", "kl_mean", report.value("kl_mean"), limits.max_kl_mean, at_most,
             "nats, vs the fp32 reference")
    if limits.max_weight_error is not None:
        gate("max_weight_error", "max_weight_error", report.value("max_weight_error"), limits.max_weight_error,
             at_most, "relative, the worst compressed weight")
    if limits.max_task_drop is not None:
        drops = sorted(name for name in report.metrics if name.endswith("/drop"))
        if not drops:
            gate("max_task_drop", "<task>/drop", None, limits.max_task_drop, at_most, "")
        for name in drops:
            task = name[:-len("/drop")]
            if baseline:  # the same metric of the baseline's task: the one whose drop the report measured
                main = _task_main_metric(report, task)
                value, base = report.value(main) if main else None, baseline.value(main) if main else None
                drop = None if value is None or base is None else 100 * (base - value)
            else:
                drop = report.value(name)
            gate(f"max_task_drop ({task})", name, drop, limits.max_task_drop, at_most, f"points, vs the {against}")
    if limits.max_latency_ratio is not None:
        if baseline is None:
            raise InputError("the latency gate (max_latency_ratio) needs a baseline report")
        for metric in ("ttft_p50_ms", "itl_p50_ms"):
            interval, warning = _latency_gate(report, baseline, metric, limits.max_latency_ratio)
            gate(f"max_latency_ratio ({metric})", metric,
                 _ratio_to(report.value(metric), baseline.value(metric)), limits.max_latency_ratio, at_most,
                 f"ratio, vs the {against}" + (f"; {interval}" if interval else ""), warning)
    return results
