"""Release gates on report.json: limits against the fp32 reference or a baseline, and `dstc gate`'s exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolchain.errors import InputError
from toolchain.gates import GateLimits, check_gates
from toolchain.hashing import self_digest
from toolchain.report.schema import SCHEMA, Interval, Metric, Report, load_report

REPO = Path(__file__).resolve().parent.parent


def report(ppl=4.0, ref_ppl=3.8, em=0.99, ref_em=1.0, top1=0.95, kl=1e-3, ttft=10.0, itl=2.0) -> Report:
    def m(value, direction, unit="", reference=None):
        return Metric(value=value, unit=unit, direction=direction, description="", reference=reference)

    return Report(artifact={"backend": "onnxruntime"}, reference={}, environment={}, settings={}, metrics={
        "perplexity": m(ppl, "lower", reference=ref_ppl), "perplexity_increase": m(ppl / ref_ppl - 1, "lower", "ratio"),
        "exact_match": m(em, "higher", "ratio", ref_em), "exact_match_drop": m(100 * (ref_em - em), "lower", "points"),
        "top1_agreement": m(top1, "higher", "ratio"), "kl_mean": m(kl, "lower", "nats"),
        "ttft_p50_ms": m(ttft, "lower", "ms"), "itl_p50_ms": m(itl, "lower", "ms")})


def verdicts(results) -> dict[str, bool]:
    return {r.name: r.passed for r in results}


def test_accuracy_gates_against_the_reference_inside_the_report():
    limits = GateLimits(max_perplexity_increase=0.06, min_top1_agreement=0.9, max_exact_match_drop=2.0,
                        max_kl_mean=1e-2)
    results = check_gates(report(), limits)
    assert verdicts(results) == {"max_perplexity_increase": True, "min_top1_agreement": True,
                                 "max_exact_match_drop": True, "max_kl_mean": True}
    assert results[0].value == pytest.approx(4.0 / 3.8 - 1)
    results = check_gates(report(ppl=4.1, em=0.97, top1=0.89, kl=0.02), limits)
    assert not any(verdicts(results).values())
    assert [r.value for r in results][1] == pytest.approx(3.0)  # exact-match points lost


def test_gates_against_a_baseline_report_and_latency_ratio():
    base = report(ppl=3.9, em=0.99, ttft=10.0, itl=2.0)
    limits = GateLimits(max_perplexity_increase=0.02, max_exact_match_drop=0.5, max_latency_ratio=1.2)
    results = check_gates(report(ppl=3.95, em=0.99, ttft=11.0, itl=2.6), limits, base)
    assert verdicts(results) == {"max_perplexity_increase": True, "max_exact_match_drop": True,
                                 "max_latency_ratio (ttft_p50_ms)": True, "max_latency_ratio (itl_p50_ms)": False}
    assert results[0].value == pytest.approx(3.95 / 3.9 - 1)
    assert results[3].value == pytest.approx(1.3)
    with pytest.raises(InputError, match="needs a baseline"):
        check_gates(report(), GateLimits(max_latency_ratio=1.2))


def test_a_metric_that_was_not_measured_fails_its_gate():
    r = report()
    r.metrics["exact_match_drop"] = Metric(value=None, unit="points", direction="lower", description="n/a")
    (result,) = check_gates(r, GateLimits(max_exact_match_drop=1.0))
    assert result.value is None and not result.passed


def gate(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolchain", "gate", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_gate_cli_exit_codes_and_table(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(report().sealed()))
    bad.write_text(json.dumps(report(top1=0.5).sealed()))
    assert load_report(good).value("top1_agreement") == 0.95

    ok = gate(good, "--min-top1-agreement", "0.9", "--max-perplexity-increase", "0.1")
    assert ok.returncode == 0 and "min_top1_agreement" in ok.stdout and "pass" in ok.stdout
    fail = gate(bad, "--min-top1-agreement", "0.9", "--json")
    assert fail.returncode == 1
    (row,) = json.loads(fail.stdout)
    assert row["passed"] is False and row["value"] == 0.5 and row["limit"] == 0.9

    assert gate(good).returncode == 2  # no gates given
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something/9"}))
    unreadable = gate(tmp_path / "other.json", "--min-top1-agreement", "0.9")
    assert unreadable.returncode == 2 and SCHEMA in unreadable.stderr and "Traceback" not in unreadable.stderr
    latency = gate(good, "--max-latency-ratio", "1.1")
    assert latency.returncode == 2 and "needs a baseline" in latency.stderr


def test_the_example_ci_workflow_names_shipped_recipes_with_committed_baselines():
    import yaml

    workflow = yaml.safe_load((REPO / "docs" / "github-actions-release-gate.yml").read_text())
    recipes = workflow["jobs"]["build-and-gate"]["strategy"]["matrix"]["recipe"]
    assert len(recipes) >= 2
    for name in recipes:
        assert (REPO / "recipes" / f"{name}.yaml").is_file()
        baseline = load_report(REPO / "baselines" / f"{name}.json")
        assert baseline.artifact["recipe"] == name and baseline.value("perplexity") is not None


def test_a_report_of_the_previous_schema_is_read_upgraded(tmp_path):
    data = report().dump()
    data["schema"], data["environment"] = "dstc.report/1", {"cpu": "x86_64", "threads": 2}
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_report(tmp_path / "old.json")
    assert old.schema_ == SCHEMA and old.environment.cpu.architecture == "x86_64" and old.environment.threads == 2


def test_a_latency_gate_across_machines_is_refused_unless_allowed():
    """A baseline made on an Intel Xeon with AMX and a report from an AMD EPYC: the ratio of their latencies
    measures the machines. Refused in one line; allowed, the gate runs and its detail names the difference."""
    def on(model, isa, threads):
        r = report()
        r.environment.cpu.model, r.environment.cpu.isa, r.environment.threads = model, isa, threads
        return r

    xeon, epyc = on("Intel(R) Xeon(R)", ["avx512f", "amx_int8"], 2), on("AMD EPYC", ["avx2"], 2)
    with pytest.raises(InputError, match="compares machines, not artifacts: CPU AMD EPYC vs the baseline's Intel"):
        check_gates(epyc, GateLimits(max_latency_ratio=1.5), xeon)
    results = check_gates(epyc, GateLimits(max_latency_ratio=1.5, max_kl_mean=1.0, allow_other_machine=True), xeon)
    assert [r.name for r in results if "another machine: CPU AMD EPYC" in r.detail] == [
        "max_latency_ratio (ttft_p50_ms)", "max_latency_ratio (itl_p50_ms)"]
    with pytest.raises(InputError, match="4 threads vs the baseline's 2"):
        check_gates(on("AMD EPYC", ["avx2"], 4), GateLimits(max_latency_ratio=1.5), epyc)
    # accuracy alone is judged across machines without a word of refusal
    assert check_gates(epyc, GateLimits(max_kl_mean=1.0), xeon)[0].passed
    assert check_gates(epyc, GateLimits(max_latency_ratio=1.5), on("AMD EPYC", ["avx2"], 2))[0].passed


def timed(ttft: tuple[float, float, float], itl: tuple[float, float, float] = (2.0, 1.9, 2.1),
          confidence: float = 0.9375) -> Report:
    """A report whose latency medians carry (value, interval low, interval high) at ``confidence``."""
    r = report(ttft=ttft[0], itl=itl[0])
    for name, (_, low, high) in (("ttft_p50_ms", ttft), ("itl_p50_ms", itl)):
        r.metrics[name].interval = Interval(low=low, high=high, confidence=confidence, samples=5)
    return r


def test_a_latency_gate_states_the_ratios_interval_and_refuses_one_that_cannot_tell():
    """The ratio's interval runs from the report's low over the baseline's high to the report's high over the
    baseline's low. Clear of the limit: judged, the interval in the detail. Holding both 1 and the far side of the
    limit: refused (exit 2), as neither verdict would mean anything. Straddling the limit only: judged, warned."""
    base, limits = timed((10.0, 9.5, 10.5)), GateLimits(max_latency_ratio=1.5)
    same, slower = timed((10.2, 9.8, 10.6)), timed((20.0, 19.0, 21.0))
    results = check_gates(same, limits, base)
    assert verdicts(results) == {"max_latency_ratio (ttft_p50_ms)": True, "max_latency_ratio (itl_p50_ms)": True}
    assert "interval 0.93-1.12 (each median's at 93.8%)" in results[0].detail and not results[0].warning
    results = check_gates(slower, limits, base)
    assert not results[0].passed and "interval 1.81-2.21" in results[0].detail and not results[0].warning
    # a report whose TTFT runs went from 6 to 30 ms: 1 and 2.9 both lie in its ratio's interval
    with pytest.raises(InputError, match=r"latency gate on ttft_p50_ms cannot tell: the ratio to the baseline lies "
                                         r"in 0.57-3.16 \(each median's 93.8% interval\)"):
        check_gates(timed((10.0, 6.0, 30.0)), limits, base)
    # 1.2-1.9: slower for sure, beyond the limit not: the verdict (by the medians' ratio) comes with a warning
    straddling = check_gates(timed((15.0, 12.6, 18.9)), limits, base)[0]
    assert straddling.passed and "straddles the limit 1.5" in straddling.warning
    # a limit below 1 (the artifact must have got faster) reads the same rule the other way round
    with pytest.raises(InputError, match="cannot tell"):
        check_gates(timed((10.0, 8.0, 12.0)), GateLimits(max_latency_ratio=0.9), base)


def test_a_latency_gate_without_intervals_warns_that_its_noise_is_unknown():
    """A baseline of schema /5 or before has no intervals; one of 3 repetitions has one of 75 %, too narrow by
    luck to vouch: the verdict stands, with a warning naming which side lacks it."""
    results = check_gates(timed((10.0, 9.5, 10.5)), GateLimits(max_latency_ratio=1.5), report())
    assert [r.passed for r in results] == [True, True]
    assert results[0].warning.startswith("ttft_p50_ms: the baseline has no confidence interval of the median at 90%")
    few = timed((10.0, 9.9, 10.1), confidence=0.75)
    assert "the report and the baseline have no" in check_gates(few, GateLimits(max_latency_ratio=1.5),
                                                               report())[0].warning


def test_dstc_gate_prints_the_interval_and_refuses_in_one_line(tmp_path):
    base, noisy = tmp_path / "base.json", tmp_path / "noisy.json"
    base.write_text(json.dumps(timed((10.0, 9.5, 10.5)).sealed()))
    noisy.write_text(json.dumps(timed((10.0, 6.0, 30.0)).sealed()))
    gate = [sys.executable, "-m", "toolchain", "gate"]
    ok = subprocess.run([*gate, str(base), "--baseline", str(base), "--max-latency-ratio", "1.5"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "interval 0.90-1.11" in ok.stdout, ok.stderr
    refused = subprocess.run([*gate, str(noisy), "--baseline", str(base), "--max-latency-ratio", "1.5"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert refused.stderr.count("\n") == 1 and "cannot tell" in refused.stderr


def test_a_report_of_schema_5_is_read_bound_without_a_warning(tmp_path, capsys):
    """/6 only added the intervals: a /5 report has its digest and binding, and reads as it was."""
    data = report().dump()
    data["schema"], data["digest"] = "dstc.report/5", None
    data["digest"] = self_digest(data)
    (tmp_path / "five.json").write_text(json.dumps(data))
    assert load_report(tmp_path / "five.json").schema_ == SCHEMA and capsys.readouterr().err == ""
    data["digest"] = None
    (tmp_path / "five.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="has no digest"):
        load_report(tmp_path / "five.json")
