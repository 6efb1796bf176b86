"""Rendering of report.json into Markdown, HTML, SVG plots and comparisons, on synthetic reports."""

from __future__ import annotations

import random
import re

import pytest

from toolchain.report.comparison import (comparison_rows, render_comparison_html, render_comparison_markdown,
                                         render_comparison_text)
from toolchain.report.html import render_html
from toolchain.report.markdown import fmt, percentile, render_markdown, render_summary
from toolchain.report.plots import PLOTS, all_plots
from toolchain.report.schema import (Environment, GateResult, HeadError, Interval, LatencyCase, LayerError, Metric,
                                     Report, Series)

ACCURACY = {  # name: (unit, direction, onnxruntime value, openvino value, reference)
    "perplexity": ("", "lower", 3.79, 3.81, 3.75),
    "perplexity_increase": ("ratio", "lower", 0.0107, 0.016, None),
    "exact_match": ("ratio", "higher", 0.994, 0.99, 1.0),
    "exact_match_drop": ("points", "lower", 0.6, 1.0, None),
    "kl_mean": ("nats", "lower", 1.234e-4, 2.5e-4, None),
    "kl_max": ("nats", "lower", 0.0312, 0.05, None),
    "top1_agreement": ("ratio", "higher", 0.998, 0.997, None),
    "greedy_match_rate": ("ratio", "higher", 0.99, 0.99, None),
    "routing_agreement": ("ratio", "higher", 0.985, 0.97, None),
}
SPEED = {
    "load_time_s": ("s", "lower", 1.25, 2.5, None),
    "ttft_p50_ms": ("ms", "lower", 10.0, 5.0, None),
    "ttft_p90_ms": ("ms", "lower", 12.34, 6.1, None),
    "ttft_p99_ms": ("ms", "lower", 14.0, 7.0, None),
    "itl_p50_ms": ("ms", "lower", 4.56, 3.2, None),
    "itl_p90_ms": ("ms", "lower", 5.0, 3.9, None),
    "tokens_per_s": ("tokens/s", "higher", 219.3, 312.5, None),
    "peak_rss_mb": ("MB", "none", 456.7, 510.0, None),
    "model_size_mb": ("MB", "none", 12.3, 12.3, None),
}


def make_report(backend: str, *, empty: bool = False, gates_pass: bool = True) -> Report:
    """A report as `dstc eval` would write it; `empty`: an fp32 build measured without latency or series."""
    column = 2 if backend == "onnxruntime" else 3
    metrics = {name: Metric(value=spec[column], unit=spec[0], direction=spec[1], description=f"the {name}",
                            reference=spec[4]) for name, spec in {**ACCURACY, **SPEED}.items()}
    rng = random.Random(backend)
    slow = 1.0 if backend == "onnxruntime" else 0.6
    latency = [] if empty else [
        LatencyCase(prompt_length=p, batch=b, new_tokens=16, warmup=2, repetitions=10,
                    ttft_ms=[slow * p / 12 * b * rng.uniform(0.9, 1.2) for _ in range(10)],
                    itl_ms=[slow * 4 * b * rng.uniform(0.9, 1.3) for _ in range(150)],
                    tokens_per_s=200 / slow * b)
        for p in (128, 512) for b in (1, 4)]
    series = Series() if empty else Series(
        kl_per_position=[1e-4 * (1 + i / 10) * rng.uniform(0.8, 1.2) for i in range(64)],
        routing_agreement_per_layer={str(i): rng.uniform(0.95, 1.0) for i in (1, 2, 3)},
        layer_errors=[LayerError(weight=f"layers.{layer}/self_attn/{w}", layer=layer, precision="int4",
                                 weight_error=rng.uniform(0.05, 0.1), output_error=rng.uniform(0.01, 0.2))
                      for layer in range(4) for w in ("q_b_proj", "kv_b_proj", "o_proj")]
        + [LayerError(weight="lm_head", layer=None, precision="int8", weight_error=0.004, output_error=None)],
        head_errors=[HeadError(weight=f"layers.{layer}/self_attn/o_proj", layer=layer, head=h,
                               weight_error=rng.uniform(0.05, 0.1), output_error=rng.uniform(0.01, 0.1))
                     for layer in range(4) for h in range(4)])
    gates = None if empty else [
        GateResult(name="max_perplexity_increase", metric="perplexity_increase",
                   value=metrics["perplexity_increase"].value, limit=0.02, passed=True),
        GateResult(name="min_tokens_per_s", metric="tokens_per_s", value=metrics["tokens_per_s"].value,
                   limit=250.0, passed=gates_pass, detail="" if gates_pass else "219.3 < 250.0")]
    return Report(
        artifact={"path": f"artifacts/deepseek-v3-tiny-{backend}-int4", "recipe": f"deepseek-v3-tiny-{backend}-int4",
                  "backend": backend, "model": "deepseek-v3-tiny", "model_type": "deepseek_v3",
                  "manifest_sha256": "ab" * 32, "size_bytes": 12_300_000},
        reference={"model": "deepseek-v3-tiny", "runtime": "pytorch eager fp32"},
        environment={"threads": 4, "cpu": {"model": "Test CPU @ 3 GHz", "architecture": "x86_64",
                                           "isa": ["avx512_vnni", "amx_int8"]},
                     "host": "ci", "versions": {"onnxruntime": "1.32.0"}},
        settings={"texts": 32, "problems": 500, "prompt_lengths": [128, 512], "batches": [1, 4], "new_tokens": 16,
                  "warmup": 2, "repetitions": 10, "seed": 0},
        metrics=metrics, latency=latency, series=series, gates=gates)


@pytest.fixture(scope="module")
def ort() -> Report:
    return make_report("onnxruntime", gates_pass=False)


@pytest.fixture(scope="module")
def ov() -> Report:
    return make_report("openvino")


def assert_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "a reference to the network"
    assert not re.search(r"<script|<link|<iframe|<img|@import|url\((?!#)", page, re.I)  # url(#id): in-page


def test_formatting() -> None:
    assert fmt(1.234e-4, "nats") == "1.23e-04"
    assert fmt(12.34, "ms") == "12.3"
    assert fmt(0.994, "ratio") == "0.994"
    assert fmt(3.7912, "") == "3.79"
    assert fmt(12345.6, "") == "12,346"
    assert fmt(None, "ms") == "n/a"
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([], 50) is None


def test_markdown_has_every_metric_and_table(ort: Report) -> None:
    md = render_markdown(ort)
    assert md.startswith("# deepseek-v3-tiny-onnxruntime-int4: deepseek-v3-tiny on onnxruntime")
    assert "threads 4" in md and "warmup 2" in md and "repetitions 10" in md
    assert "cpu Test CPU @ 3 GHz (x86_64; avx512_vnni, amx_int8)" in md  # the machine's CPU and ISA
    for name, metric in ort.metrics.items():
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {fmt(metric.value, metric.unit)} |" in row
    assert "| perplexity | 3.79 | 3.75 |  | lower |" in md
    assert "| kl_mean | 1.23e-04 |" in md
    for heading in ("## Gates: FAIL", "## Accuracy", "## Speed and size", "## Latency per case",
                    "## Largest quantization error"):
        assert heading in md
    assert "| prompt | batch | new tokens | TTFT p50 (ms) |" in md
    assert md.count("\n| 128 | ") == 2 and md.count("\n| 512 | ") == 2
    assert "| min_tokens_per_s | tokens_per_s | 219.3 | 250.0 | FAIL |" in md
    worst = max(ort.series.layer_errors, key=lambda e: e.output_error or 0)
    weights = md.split("## Largest quantization error")[1]
    assert weights.count("\n| layers.") == 5 and f"| {worst.weight} |" in weights.splitlines()[4]


def test_summary_is_short_and_has_the_verdict(ort: Report, ov: Report) -> None:
    summary = render_summary(ort)
    assert len(summary.splitlines()) <= 12
    assert "perplexity 3.79 (ref 3.75)" in summary and "kl_mean 1.23e-04 nats" in summary
    assert "ttft_p50_ms 10.0 ms" in summary
    assert "FAIL 1/2 passed" in summary and "min_tokens_per_s" in summary
    assert "PASS 2/2 passed" in render_summary(ov)


def test_html_is_self_contained_with_a_plot_per_series(ort: Report) -> None:
    page = render_html(ort)
    assert_self_contained(page)
    assert '<span class="badge FAIL">FAIL</span>' in page
    assert page.count("<svg") == len([svg for plots in all_plots(ort).values() for svg in plots]) == 9
    assert "3.79" in page and "1.23e-04" in page and "min_tokens_per_s" in page
    # the settings as a labelled table, not a paragraph of unlabelled values
    assert re.search(r"<summary>Settings \(\d+\)</summary><table>", page) and "<td>threads</td>" in page
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "two inlined plots share an SVG id"


def test_html_leaves_out_plots_without_data() -> None:
    report = make_report("openvino")
    fp32 = report.model_copy(update={"series": Series(kl_per_position=report.series.kl_per_position)})
    page = render_html(fp32)
    assert page.count("<svg") == 5  # gates, KL, TTFT, ITL, tokens/s; no routing, layer or head errors
    assert "Quantization error" not in page


def test_rendering_is_deterministic(ort: Report, ov: Report) -> None:
    assert render_html(ort) == render_html(make_report("onnxruntime", gates_pass=False))
    assert render_comparison_html([ort, ov], ["ort", "ov"]) == render_comparison_html([ort, ov], ["ort", "ov"])
    assert render_markdown(ort) == render_markdown(ort)


def test_empty_report_renders() -> None:
    report = make_report("onnxruntime", empty=True)
    page = render_html(report)
    assert_self_contained(page)
    assert "<svg" not in page and "badge" not in page.split("</style>")[1]
    assert "## Latency per case" not in render_markdown(report)
    assert render_summary(report)
    bare = report.model_copy(update={"metrics": {}, "settings": {}, "environment": Environment(), "artifact": {}})
    for render in (render_html, render_markdown, render_summary):
        assert render(bare)
    for plot in PLOTS:
        assert plot[2](report) is None and plot[2]([("a", report), ("b", bare)]) is None
    assert comparison_rows([bare, bare], ["a", "b"]) == []
    assert_self_contained(render_comparison_html([bare, report], ["a", "b"]))
    # an fp32 build beside a compressed one: the compressed one's plots, alone
    assert render_comparison_html([report, make_report("openvino")], ["fp32", "int4"]).count("<svg") == 8


def test_comparison_rows(ort: Report, ov: Report) -> None:
    rows = comparison_rows([ort, ov], ["onnxruntime", "openvino"])
    by = {(r["metric"], None if r["case"] is None else (r["case"]["prompt_length"], r["case"]["batch"])): r
          for r in rows}
    ttft = by["ttft_p50_ms", None]
    assert ttft["values"] == [10.0, 5.0] and ttft["ratios"] == [1.0, 0.5] and ttft["better"] == "openvino"
    assert ttft["unit"] == "ms" and ttft["direction"] == "lower"
    assert by["perplexity", None]["better"] == "onnxruntime"  # lower is better
    assert by["exact_match", None]["better"] == "onnxruntime"  # higher is better
    assert by["tokens_per_s", None]["better"] == "openvino"
    assert by["greedy_match_rate", None]["better"] is None  # a tie
    assert by["model_size_mb", None]["better"] is None  # direction "none"
    assert [r["metric"] for r in rows[:3]] == ["perplexity", "perplexity_increase", "exact_match"]
    case = by["tokens_per_s", (512, 4)]
    assert case["values"] == [800.0, pytest.approx(800 / 0.6)] and case["better"] == "openvino"
    itl = by["itl_p50_ms", (128, 1)]
    assert itl["values"][0] == percentile(ort.latency[0].itl_ms, 50)
    assert itl["ratios"][1] == pytest.approx(itl["values"][1] / itl["values"][0])
    assert len(rows) == len(ort.metrics) + 4 * 3


def test_comparison_ratios_with_missing_values(ort: Report) -> None:
    dense = ort.model_copy(update={"metrics": {**ort.metrics, "routing_agreement": ort.metrics["routing_agreement"]
                                               .model_copy(update={"value": None})}})
    row = next(r for r in comparison_rows([dense, ort], ["a", "b"]) if r["metric"] == "routing_agreement")
    assert row["values"] == [None, 0.985] and row["ratios"] == [None, None] and row["better"] is None
    with pytest.raises(ValueError):
        comparison_rows([ort], ["a", "b"])


def test_comparison_renderings(ort: Report, ov: Report) -> None:
    labels = ["onnxruntime", "openvino"]
    text = render_comparison_text([ort, ov], labels)
    line = next(x for x in text.splitlines() if x.startswith("ttft_p50_ms "))
    assert re.search(r"10\.0\s+5\.0 \(×0\.50\)\s+openvino$", line)
    md = render_comparison_markdown([ort, ov], labels)
    assert "| ttft_p50_ms | ms | 10.0 | **5.0 (×0.50)** | openvino |" in md
    assert "| tokens_per_s @ 128×1 | tokens/s |" in md
    page = render_comparison_html([ort, ov], labels)
    assert_self_contained(page)
    assert '<td class="num best">5.0 (×0.50)</td>' in page
    assert page.count("<svg") == 8  # each report's gates are its own page's


def test_values_that_read_the_same_name_no_winner(ort: Report) -> None:
    close = ort.model_copy(update={"metrics": {**ort.metrics, "perplexity": ort.metrics["perplexity"].model_copy(
        update={"value": ort.metrics["perplexity"].value * (1 + 1e-6)})}})
    row = next(r for r in comparison_rows([ort, close], ["a", "b"]) if r["metric"] == "perplexity")
    assert row["values"][0] != row["values"][1] and row["better"] is None


def test_the_comparison_says_what_else_differs_between_the_builds(ort: Report, ov: Report) -> None:
    facts = [{"backend": "onnxruntime", "MoE lowering": "fused-onnxruntime", "weights": "int4-grouped g128 asym",
              "method": "data-free (RTN)"},
             {"backend": "openvino", "MoE lowering": "dispatch", "weights": "int4-grouped g128 asym",
              "method": "GPTQ"}]
    labels = ["onnxruntime", "openvino"]
    text = render_comparison_text([ort, ov], labels, facts)
    assert "Besides the runtime, the artifacts differ in:" in text
    assert "method        onnxruntime: data-free (RTN) | openvino: GPTQ" in text
    listed = text.split("differ in:")[1].split("\n\n")[0]
    assert "weights" not in listed and "backend" not in listed  # the same on both; the runtime, which labels say
    page = render_comparison_html([ort, ov], labels, facts)
    assert_self_contained(page)
    assert "<td>GPTQ</td>" in page and "Measured on" in page
    assert "| method | data-free (RTN) | GPTQ |" in render_comparison_markdown([ort, ov], labels, facts)


def with_intervals(report: Report) -> Report:
    """The report as eval writes it since dstc.report/6: the TTFT / ITL medians with their confidence intervals."""
    spread = {"confidence": 0.9375, "samples": 5}
    metrics = {**report.metrics,
               "ttft_p50_ms": report.metrics["ttft_p50_ms"].model_copy(
                   update={"interval": Interval(low=9.0, high=11.5, **spread)})}
    latency = [c.model_copy(update={"ttft_p50_interval_ms": Interval(low=min(c.ttft_ms), high=max(c.ttft_ms), **spread),
                                    "itl_p50_interval_ms": Interval(low=3.9, high=4.4, **spread)})
               for c in report.latency]
    return report.model_copy(update={"metrics": metrics, "latency": latency})


def test_the_medians_intervals_are_shown_wherever_the_medians_are(ort: Report, ov: Report) -> None:
    spread = with_intervals(ort)
    md = render_markdown(spread)
    assert "| ttft_p50_ms | 10.0 | 9.0-11.5 (93.8 %) |  | ms | lower |" in md  # the speed table has the column
    assert "| perplexity | 3.79 | 3.75 |  | lower |" in md  # the accuracy table, whose metrics have none, has not
    assert "| TTFT p50 (ms) | TTFT p50 interval (confidence) | TTFT p90 (ms) |" in md
    case = spread.latency[0]
    assert f"| {fmt(min(case.ttft_ms), 'ms')}-{fmt(max(case.ttft_ms), 'ms')} (93.8 %) |" in md
    assert "| 3.9-4.4 (93.8 %) |" in md
    assert "ttft_p50_ms 10.0 ms [9.0-11.5]" in render_summary(spread)
    assert "9.0-11.5 (93.8 %)" in render_html(spread)
    rows = comparison_rows([spread, ov], ["onnxruntime", "openvino"])
    ttft = next(r for r in rows if r["metric"] == "ttft_p50_ms" and r["case"] is None)
    assert ttft["intervals"] == [{"low": 9.0, "high": 11.5, "confidence": 0.9375, "samples": 5}, None]
    itl = next(r for r in rows if r["metric"] == "itl_p50_ms" and r["case"] == {"prompt_length": 128, "batch": 1})
    assert itl["intervals"][0]["low"] == 3.9
    text = render_comparison_text([spread, ov], ["onnxruntime", "openvino"])
    assert re.search(r"^ttft_p50_ms\s+ms\s+10\.0 \[9\.0-11\.5\]\s+5\.0 \(×0\.50\)", text, re.M)
    assert '<td class="num">10.0 [9.0-11.5]</td>' in render_comparison_html([spread, ov], ["onnxruntime", "openvino"])


# -- gate limits on the plots, plain log-axis ticks, each layer's share of the quantization error ----------------

def _svg_texts(svg: str) -> list[str]:
    return [t.replace("\u2212", "-") for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def gated(report: Report, kl_limit: float, weight_limit: float) -> Report:
    kl, worst = report.value("kl_mean"), max(e.weight_error for e in report.series.layer_errors)
    return report.model_copy(update={"gates": [
        GateResult(name="max_kl_mean", metric="kl_mean", value=kl, limit=kl_limit, passed=kl <= kl_limit),
        GateResult(name="max_weight_error", metric="max_weight_error", value=worst, limit=weight_limit,
                   passed=worst <= weight_limit),
        GateResult(name="min_top1_agreement", metric="top1_agreement", value=None, limit=0.9, passed=True,
                   skipped=True)]})


def test_plain_numbers_for_log_ticks() -> None:
    from toolchain.report.plots import plain_number

    assert [plain_number(v) for v in (60, 0.25, 1500, 1e-4, 2e-6, 3e6, 0, 0.001)] == [
        "60", "0.25", "1500", "1e-4", "2e-6", "3e+6".replace("+", ""), "0", "0.001"]


def test_gate_limits_are_drawn_on_their_plots_and_log_axes_read_as_plain_numbers(ov: Report) -> None:
    from toolchain.report.plots import gate_plot, kl_plot, layer_error_plot

    report = gated(ov, kl_limit=5e-3, weight_limit=0.08)  # KL passes; some weight errors are above 0.08: fails
    kl = kl_plot(report)  # KL 1e-4..8e-4 and the limit: a log axis
    assert kl is not None and "gate max_kl_mean 0.005 (dotted: mean KL)" in _svg_texts(kl)
    assert '#1a7f37' in kl  # passed: drawn green
    layers = layer_error_plot(report)
    assert layers is not None and "gate max_weight_error 0.08" in _svg_texts(layers) and "#cf222e" in layers
    texts = [t for svg in (kl, layers) for t in _svg_texts(svg)]
    assert not [t for t in texts if "times" in t or "^" in t or "$" in t or "×10" in t], texts
    assert {"0.001", "1e-4"} <= set(texts) and "0.1" in texts  # weight errors 0.004..0.2
    rows = _svg_texts(gate_plot(report) or "")
    assert "max_kl_mean" in rows and "max_weight_error" in rows and "min_top1_agreement" not in rows  # unmeasured
    assert any(t.endswith("≤ 0.08: FAIL") for t in rows) and any(t.endswith("≤ 0.005: pass") for t in rows)
    # overlaid reports gated with different limits: no line that would belong to one of them
    other = gated(ov, kl_limit=1e-3, weight_limit=0.08)
    assert "gate max_kl_mean" not in " ".join(_svg_texts(kl_plot([("a", report), ("b", other)]) or ""))
    assert gate_plot([("a", report), ("b", other)]) is None


def test_each_layers_share_of_the_quantization_error_sums_to_one_and_says_how_it_was_estimated(ov: Report) -> None:
    from toolchain.report.plots import layer_shares

    errors = [LayerError(weight=f"layers.{layer}/mlp/w{i}", layer=layer, precision="int4", weight_error=0.1,
                         output_error=error) for layer, error in ((0, 0.01), (1, 0.03), (1, 0.04)) for i in (0,)]
    report = ov.model_copy(update={"series": ov.series.model_copy(update={"layer_errors": errors})})
    kind, shares = layer_shares(report)
    assert kind == "output error" and shares == pytest.approx({0: 1e-4 / 26e-4, 1: 25e-4 / 26e-4})
    page = render_html(report)
    assert "Leading: layer 1 96 %, layer 0 4 %." in page and "KL measured with one layer quantized" in page
    no_output = [e.model_copy(update={"output_error": None}) for e in errors]
    assert layer_shares(ov.model_copy(update={"series": Series(layer_errors=no_output)}))[0] == "weight error"
