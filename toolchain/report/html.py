"""report.html: one self-contained page (inline CSS and SVG, no script, nothing fetched) with the tables of
report.md and the plots; also the page frame and table markup that the comparison page reuses."""

from __future__ import annotations

import re
from html import escape

from toolchain.report.markdown import (
    Table,
    facts,
    gate_table,
    latency_table,
    metric_groups,
    metrics_table,
    settings_rows,
    title,
    verdict,
    worst_weights_table,
)
from toolchain.report.plots import all_plots, layer_shares
from toolchain.report.schema import Report

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2330;margin:0;background:#f5f6f8}
main{max-width:1080px;margin:0 auto;padding:24px 28px 48px;background:#fff;min-height:100vh}
h1{font-size:22px;margin:0 0 6px}
h2{font-size:17px;margin:30px 0 10px;border-bottom:1px solid #e3e6eb;padding-bottom:4px}
.settings{color:#4a5263;margin:4px 0 10px}
.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:0;font-size:12.5px;color:#4a5263}
.facts dt{font-weight:600}.facts dd{margin:0;overflow-wrap:anywhere}
.badge{display:inline-block;padding:2px 12px;border-radius:12px;font-size:14px;font-weight:700;color:#fff;
vertical-align:middle;margin-left:10px}
.badge.PASS{background:#1a7f37}.badge.FAIL{background:#cf222e}
table{border-collapse:collapse;margin:8px 0 14px;font-size:13px;width:100%}
th,td{padding:4px 10px;border-bottom:1px solid #eceef1;text-align:left;vertical-align:top}
th{background:#f0f2f5;font-weight:600;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.note{color:#6a7282;font-size:12px}
tr.PASS td:first-child{border-left:4px solid #1a7f37}tr.FAIL td:first-child{border-left:4px solid #cf222e}
tr.FAIL{background:#fff1f0}td.best{font-weight:700;color:#1a7f37}
figure.plot{margin:10px 0 18px}figure.plot svg{width:100%;height:auto;display:block}
details{margin-top:24px;font-size:12.5px;color:#4a5263}
"""
# a cell that is a formatted number (or "n/a" in a numeric column), with its interval and ratio, right-aligned
_NUMBER = re.compile(r"^(n/a|[-+]?[\d,]*\.?\d+(e[-+]?\d+)?( \[[\d.,e+-]+\])?( \(×[\d.,e+-]+\))?|[\d,.]+ \+ \d+)$")


def page(heading: str, body: str, badge: str | None = None) -> str:
    """A whole HTML document around `body`, with a PASS / FAIL badge beside the heading when given."""
    badge_html = f'<span class="badge {badge}">{badge}</span>' if badge else ""
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{escape(heading)}</title>\n'
            f"<style>{CSS}</style>\n</head>\n<body>\n<main>\n<h1>{escape(heading)}{badge_html}</h1>\n{body}\n"
            f"</main>\n</body>\n</html>\n")


def html_table(table: Table, row_classes: list[str] | None = None, cell_classes: list[list[str]] | None = None,
               note_columns: tuple[str, ...] = ("description", "detail")) -> str:
    """A table; cells holding numbers are right-aligned, free-text columns are set small."""
    header, rows = table
    notes = {i for i, h in enumerate(header) if h in note_columns}
    out = ["<table>", "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"]
    for r, row in enumerate(rows):
        cls = f' class="{row_classes[r]}"' if row_classes else ""
        cells = []
        for c, text in enumerate(row):
            classes = ["num"] if _NUMBER.match(text) else ["note"] if c in notes else []
            if cell_classes and cell_classes[r][c]:
                classes.append(cell_classes[r][c])
            attr = f' class="{" ".join(classes)}"' if classes else ""
            cells.append(f"<td{attr}>{escape(text)}</td>")
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def figures(plots: list[tuple[str, str]]) -> str:
    """(title, svg) plots as figures, the SVG inline."""
    return "\n".join(f'<figure class="plot" aria-label="{escape(t)}">\n{svg}</figure>' for t, svg in plots)


def facts_list(pairs: list[tuple[str, str]]) -> str:
    """(label, text) pairs as a two-column definition list."""
    items = "".join(f"<dt>{escape(label)}</dt><dd>{escape(text)}</dd>" for label, text in pairs)
    return f'<dl class="facts">{items}</dl>'


def _layer_share_note(report: Report) -> str:
    """What the per-layer share plot shows and how it was estimated, with the layers that lead it."""
    kind, shares = layer_shares(report)
    if not shares:
        return ""
    top = sorted(shares.items(), key=lambda item: -item[1])[:3]
    leading = ", ".join(f"{'other (embedding, lm_head)' if layer is None else f'layer {layer}'} "
                        f"{100 * share:.0f} %" for layer, share in top)
    return (f'<p class="settings">Which layers contribute most to the final KL, estimated: each layer\'s share of '
            f"the sum over every quantized weight of its squared relative {escape(kind)} (the compress stage's "
            f"per-weight measurements; small errors of a residual stack add as variances, and KL grows with their "
            f"square; a routed expert counts as one weight, though only the tokens routed to it see its error). Not a "
            f"KL measured with one layer quantized at a time. Leading: {escape(leading)}.</p>")


def render_html(report: Report) -> str:
    """report.html: verdict badge, gates, metric tables, latency per case and every plot that has data."""
    plots = all_plots(report)
    info = facts(report)
    main_facts = [(k, v) for k, v in info if k in ("artifact", "reference", "machine")]
    rows = settings_rows(report)
    body = [facts_list(main_facts),
            f"<details><summary>Settings ({len(rows)})</summary>{html_table((['setting', 'value'], rows))}</details>"
            if rows else ""]
    if report.gates:
        body += ["<h2>Gates</h2>", html_table(gate_table(report), row_classes=[
            ("SKIPPED" if g.skipped and g.passed else "PASS" if g.passed else "FAIL") for g in report.gates]),
                 figures(plots.get("gates", []))]
    groups = dict(metric_groups(report))
    accuracy, speed = groups.get("Accuracy", []), groups.get("Speed and size", [])
    if accuracy or "accuracy" in plots:
        body += ["<h2>Accuracy</h2>", html_table(metrics_table(report, accuracy)) if accuracy else "",
                 figures(plots.get("accuracy", []))]
    if speed:
        body += ["<h2>Speed and size</h2>", html_table(metrics_table(report, speed))]
    if report.latency:
        body += ["<h2>Latency per case</h2>", html_table(latency_table(report)), figures(plots.get("latency", []))]
    if report.series.layer_errors or report.series.head_errors:
        body.append("<h2>Quantization error</h2>")
        if report.series.layer_errors:
            body += ["<p>Weights with the largest output error:</p>", html_table(worst_weights_table(report))]
            body.append(_layer_share_note(report))
        body.append(figures(plots.get("quantization", [])))
    rest = [(k, v) for k, v in info if (k, v) not in main_facts]
    if rest:
        body.append(f"<details><summary>Environment</summary>{facts_list(rest)}</details>")
    return page(title(report), "\n".join(b for b in body if b), verdict(report))
