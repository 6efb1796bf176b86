"""A report as text: the tables (as rows of formatted cells, shared with the HTML page), report.md, and the short
terminal summary printed at the end of `dstc build` / `dstc eval`.

Metrics are rendered from their unit, direction and description alone; names only decide the order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from toolchain.hardware import cpu_line
from toolchain.report.schema import Interval, LatencyCase, Report

# the order readers expect; a metric not listed follows, alphabetically
ORDER = ("perplexity", "perplexity_increase", "exact_match", "exact_match_drop", "kl_mean", "kl_max",
         "top1_agreement", "greedy_match_rate", "routing_agreement", "load_time_s", "ttft_p50_ms", "ttft_p90_ms",
         "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "tokens_per_s", "peak_rss_mb", "model_size_mb")
SPEED_UNITS = frozenset({"ms", "s", "tokens/s", "MB"})  # metrics in these units are speed and size, not accuracy
METRIC_HEADER = ("metric", "value", "reference", "unit", "better", "description")
INTERVAL = "interval (confidence)"  # a column beside the value, in a table where a metric has one
LATENCY_HEADER = ("prompt", "batch", "new tokens", "TTFT p50 (ms)", f"TTFT p50 {INTERVAL}", "TTFT p90 (ms)",
                  "TTFT p99 (ms)", "ITL p50 (ms)", f"ITL p50 {INTERVAL}", "ITL p90 (ms)", "tokens/s",
                  "warm-up + reps")
GATE_HEADER = ("gate", "metric", "value", "limit", "result", "detail")
WEIGHT_HEADER = ("weight", "layer", "precision", "output error", "weight error")
Table = tuple[Sequence[str], list[list[str]]]


def fmt(value: float | None, unit: str = "") -> str:
    """A number for people: ms, tokens/s and MB with one decimal, shares with three, else 3 significant digits."""
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return str(value)
    small = value != 0 and abs(value) < 0.01
    if unit in ("ms", "tokens/s", "MB") and not small:
        return f"{value:,.1f}"
    if unit == "ratio" and not small:
        return f"{value:.3f}"
    if unit == "points" and not small:
        return f"{value:.2f}"
    if value == 0:
        return "0"
    if small:
        return f"{value:.2e}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not samples:
        return None
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ordered_metrics(names) -> list[str]:
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(ORDER)), n))


def metric_groups(report: Report) -> list[tuple[str, list[str]]]:
    """("Accuracy", names), ("Speed and size", names), each in reading order; empty groups left out."""
    names = ordered_metrics(report.metrics)
    groups = [("Accuracy", [n for n in names if report.metrics[n].unit not in SPEED_UNITS]),
              ("Speed and size", [n for n in names if report.metrics[n].unit in SPEED_UNITS])]
    return [(title, group) for title, group in groups if group]


def interval_text(interval: Interval | None, unit: str = "ms") -> str:
    """A median's confidence interval and its confidence, e.g. "9.1-10.8 (93.8 %)"; "" without one."""
    if interval is None:
        return ""
    return f"{fmt(interval.low, unit)}-{fmt(interval.high, unit)} ({100 * interval.confidence:.1f} %)"


def metrics_table(report: Report, names: list[str]) -> Table:
    """The metrics' rows; with an interval column after the value when one of them has an interval."""
    intervals = any(report.metrics[name].interval is not None for name in names)
    rows = []
    for name in names:
        m = report.metrics[name]
        rows.append([name, fmt(m.value, m.unit), *([interval_text(m.interval, m.unit)] if intervals else []),
                     "" if m.reference is None else fmt(m.reference, m.unit), m.unit,
                     "" if m.direction == "none" else m.direction, m.description])
    return ((*METRIC_HEADER[:2], INTERVAL, *METRIC_HEADER[2:]) if intervals else METRIC_HEADER), rows


def latency_row(case: LatencyCase) -> list[str]:
    ttft = [fmt(percentile(case.ttft_ms, q), "ms") for q in (50, 90, 99)]
    itl = [fmt(percentile(case.itl_ms, q), "ms") for q in (50, 90)]
    return [str(case.prompt_length), str(case.batch), str(case.new_tokens), ttft[0],
            interval_text(case.ttft_p50_interval_ms), *ttft[1:], itl[0], interval_text(case.itl_p50_interval_ms),
            itl[1], fmt(case.tokens_per_s, "tokens/s"), f"{case.warmup} + {case.repetitions}"]


def latency_table(report: Report) -> Table:
    cases = sorted(report.latency, key=lambda c: (c.prompt_length, c.batch))
    return LATENCY_HEADER, [latency_row(c) for c in cases]


def _unit(report: Report, metric: str) -> str:
    return report.metrics[metric].unit if metric in report.metrics else ""


def gate_table(report: Report) -> Table:
    rows = []
    for g in report.gates or []:
        unit = _unit(report, g.metric)
        status = "SKIPPED" if g.skipped and g.passed else "PASS" if g.passed else "FAIL"
        rows.append([g.name, g.metric, fmt(g.value, unit), fmt(g.limit, unit), status, g.detail])
    return GATE_HEADER, rows


def worst_weights_table(report: Report, count: int = 5) -> Table:
    """The weights with the largest output error (weight error where output error was not measured)."""
    errors = sorted(report.series.layer_errors, key=lambda e: (e.output_error is not None,
                                                               e.output_error or 0.0, e.weight_error), reverse=True)
    rows = [[e.weight, "" if e.layer is None else str(e.layer), e.precision, fmt(e.output_error),
             fmt(e.weight_error)] for e in errors[:count]]
    return WEIGHT_HEADER, rows


def verdict(report: Report) -> str | None:
    """PASS or FAIL when the report has gates, else None."""
    if not report.gates:
        return None
    return "PASS" if all(g.passed for g in report.gates) else "FAIL"


def _plain(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(_plain(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_plain(v)}" for k, v in value.items())
    return str(value)


def title(report: Report) -> str:
    a = report.artifact
    return f"{a.get('recipe') or a.get('path', 'artifact')}: {a.get('model', '?')} on {a.get('backend', '?')}"


def settings_items(report: Report) -> list[str]:
    """Threads (the number used, from the environment), then every setting that has a value (warm-up,
    repetitions, prompt lengths, ...) in the report's own order."""
    threads = report.environment.threads or report.settings.get("threads")
    items = {"threads": threads, **{k: v for k, v in report.settings.items() if k != "threads"}}
    return [f"{k.replace('_', ' ')} {_plain(v)}" for k, v in items.items() if v not in (None, "", [], {})]


def settings_line(report: Report) -> str:
    return " · ".join(settings_items(report))


def settings_rows(report: Report) -> list[list[str]]:
    """The settings as (name, value) rows, for a table a reader scans by name."""
    threads = report.environment.threads or report.settings.get("threads")
    items = {"threads": threads, **{k: v for k, v in report.settings.items() if k != "threads"}}
    return [[k.replace("_", " "), _plain(v)] for k, v in items.items() if v not in (None, "", [], {})]


def facts(report: Report) -> list[tuple[str, str]]:
    """(label, text) lines about the artifact, the reference and the machine."""
    a, env = report.artifact, report.environment
    size = f"{a['size_bytes'] / 1e6:,.1f} MB" if isinstance(a.get("size_bytes"), (int, float)) else ""
    sha = str(a.get("manifest_digest") or a.get("manifest_sha256") or "")[:12]
    artifact = (str(a.get("path", "")), size, f"manifest {sha}" if sha else "")
    cpu = cpu_line(env.cpu.model_dump())
    machine = (f"host {env.host}" if env.host else "", f"cpu {cpu}" if cpu else "",
               f"cores {env.cores}" if env.cores else "")
    lines = [("artifact", " · ".join(x for x in artifact if x)),
             ("reference", " · ".join(_plain(v) for v in report.reference.values())),
             ("machine", " · ".join(x for x in machine if x))]
    lines += [(k.replace("_", " "), _plain(v)) for k, v in (("runtime_config", env.runtime_config),
                                                            ("versions", env.versions)) if v]
    return [(label, text) for label, text in lines if text]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(table: Table) -> str:
    header, rows = table
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: Report) -> str:
    """report.md: title, settings, metric tables, latency per case, gates and the worst-quantized weights."""
    parts = [f"# {title(report)}", settings_line(report),
             "\n".join(f"- {label}: {text}" for label, text in facts(report))]
    if report.gates:
        parts += [f"## Gates: {verdict(report)}", markdown_table(gate_table(report))]
    for heading, names in metric_groups(report):
        parts += [f"## {heading}", markdown_table(metrics_table(report, names))]
    if report.latency:
        parts += ["## Latency per case", markdown_table(latency_table(report))]
    if report.series.layer_errors:
        parts += ["## Largest quantization error", markdown_table(worst_weights_table(report))]
    return "\n\n".join(parts) + "\n"


def _summary_item(report: Report, name: str) -> str:
    m = report.metrics[name]
    unit = "" if m.unit in ("", "ratio") else f" {m.unit}"
    ref = "" if m.reference is None else f" (ref {fmt(m.reference, m.unit)})"
    spread = "" if m.interval is None else f" [{fmt(m.interval.low, m.unit)}-{fmt(m.interval.high, m.unit)}]"
    return f"{name} {fmt(m.value, m.unit)}{unit}{spread}{ref}"


def _wrapped(label: str, items: list[str], max_lines: int, width: int = 100) -> list[str]:
    """Items joined by " · " on lines of at most `width` (an item is never split), the first line labelled;
    past max_lines the rest is cut and marked with "…"."""
    if not items:
        return []
    lines: list[list[str]] = [[]]
    for item in items:
        if lines[-1] and len(" · ".join([*lines[-1], item])) > width - 10:
            lines.append([])
        lines[-1].append(item)
    text = [f"{label if i == 0 else '':<10}" + " · ".join(line) for i, line in enumerate(lines)]
    return text if len(text) <= max_lines else [*text[:max_lines - 1], text[max_lines - 1] + " …"]


DERIVED = ("perplexity_increase", "exact_match_drop")


def summary_settings(report: Report) -> list[str]:
    """The settings one needs to read the numbers: threads, data sizes, latency cases and repetitions."""
    s, threads = report.settings, report.environment.threads or report.settings.get("threads")
    data = s.get("data") or {}  # what was scored, which the settings only bound (e.g. a short --dataset)
    if "windows" in data:
        scored = [f"{data['windows']} windows of {data['window']} tokens"]
    else:
        scored = [f"{data.get('texts', s.get('texts'))} texts" if data.get("texts", s.get("texts")) else ""]
    problems = data.get("problems", s.get("problems"))
    items = [f"{threads} threads" if threads else "", *scored,
             f"{problems} problems" if s.get("task") and problems else ""]
    if report.latency:
        lengths = "/".join(str(n) for n in sorted({c.prompt_length for c in report.latency}))
        batches = "/".join(str(n) for n in sorted({c.batch for c in report.latency}))
        first = report.latency[0]
        items += [f"prompts {lengths} x batch {batches}, {first.new_tokens} new tokens",
                  f"{first.warmup} warm-up + {first.repetitions} runs each"]
    return [item for item in items if item]


def render_summary(report: Report) -> str:
    """At most 12 lines for the terminal: accuracy against the reference, speed and size, gate verdicts."""
    lines = [title(report), *_wrapped("measured", summary_settings(report), 2)]
    for (heading, names), max_lines in zip(metric_groups(report), (4, 3)):
        # the reference's value is shown beside each metric, so the derived increase/drop metrics are left out
        items = [_summary_item(report, n) for n in names
                 if report.metrics[n].value is not None and n not in DERIVED]
        if items:
            lines += _wrapped(heading.split()[0].lower(), items, max_lines)
    if report.gates:
        failed = [f"{g.name} {fmt(g.value, _unit(report, g.metric))} (limit {fmt(g.limit, _unit(report, g.metric))})"
                  for g in report.gates if not g.passed]
        passed = sum(g.passed for g in report.gates)
        lines += _wrapped("gates", [f"{verdict(report)} {passed}/{len(report.gates)} passed", *failed], 2)
    return "\n".join(lines)
