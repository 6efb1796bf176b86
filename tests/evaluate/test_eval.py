"""dstc eval / gate / build with gates on real (tiny) artifacts: report files, metrics against the fp32
reference, and a damaged artifact that the gates reject while the healthy one passes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from cli_helpers import dstc_here as dstc
from onnx import numpy_helper

from toolchain.build import build
from toolchain.report.schema import REPORT_FILES, load_report

SMALL = ["--texts", "40", "--problems", "40", "--prompt-lengths", "16,32", "--batches", "1,2", "--new-tokens", "4",
         "--warmup", "0", "--repetitions", "2"]
GATES = ["--max-perplexity-increase", "0.05", "--min-top1-agreement", "0.95", "--max-exact-match-drop", "5"]
ACCURACY = ("perplexity", "perplexity_increase", "exact_match", "exact_match_drop", "kl_mean", "kl_max",
            "top1_agreement", "greedy_match_rate", "routing_agreement")
LATENCY = ("load_time_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "tokens_per_s",
           "peak_rss_mb", "model_size_mb")




def recipe(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "model": "r1-distill-qwen-tiny", "export": {"parity": []},
                                    "compile": {"backend": "onnxruntime", "verify": False}, **fields}))
    return path


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, cache):
    root = tmp_path_factory.mktemp("healthy")
    build(recipe(root / "qwen-fp32.yaml"), root / "art")
    return root / "art"


def damage(artifact: Path, out: Path) -> Path:
    """A copy whose MLP weights carry noise twice as large as the weights themselves (a corrupted download or a
    broken quantizer would do as much)."""
    shutil.copytree(artifact, out)
    model = onnx.load(str(artifact / "model.onnx"))
    rng = np.random.default_rng(0)
    hit = 0
    for init in model.graph.initializer:
        if "/mlp/" in init.name and len(init.dims) == 2:
            w = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((w + rng.normal(0, 2 * w.std(), w.shape)).astype(np.float32),
                                                  init.name))
            hit += 1
    assert hit == 3 * 4  # gate, up and down projections of four layers
    (out / "model.onnx.data").unlink()
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return out


def test_eval_writes_three_report_files_with_every_metric(healthy, cache):
    proc = dstc("eval", healthy, *SMALL, env=cache)
    assert proc.returncode == 0, proc.stderr
    assert all((healthy / name).is_file() for name in REPORT_FILES)
    assert str(healthy / "report.html") in proc.stdout
    report = load_report(healthy / "report.json")
    values = {name: report.value(name) for name in (*ACCURACY, *LATENCY)}
    assert values.pop("routing_agreement") is None  # a dense model
    assert all(v is not None for v in values.values()), values
    # fp32 ONNX Runtime against fp32 PyTorch: the same model
    assert values["perplexity_increase"] < 1e-4 and values["top1_agreement"] > 0.999
    assert values["exact_match"] >= 0.95 and values["exact_match_drop"] == 0
    assert values["greedy_match_rate"] == 1.0 and values["kl_max"] < 1e-6
    assert report.metrics["perplexity"].reference == pytest.approx(values["perplexity"], rel=1e-4)
    assert {(c.prompt_length, c.batch) for c in report.latency} == {(16, 1), (16, 2), (32, 1), (32, 2)}
    assert all(len(c.ttft_ms) == 2 and len(c.itl_ms) == 2 * 3 for c in report.latency)
    assert len(report.series.kl_per_position) > 10
    assert report.settings["warmup"] == 0 and report.settings["repetitions"] == 2
    assert report.environment.threads >= 1
    assert report.environment.cpu.architecture and report.environment.cpu.logical_cores
    assert dstc("verify", healthy, env=cache).returncode == 0  # report files are not covered by the hashes
    # progress outside a terminal: plain lines, a line per latency case and run, the accuracy pass in steps
    assert "\r" not in proc.stderr and "━" not in proc.stderr
    assert "] latency 16×2 run 2/2: TTFT " in proc.stderr and "] latency 32×1 warm-up: 0 runs" in proc.stderr
    steps = re.findall(r"\]   (\d+)/(\d+) sequences, mean KL so far ", proc.stderr)
    assert len(steps) >= 2 and steps[-1][0] == steps[-1][1]


def test_gate_rejects_a_damaged_artifact_and_passes_the_healthy_one(healthy, tmp_path, cache):
    broken = damage(healthy, tmp_path / "broken")
    for art in (healthy, broken):
        proc = dstc("eval", art, *SMALL, "--no-latency", env=cache)
        assert proc.returncode == 0, proc.stderr
    ok = dstc("gate", healthy / "report.json", *GATES, env=cache)
    assert ok.returncode == 0, ok.stdout
    bad = dstc("gate", broken / "report.json", *GATES, "--json", env=cache)
    assert bad.returncode == 1
    verdicts = {g["name"]: g["passed"] for g in json.loads(bad.stdout)}
    assert verdicts["max_perplexity_increase"] is False and verdicts["min_top1_agreement"] is False
    # against the healthy build as baseline, too
    assert dstc("gate", broken, "--baseline", healthy, "--max-perplexity-increase", "0.05", env=cache).returncode == 1


def test_build_fails_on_a_recipe_gate_and_keeps_the_report(tmp_path, cache):
    path = recipe(tmp_path / "v3-int4-gated.yaml", model="deepseek-v3-tiny", compress={"scheme": "int4-grouped"},
                  eval={"texts": 30, "problems": 30, "latency": False},
                  gates={"min_top1_agreement": 1.0, "max_perplexity_increase": 0.5})
    proc = dstc("build", path, "-o", tmp_path / "art", env=cache)
    assert proc.returncode == 1, proc.stderr
    assert "1 of 2 gates failed (min_top1_agreement)" in proc.stderr and "Traceback" not in proc.stderr
    report = load_report(tmp_path / "art" / "report.json")
    assert {g.name: g.passed for g in report.gates} == {"max_perplexity_increase": True, "min_top1_agreement": False}
    assert report.value("routing_agreement") is not None and len(report.series.routing_agreement_per_layer) == 2
    assert report.series.layer_errors and report.value("ttft_p50_ms") is None  # latency was switched off
    assert dstc("verify", tmp_path / "art", env=cache).returncode == 0


def test_compare_puts_the_two_backends_side_by_side(healthy, tmp_path, cache):
    build(recipe(tmp_path / "qwen-ov.yaml", compile={"backend": "openvino", "verify": False}), tmp_path / "ov")
    proc = dstc("compare", healthy, tmp_path / "ov", *SMALL, "--html", tmp_path / "cmp.html", "--json", env=cache)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["labels"] == ["onnxruntime", "openvino"]
    rows = {(r["metric"], json.dumps(r["case"])): r for r in out["rows"]}
    ppl = rows[("perplexity", "null")]
    assert ppl["ratios"][0] == 1.0 and ppl["ratios"][1] == pytest.approx(ppl["values"][1] / ppl["values"][0])
    assert ("ttft_p50_ms", json.dumps({"prompt_length": 32, "batch": 2})) in rows
    assert [r["artifact"]["backend"] for r in out["reports"]] == ["onnxruntime", "openvino"]
    assert (tmp_path / "cmp.html").read_text().count("<svg") >= 3
    # the latency runs alternate between the artifacts, round by round
    runs = [(line.split("[compare ")[1].split("]")[0], line.split("] latency ")[1].split(":")[0])
            for line in proc.stderr.splitlines() if "] latency " in line and re.search(r" run \d+/\d+:", line)]
    assert [a for a, _ in runs] == [str(a) for _ in range(2) for a in (healthy, tmp_path / "ov") for _ in range(4)]
    assert all(r["settings"]["latency_interleaved"] for r in out["reports"])
    text = dstc("compare", healthy, tmp_path / "ov", *SMALL, "--no-latency", env=cache)
    assert text.returncode == 0 and "onnxruntime" in text.stdout and "openvino" in text.stdout


def test_generate_streams_the_answer_of_a_held_out_problem(healthy, cache):
    from toolchain.models.corpus import task_examples

    (prompt, answer), = task_examples("heldout", 1)
    proc = dstc("generate", healthy, prompt, "--raw", "--new-tokens", "8", env=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0].strip() == answer
    chat = dstc("generate", healthy, prompt, "--new-tokens", "4", env=cache)  # the chat template by default
    assert chat.returncode == 0 and chat.stdout != proc.stdout
    missing = dstc("generate", healthy.parent / "nothing-here", prompt, env=cache)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
