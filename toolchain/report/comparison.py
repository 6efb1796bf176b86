"""Several reports side by side (typically one recipe built for ONNX Runtime and for OpenVINO): every metric and
every latency case with its ratio to the first report and the better report by the metric's direction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

from toolchain.report.html import facts_list, figures, html_table, page
from toolchain.report.markdown import Table, fmt, markdown_table, ordered_metrics, percentile, title, verdict
from toolchain.report.plots import all_plots
from toolchain.report.schema import Direction, Interval, LatencyCase, Report

# per latency case: (row name, unit, direction, value of the case, its confidence interval)
CASE_METRICS: tuple[tuple[str, str, Direction, Callable[[LatencyCase], float | None],
                          Callable[[LatencyCase], Interval | None]], ...] = (
    ("ttft_p50_ms", "ms", "lower", lambda c: percentile(c.ttft_ms, 50), lambda c: c.ttft_p50_interval_ms),
    ("itl_p50_ms", "ms", "lower", lambda c: percentile(c.itl_ms, 50), lambda c: c.itl_p50_interval_ms),
    ("tokens_per_s", "tokens/s", "higher", lambda c: c.tokens_per_s, lambda c: None))
PLOT_SECTIONS = (("accuracy", "Accuracy"), ("latency", "Latency"), ("quantization", "Quantization error"))


def _ratios(values: list[float | None]) -> list[float | None]:
    base = values[0]
    if base is None or base == 0:
        return [None] * len(values)
    return [None if v is None else v / base for v in values]


def _better(values: list[float | None], direction: Direction, labels: list[str], unit: str) -> str | None:
    """The label of the best value; None with no direction, fewer than two values or a tie for best, where values
    that read the same as shown (3.75 and 3.75) are a tie: no winner the reader cannot see."""
    present = [(v, label) for v, label in zip(values, labels) if v is not None]
    if direction == "none" or len(present) < 2:
        return None
    best = (min if direction == "lower" else max)(v for v, _ in present)
    winners = [label for v, label in present if fmt(v, unit) == fmt(best, unit)]
    return winners[0] if len(winners) == 1 else None


def _row(metric: str, case: dict | None, unit: str, direction: Direction, description: str,
         values: list[float | None], intervals: list[Interval | None], labels: list[str]) -> dict:
    return dict(metric=metric, case=case, unit=unit, direction=direction, description=description, values=values,
                intervals=[None if i is None else i.model_dump() for i in intervals], ratios=_ratios(values),
                better=_better(values, direction, labels, unit))


def differences(facts: Sequence[dict[str, str]], reports: list[Report]) -> list[tuple[str, list[str]]]:
    """What differs between the artifacts besides the figures: each build fact (compression, method, MoE lowering,
    cache) whose value is not the same for all, then the machine each was measured on when that differs."""
    rows = []
    for key in dict.fromkeys(k for f in facts for k in f if k != "backend"):  # the runtime: the labels say it
        values = [f.get(key, "") for f in facts]
        if len(set(values)) > 1:
            rows.append((key, values))
    machines = [f"{r.environment.cpu.model or r.environment.cpu.architecture}, {r.environment.threads} threads"
                for r in reports]
    if len(set(machines)) > 1:
        rows.append(("measured on", machines))
    return rows


def _environment(reports: list[Report]) -> str:
    """The CPU and threads the figures were measured with, and how the latency runs were ordered."""
    first = reports[0].environment
    text = (f"Measured on {first.cpu.model or first.cpu.architecture} ({first.cores} cores), "
            f"{first.threads} threads" + ("" if len({(r.environment.cpu.model, r.environment.threads)
                                                      for r in reports}) == 1 else "; the others differ: below"))
    timed = [r for r in reports if r.latency]
    if len(timed) > 1:
        text += ("; latency timed in interleaved rounds (each round one run of every case of each artifact in turn)"
                 if all(r.settings.get("latency_interleaved") for r in timed) else
                 "; latency timed one artifact after the other, not interleaved")
    return text


def comparison_rows(reports: list[Report], labels: list[str]) -> list[dict]:
    """One JSON-able row per metric (any report has it), then per latency case x (TTFT p50, ITL p50, tokens/s):
    {metric, case, unit, direction, description, values, intervals (each median's confidence interval, or None),
    ratios (value_i / value_0), better (label or None)}."""
    if len(reports) != len(labels) or not reports:
        raise ValueError(f"{len(reports)} reports for {len(labels)} labels")
    rows = []
    for name in ordered_metrics({n for r in reports for n in r.metrics}):
        first = next(r.metrics[name] for r in reports if name in r.metrics)
        rows.append(_row(name, None, first.unit, first.direction, first.description,
                         [r.value(name) for r in reports],
                         [r.metrics[name].interval if name in r.metrics else None for r in reports], labels))
    cases = sorted({(c.prompt_length, c.batch) for r in reports for c in r.latency})
    for prompt_length, batch in cases:
        found = [next((c for c in r.latency if (c.prompt_length, c.batch) == (prompt_length, batch)), None)
                 for r in reports]
        for name, unit, direction, get, spread in CASE_METRICS:
            rows.append(_row(name, {"prompt_length": prompt_length, "batch": batch}, unit, direction,
                             f"{name} at prompt length {prompt_length}, batch {batch}",
                             [None if c is None else get(c) for c in found],
                             [None if c is None else spread(c) for c in found], labels))
    return rows


def _ratio(r: float | None) -> str:
    if r is None:
        return ""
    if abs(r) < 100:
        return f" (×{r:.2f})"
    return f" (×{r:,.0f})" if abs(r) < 1e4 else f" (×{r:.1e})"


def _spread(interval: dict | None, unit: str) -> str:
    return "" if interval is None else f" [{fmt(interval['low'], unit)}-{fmt(interval['high'], unit)}]"


def comparison_table(reports: list[Report], labels: list[str]) -> tuple[Table, list[list[str]]]:
    """The rows as formatted cells (value, and its ratio to the first report after the first column) and the
    cell classes that mark each row's best value."""
    header = ["metric", "unit", *labels, "better"]
    rows, classes = [], []
    for row in comparison_rows(reports, labels):
        case = row["case"]
        name = row["metric"] if case is None else f"{row['metric']} @ {case['prompt_length']}×{case['batch']}"
        cells = [fmt(v, row["unit"]) + _spread(spread, row["unit"]) + (_ratio(r) if i else "")
                 for i, (v, spread, r) in enumerate(zip(row["values"], row["intervals"], row["ratios"]))]
        rows.append([name, row["unit"], *cells, row["better"] or ""])
        classes.append(["", "", *("best" if label == row["better"] else "" for label in labels), ""])
    return (header, rows), classes


def render_comparison_text(reports: list[Report], labels: list[str],
                           facts: Sequence[dict[str, str]] = ()) -> str:
    """An aligned plain-text table for the terminal, numbers right-aligned, after what else differs between the
    artifacts (``facts``: each one's build facts, toolchain/evaluate/compare.py build_facts)."""
    (header, rows), _ = comparison_table(reports, labels)
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    numeric = set(range(2, 2 + len(labels)))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    width = max(len(label) for label in labels)
    heads = [f"{label:<{width}}  {title(r)}" for label, r in zip(labels, reports)]
    differ = differences(facts, reports)
    if differ:
        key_width = max(len(k) for k, _ in differ)
        heads += ["", "Besides the runtime, the artifacts differ in:",
                  *(f"  {k:<{key_width}}  " + " | ".join(f"{label}: {v}" for label, v in zip(labels, values))
                    for k, values in differ)]
    heads += ["", _environment(reports) + "; a better value is named only where the values differ as shown."]
    return "\n".join([*heads, "", line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _report_lines(reports: list[Report], labels: list[str]) -> list[tuple[str, str]]:
    return [(label, title(r) + (f" · gates {verdict(r)}" if r.gates else "")) for label, r in zip(labels, reports)]


def render_comparison_markdown(reports: list[Report], labels: list[str],
                               facts: Sequence[dict[str, str]] = ()) -> str:
    """The comparison as Markdown: the reports compared, what else differs, then the table with each row's best
    value in bold."""
    (header, rows), classes = comparison_table(reports, labels)
    bold = [[f"**{c}**" if cls == "best" else c for c, cls in zip(row, row_cls)] for row, row_cls in zip(rows, classes)]
    listing = "\n".join(f"- {label}: {text}" for label, text in _report_lines(reports, labels))
    differ = differences(facts, reports)
    table = markdown_table((["differs", *labels], [[k, *v] for k, v in differ])) + "\n\n" if differ else ""
    return (f"# Comparison: {' vs '.join(labels)}\n\n{listing}\n\n{_environment(reports)}.\n\n{table}"
            f"{markdown_table((header, bold))}\n")


def render_comparison_html(reports: list[Report], labels: list[str], facts: Sequence[dict[str, str]] = ()) -> str:
    """A self-contained page: the reports compared, what else differs between the artifacts, the table (best
    values marked) and the overlaid plots."""
    table, classes = comparison_table(reports, labels)
    plots = all_plots(list(zip(labels, reports)))
    body = [facts_list(_report_lines(reports, labels)), f'<p class="settings">{escape(_environment(reports))}.</p>']
    differ = differences(facts, reports)
    if differ:
        body += ["<h2>Besides the runtime, the artifacts differ in</h2>",
                 html_table((["", *labels], [[k, *v] for k, v in differ]))]
    body += ["<h2>Metrics</h2>", html_table(table, cell_classes=classes),
             '<p class="settings">Ratios are to the first report; the better value by each metric\'s direction is '
             "in bold, where the values differ as shown; [low-high]: a median's confidence interval, from one "
             "value per repetition.</p>"]
    for key, heading in PLOT_SECTIONS:
        if plots.get(key):
            body += [f"<h2>{escape(heading)}</h2>", figures(plots[key])]
    return page(f"Comparison: {' vs '.join(labels)}", "\n".join(body))
