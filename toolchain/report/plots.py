"""SVG plots of one report or of several overlaid (one colour per report), as text to inline in HTML.

Each plot returns None when no report has its data (an fp32 build has no quantization error). Output is
deterministic: a fixed hash salt for SVG ids, no date or creator metadata. matplotlib is imported inside each
plot so that the CLI starts without it.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence

from toolchain.report.schema import HeadError, LayerError, Report

Labelled = Sequence[tuple[str, Report]]
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
WIDTH, HEIGHT = 8.0, 3.4  # inches; HTML scales the SVG to the page width


def labelled(reports: Report | Labelled) -> list[tuple[str, Report]]:
    """One report (labelled by its backend) or (label, report) pairs."""
    if isinstance(reports, Report):
        return [(str(reports.artifact.get("backend") or "report"), reports)]
    return list(reports)


def _colour(i: int) -> str:
    return COLOURS[i % len(COLOURS)]


def _figure(rows: int = 1, height: float = HEIGHT):
    from matplotlib.figure import Figure

    # no pyplot: no global figure state and no GUI backend, only the SVG canvas savefig picks
    fig = Figure(figsize=(WIDTH, height * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, axis="y", color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.spines[["top", "right"]].set_visible(False)
    return fig, list(axes)


_ID = re.compile(r'(\bid="|url\(#|href="#)')


def _svg(fig, name: str) -> str:
    """The figure as an <svg> element: no XML prolog (it is inlined), every id prefixed with the plot's name
    so that the plots of one HTML page never share an id (matplotlib numbers its groups figure_1, axes_1...)."""
    import matplotlib

    buf = io.StringIO()
    # a fixed salt: the ids of clip paths and markers are hashes, random per run without one
    with matplotlib.rc_context({"svg.hashsalt": "dstc", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    return _ID.sub(lambda m: f"{m.group(1)}{name}-", text[text.index("<svg"):])


def _legend(ax, labels: list[str]) -> None:
    from matplotlib.patches import Patch

    if len(labels) > 1:  # outside the axes, on the right: it never hides data
        ax.legend(handles=[Patch(color=_colour(i), label=label) for i, label in enumerate(labels)],
                  frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _offsets(n: int, width: float) -> list[float]:
    """x offsets of n side-by-side boxes or bars centred on a tick."""
    return [(j - (n - 1) / 2) * width for j in range(n)]


def _sparse_ticks(ax, positions: Sequence[float], labels: list[str], most: int = 24, axis: str = "x") -> None:
    """At most `most` labelled ticks (every n-th), so that 61 layers or 128 heads stay readable."""
    step = max(1, math.ceil(len(positions) / most))
    (ax.set_xticks if axis == "x" else ax.set_yticks)(positions[::step], labels[::step])


def _boxes(ax, groups: list[list[list[float]]], labels: list[str]) -> None:
    """Box plots, groups[g][r]: samples of report r at tick g; empty sample lists are left out."""
    n = len(labels)
    width = 0.8 / n
    offsets = _offsets(n, width)
    for r in range(n):
        data = [(g + offsets[r], groups[g][r]) for g in range(len(groups)) if groups[g][r]]
        if not data:
            continue
        colour = _colour(r)
        ax.boxplot([d for _, d in data], positions=[p for p, _ in data], widths=width * 0.85, patch_artist=True,
                   manage_ticks=False, boxprops=dict(facecolor=colour + "55", edgecolor=colour),
                   medianprops=dict(color=colour, linewidth=1.5), whiskerprops=dict(color=colour),
                   capprops=dict(color=colour), flierprops=dict(marker=".", markersize=3, markeredgecolor=colour))
    _legend(ax, labels)


def plain_number(value: float) -> str:
    """A tick label a reader takes in at once: 60, 0.25, 1500, and 1e-4 or 2e+06 outside [0.001, 100000)."""
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _log_axis(ax, axis: str = "y") -> None:
    """A log axis ticked with plain numbers (60, 1e-4), not matplotlib's default 6×10^1: matplotlib still chooses
    which ticks carry a label (every decade, and minor ticks where there are few decades)."""
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log", nonpositive="mask")
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_formatter(_plain_formatter())
    target.set_minor_formatter(_plain_formatter(minor=True))


def _plain_formatter(minor: bool = False):
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return plain_number(x)

    return Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)) if minor else Plain(labelOnlyBase=False)


def _log_if_wide(ax, values: list[float], ratio: float = 20.0) -> None:
    """A log y axis when the positive values span more than `ratio`; zero or negative values (a KL of exactly
    0) are then left out of the drawing."""
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > ratio:
        _log_axis(ax)


def _gate_limit(reports: list[tuple[str, Report]], name: str) -> tuple[float, bool] | None:
    """The limit of gate ``name`` and whether every report passed it, when the reports were gated by it with one
    limit (overlaid reports gated differently get no line: it would belong to one of them)."""
    gates = [g for _, r in reports for g in r.gates or [] if g.name == name]
    if not gates or len(gates) != len(reports) or len({g.limit for g in gates}) != 1:
        return None
    return gates[0].limit, all(g.passed for g in gates)


def _limit_line(ax, limit: float, passed: bool, text: str) -> None:
    """A gate's limit across the plot: dashed, red when a report failed it, labelled at the right end; the axis is
    widened to show it."""
    colour = "#1a7f37" if passed else "#cf222e"
    ax.axhline(limit, color=colour, linestyle="--", linewidth=1.1, zorder=3)
    ax.annotate(text, xy=(1.0, limit), xycoords=("axes fraction", "data"), xytext=(-2, 2),
                textcoords="offset points", ha="right", va="bottom", fontsize=7.5, color=colour,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1})
    low, high = ax.get_ylim()
    if limit > high:
        ax.set_ylim(low, limit * (1.3 if ax.get_yscale() == "log" else 1.08))


def _cases(reports: list[tuple[str, Report]]) -> list[tuple[int, int]]:
    return sorted({(c.prompt_length, c.batch) for _, r in reports for c in r.latency})


def _case_label(case: tuple[int, int]) -> str:
    return f"{case[0]}×{case[1]}"


def _latency_plot(reports: Report | Labelled, field: str, title: str, name: str) -> str | None:
    pairs = labelled(reports)
    cases = _cases(pairs)
    samples = [[next((list(getattr(c, field)) for c in r.latency if (c.prompt_length, c.batch) == case), [])
                 for _, r in pairs] for case in cases]
    flat = [v for group in samples for s in group for v in s]
    if not flat:
        return None
    fig, (ax,) = _figure()
    _boxes(ax, samples, [label for label, _ in pairs])
    ax.set_xticks(range(len(cases)), [_case_label(c) for c in cases])
    ax.set_xlabel("prompt length × batch")
    ax.set_ylabel("ms")
    ax.set_title(title, fontsize=10, loc="left")
    _log_if_wide(ax, flat)
    return _svg(fig, name)


def ttft_plot(reports: Report | Labelled) -> str | None:
    """Time to first token per (prompt length, batch): the distribution over repetitions."""
    return _latency_plot(reports, "ttft_ms", "Time to first token per repetition", "ttft")


def itl_plot(reports: Report | Labelled) -> str | None:
    """Inter-token latency per (prompt length, batch): every decode step of every repetition."""
    return _latency_plot(reports, "itl_ms", "Inter-token latency, every decode step", "itl")


def throughput_plot(reports: Report | Labelled) -> str | None:
    """Generated tokens per second per (prompt length, batch), one bar per report."""
    pairs = labelled(reports)
    cases = _cases(pairs)
    if not cases:
        return None
    fig, (ax,) = _figure()
    width = 0.8 / len(pairs)
    offsets = _offsets(len(pairs), width)
    for r, (_, report) in enumerate(pairs):
        by_case = {(c.prompt_length, c.batch): c.tokens_per_s for c in report.latency}
        xs = [i + offsets[r] for i, case in enumerate(cases) if case in by_case]
        bars = ax.bar(xs, [by_case[c] for c in cases if c in by_case], width * 0.9, color=_colour(r))
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    _legend(ax, [label for label, _ in pairs])
    ax.set_xticks(range(len(cases)), [_case_label(c) for c in cases])
    ax.set_xlabel("prompt length × batch")
    ax.set_ylabel("tokens/s")
    ax.set_title("Decode throughput (median over repetitions)", fontsize=10, loc="left")
    return _svg(fig, "throughput")


def kl_plot(reports: Report | Labelled) -> str | None:
    """Mean KL(reference ‖ artifact) at each position, one line per report."""
    pairs = [(label, r.series.kl_per_position) for label, r in labelled(reports)]
    if not any(kl for _, kl in pairs):
        return None
    fig, (ax,) = _figure()
    for r, (_, kl) in enumerate(pairs):
        if kl:
            ax.plot(range(len(kl)), kl, color=_colour(r), linewidth=1.2)
    _legend(ax, [label for label, _ in pairs])
    gate = _gate_limit(labelled(reports), "max_kl_mean")
    _log_if_wide(ax, [v for _, kl in pairs for v in kl] + ([gate[0]] if gate else []))
    if gate:  # the gate is on the mean over every scored token: its line beside each report's mean
        for r, (_, report) in enumerate(labelled(reports)):
            mean = report.value("kl_mean")
            if mean is not None and mean > 0:
                ax.axhline(mean, color=_colour(r), linestyle=":", linewidth=1)
        _limit_line(ax, gate[0], gate[1], f"gate max_kl_mean {plain_number(gate[0])} (dotted: mean KL)")
    ax.set_xlabel("position")
    ax.set_ylabel("nats")
    ax.set_title("KL divergence from the fp32 reference per position", fontsize=10, loc="left")
    return _svg(fig, "kl")


def _layer_key(layer: int | None) -> tuple[int, int]:
    # weights outside a numbered layer (embeddings, lm_head) go after the last layer
    return (1, 0) if layer is None else (0, layer)


def _layer_name(layer: int | None) -> str:
    return "other" if layer is None else str(layer)


def layer_error_plot(reports: Report | Labelled) -> str | None:
    """Quantization error of every weight, as a box per layer: output error and weight error, log scale."""
    pairs = labelled(reports)
    if not any(r.series.layer_errors for _, r in pairs):
        return None
    layers = sorted({e.layer for _, r in pairs for e in r.series.layer_errors}, key=_layer_key)
    panels: list[tuple[str, Callable[[LayerError], float | None]]] = [
        ("output error ‖XW−XŴ‖/‖XW‖", lambda e: e.output_error),
        ("weight error ‖W−Ŵ‖/‖W‖", lambda e: e.weight_error)]
    panels = [(t, get) for t, get in panels
              if any((get(e) or 0) > 0 for _, r in pairs for e in r.series.layer_errors)]
    if not panels:
        return None
    fig, axes = _figure(len(panels), height=2.8)
    for ax, (title, get) in zip(axes, panels):
        groups = [[[v for e in r.series.layer_errors if e.layer == layer and (v := get(e)) is not None and v > 0]
                   for _, r in pairs] for layer in layers]
        _boxes(ax, groups, [label for label, _ in pairs])
        _log_axis(ax)
        gate = _gate_limit(pairs, "max_weight_error") if title.startswith("weight") else None
        if gate:
            _limit_line(ax, gate[0], gate[1], f"gate max_weight_error {plain_number(gate[0])}")
        ax.set_title(f"Quantization {title}, per weight, by layer", fontsize=10, loc="left")
        _sparse_ticks(ax, list(range(len(layers))), [_layer_name(layer) for layer in layers])
    axes[-1].set_xlabel("layer")
    return _svg(fig, "layer-errors")


def layer_shares(report: Report) -> tuple[str, dict[int | None, float]]:
    """Each layer's share of the summed squared relative output error of the report's quantized weights (weight
    error where the output error was not measured), and which of the two it is. Relative output errors of the
    weights of a residual stack add roughly as variances, and a small output perturbation's KL grows with its
    square: the share estimates how much of the final KL each layer's quantization causes. An estimate from the
    compress stage's per-weight measurements, not a KL measured with one layer quantized at a time."""
    errors = report.series.layer_errors
    measured = any(e.output_error is not None for e in errors)
    sums: dict[int | None, float] = {}
    for e in errors:
        value = e.output_error if measured else e.weight_error
        if value is not None:
            sums[e.layer] = sums.get(e.layer, 0.0) + value * value
    total = sum(sums.values())
    if not total:
        return "", {}
    return ("output error" if measured else "weight error"), {k: v / total for k, v in sums.items()}


def layer_share_plot(reports: Report | Labelled) -> str | None:
    """layer_shares per layer, one bar per report."""
    pairs = [(label, *layer_shares(r)) for label, r in labelled(reports)]
    if not any(shares for _, _, shares in pairs):
        return None
    layers = sorted({k for _, _, shares in pairs for k in shares}, key=_layer_key)
    kinds = sorted({kind for _, kind, shares in pairs if shares})
    fig, (ax,) = _figure()
    width = 0.8 / len(pairs)
    offsets = _offsets(len(pairs), width)
    for r, (_, _, shares) in enumerate(pairs):
        xs = [i + offsets[r] for i, layer in enumerate(layers) if layer in shares]
        ax.bar(xs, [100 * shares[layer] for layer in layers if layer in shares], width * 0.9, color=_colour(r))
    _sparse_ticks(ax, list(range(len(layers))), [_layer_name(layer) for layer in layers])
    _legend(ax, [label for label, _, _ in pairs])
    ax.set_xlabel("layer")
    ax.set_ylabel("% of the total")
    ax.set_title(f"Share of the summed squared {' / '.join(kinds)} per layer (an estimate of its part in the "
                 "final KL)", fontsize=10, loc="left")
    return _svg(fig, "layer-shares")


def gate_plot(reports: Report | Labelled) -> str | None:
    """One report's gates: a row per measured gate, the value as a bar against its limit (dashed), green where it
    passed, red where it failed; each row on its own scale. None for several reports (their gates may differ)."""
    pairs = labelled(reports)
    if len(pairs) != 1:
        return None
    gates = [(g, g.value) for g in pairs[0][1].gates or [] if g.value is not None]
    if not gates:
        return None
    fig, axes = _figure(len(gates), height=0.62)
    for ax, (g, value) in zip(axes, gates):
        colour = "#1a7f37" if g.passed else "#cf222e"
        ax.grid(True, axis="x", color="#dddddd", linewidth=0.6)
        ax.grid(False, axis="y")
        ax.barh([0], [value], height=0.6, color=colour + "99", edgecolor=colour)
        ax.axvline(g.limit, color=colour, linestyle="--", linewidth=1.2)
        high = max(value, g.limit) * 1.15 or 1.0
        ax.set_xlim(min(0.0, value), high)
        ax.set_yticks([0], [g.name])
        ax.tick_params(axis="y", length=0, labelsize=8)
        ax.tick_params(axis="x", labelsize=7)
        sign = "≥" if g.name.startswith("min_") else "≤"
        ax.annotate(f"{plain_number(value)} {sign} {plain_number(g.limit)}: {'pass' if g.passed else 'FAIL'}",
                    xy=(1.0, 0.5), xycoords="axes fraction", xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8, color=colour)
    axes[0].set_title("Gates: each value (bar) against its limit (dashed line)", fontsize=10, loc="left")
    return _svg(fig, "gates")


def _head_value(e: HeadError) -> float:
    return e.output_error if e.output_error is not None else e.weight_error


def _head_means(errors: list[HeadError]) -> dict[tuple[int | None, int], float]:
    """(layer, head) -> mean error over that head's weights (q/k/v/o...)."""
    sums: dict[tuple[int | None, int], list[float]] = {}
    for e in errors:
        sums.setdefault((e.layer, e.head), []).append(_head_value(e))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def head_error_plot(reports: Report | Labelled) -> str | None:
    """Per-head quantization error (output error where measured, else weight error), mean over the head's
    weights: a layer × head heatmap for one report, one line per report over (layer, head) for several."""
    pairs = [(label, _head_means(r.series.head_errors)) for label, r in labelled(reports)]
    if not any(means for _, means in pairs):
        return None
    keys = sorted({k for _, means in pairs for k in means}, key=lambda k: (_layer_key(k[0]), k[1]))
    layers = sorted({k[0] for k in keys}, key=_layer_key)
    heads = sorted({k[1] for k in keys})
    if len(pairs) == 1:
        return _head_heatmap(pairs[0][1], layers, heads)
    fig, (ax,) = _figure()
    for r, (_, means) in enumerate(pairs):
        # a marker per head only while there are few: thousands of them bloat the SVG and hide the line
        ax.plot(range(len(keys)), [means.get(k, math.nan) for k in keys], color=_colour(r), linewidth=1,
                marker="." if len(keys) <= 256 else None, markersize=3)
    starts = [i for i, k in enumerate(keys) if i == 0 or keys[i - 1][0] != k[0]]
    for i in starts[1:]:
        ax.axvline(i - 0.5, color="#cccccc", linewidth=0.6)
    _sparse_ticks(ax, starts, [_layer_name(keys[i][0]) for i in starts])
    _log_axis(ax)
    _legend(ax, [label for label, _ in pairs])
    ax.set_xlabel("layer (heads within each layer, in order)")
    ax.set_title("Quantization error per attention head", fontsize=10, loc="left")
    return _svg(fig, "head-errors")


def _head_heatmap(means: dict[tuple[int | None, int], float], layers: list[int | None], heads: list[int]) -> str:
    from matplotlib.colors import LogNorm

    grid = [[means.get((layer, head), math.nan) for head in heads] for layer in layers]
    values = [v for v in means.values() if v > 0]
    fig, (ax,) = _figure(height=min(6.0, max(2.6, 1.2 + 0.25 * len(layers))))
    ax.grid(False)
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest",
                      norm=LogNorm(min(values), max(values)) if values else None)
    bar = fig.colorbar(image, ax=ax, label="relative error")
    if values:
        bar.ax.yaxis.set_major_formatter(_plain_formatter())
        bar.ax.yaxis.set_minor_formatter(_plain_formatter(minor=True))
    _sparse_ticks(ax, list(range(len(heads))), [str(h) for h in heads], most=16)
    _sparse_ticks(ax, list(range(len(layers))), [_layer_name(layer) for layer in layers], axis="y")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title("Quantization error per attention head (mean over the head's weights)", fontsize=10, loc="left")
    return _svg(fig, "head-errors")


def _layer_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def routing_plot(reports: Report | Labelled) -> str | None:
    """Routing agreement (share of tokens whose expert set is unchanged) per MoE layer, one bar per report."""
    pairs = [(label, r.series.routing_agreement_per_layer) for label, r in labelled(reports)]
    layers = sorted({k for _, d in pairs for k in d}, key=_layer_order)
    if not layers:
        return None
    fig, (ax,) = _figure()
    width = 0.8 / len(pairs)
    offsets = _offsets(len(pairs), width)
    for r, (_, agreement) in enumerate(pairs):
        xs = [i + offsets[r] for i, layer in enumerate(layers) if layer in agreement]
        ax.bar(xs, [agreement[layer] for layer in layers if layer in agreement], width * 0.9, color=_colour(r))
    lowest = min(v for _, d in pairs for v in d.values())
    # agreement sits near 1: start the axis just below the lowest bar so that differences show
    ax.set_ylim(max(0.0, lowest - max(0.02, (1 - lowest) * 0.5)), 1.0)
    _sparse_ticks(ax, list(range(len(layers))), layers)
    _legend(ax, [label for label, _ in pairs])
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("agreement")
    ax.set_title("Routing agreement per MoE layer (axis does not start at 0)", fontsize=10, loc="left")
    return _svg(fig, "routing")


PLOTS: tuple[tuple[str, str, Callable[[Report | Labelled], str | None]], ...] = (
    ("gates", "Gates against their limits", gate_plot),
    ("accuracy", "KL per position", kl_plot),
    ("accuracy", "Routing agreement", routing_plot),
    ("latency", "Time to first token", ttft_plot),
    ("latency", "Inter-token latency", itl_plot),
    ("latency", "Throughput", throughput_plot),
    ("quantization", "Each layer's share of the quantization error", layer_share_plot),
    ("quantization", "Quantization error per layer", layer_error_plot),
    ("quantization", "Quantization error per head", head_error_plot),
)


def all_plots(reports: Report | Labelled) -> dict[str, list[tuple[str, str]]]:
    """Section ("gates", "accuracy", "latency", "quantization") -> [(title, svg)] of every plot that has data."""
    sections: dict[str, list[tuple[str, str]]] = {}
    for section, title, plot in PLOTS:
        svg = plot(reports)
        if svg is not None:
            sections.setdefault(section, []).append((title, svg))
    return sections
