"""toolchain.evaluate.latency: every case measured in a child process, and the child's errors raised here.
No timing thresholds: the numbers only have to exist and be consistent."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from toolchain.build import build
from toolchain.errors import InputError
from toolchain.evaluate.latency import measure_latency


@pytest.fixture(scope="module")
def ort_artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("latency")
    recipe = root / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "t", "model": "deepseek-v3-tiny", "export": {"parity": []},
                                      "compile": {"backend": "onnxruntime", "verify": False}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(root / "cache"))
        build(recipe, root / "art")
    return root / "art"


def test_measure_latency_runs_every_case(ort_artifact):
    result = measure_latency(ort_artifact, prompt_lengths=(32, 128, 1020), batches=(1, 2), new_tokens=8, warmup=1,
                             repetitions=3, threads=1)
    assert [(c["prompt_length"], c["batch"]) for c in result["cases"]] == [(32, 1), (32, 2), (128, 1), (128, 2)]
    for case in result["cases"]:
        assert case["new_tokens"] == 8 and case["warmup"] == 1 and case["repetitions"] == 3
        assert len(case["ttft_ms"]) == 3 and len(case["itl_ms"]) == 3 * 7
        assert min(case["ttft_ms"]) > 0 and min(case["itl_ms"]) > 0 and case["tokens_per_s"] > 0
        # the medians and their intervals: of the 3 TTFTs and of the 3 repetitions' median ITLs (min to max, 75 %)
        assert case["ttft_p50_ms"] == sorted(case["ttft_ms"])[1] and case["itl_p50_ms"] == sorted(case["itl_ms"])[10]
        ttft, itl = case["ttft_p50_interval_ms"], case["itl_p50_interval_ms"]
        assert (ttft["low"], ttft["high"]) == (min(case["ttft_ms"]), max(case["ttft_ms"]))
        medians = sorted(sorted(case["itl_ms"][i * 7:(i + 1) * 7])[3] for i in range(3))
        assert (itl["low"], itl["high"]) == pytest.approx((medians[0], medians[2]))
        assert ttft["confidence"] == itl["confidence"] == 0.75 and ttft["samples"] == itl["samples"] == 3
    # 1020 prompt tokens + 8 new ones exceed the model's 1024 positions
    assert result["skipped"] == [{"prompt_length": 1020, "new_tokens": 8, "max_position_embeddings": 1024}]
    assert result["peak_rss_mb"] > result["rss_increase_mb"] > 0 and result["load_s"] > 0
    assert result["threads"] == 1 and result["runtime_config"]["intra_op_num_threads"] == 1


def test_errors_in_the_child_surface_with_its_message(ort_artifact, tmp_path):
    with pytest.raises(InputError, match="is not a directory"):
        measure_latency(tmp_path / "missing", prompt_lengths=(8,), batches=(1,), new_tokens=2, repetitions=1)
    broken = tmp_path / "broken"
    shutil.copytree(ort_artifact, broken)
    (broken / "model.onnx").write_bytes(b"not a protobuf")
    # a graph the runtime cannot read is bad input, named in one line (issue #22 case 10), not a crash
    with pytest.raises(InputError, match=r"model.onnx is not a readable ONNX model: .*Wire format was corrupt"):
        measure_latency(broken, prompt_lengths=(8,), batches=(1,), new_tokens=2, repetitions=1)
    with pytest.raises(InputError, match="new_tokens >= 2"):
        measure_latency(ort_artifact, new_tokens=1)


def test_speculative_latency_of_the_batch_1_cases(ort_artifact):
    """With speculate, each batch-1 case is decoded again speculatively: the plain tokens at fp32 (greedy match 1),
    acceptance counted per draft position, and the headline metrics and the report's schema take it."""
    from toolchain.evaluate.run import latency_metrics
    from toolchain.report.schema import LatencyCase

    for method in ("prompt-lookup", f"draft:{ort_artifact}"):
        result = measure_latency(ort_artifact, prompt_lengths=(32,), batches=(1, 2), new_tokens=12, warmup=0,
                                 repetitions=2, threads=1, speculate=method, draft_tokens=3)
        for case in result["cases"]:
            spec = case.get("speculative")
            if case["batch"] != 1:
                assert spec is None
                continue
            assert spec["method"] == method and spec["draft_tokens"] == 3 and spec["greedy_match"] == 1.0
            assert len(spec["ttft_ms"]) == 2 and spec["tokens_per_s"] > 0
            assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / case["tokens_per_s"])
            assert len(spec["proposed_per_position"]) <= 3 and spec["verify_steps"] >= 2 * 11 / 4
            assert all(0 <= a <= p for a, p in zip(spec["accepted_per_position"], spec["proposed_per_position"]))
            if method.startswith("draft:"):  # the artifact drafts for itself: every draft is its own argmax
                assert spec["acceptance"] == 1.0 and spec["verify_steps"] == 2 * 3  # 11 tokens, 4 per step
            LatencyCase.model_validate(case)
        metrics = latency_metrics(result["cases"], result["load_s"], result["peak_rss_mb"])  # headline: the first
        assert metrics["speculative_greedy_match_rate"].value == 1.0
        assert metrics["speculative_acceptance"].value == result["cases"][0]["speculative"]["acceptance"]


def test_progress_lines_per_case_and_run_and_two_artifacts_timed_in_alternating_rounds(ort_artifact):
    """A line per case's warm-up and per measured run (eval's longest phase is not one silent line), and `dstc
    compare`'s artifacts in rounds A, B, A, B: each round one run of every case of each artifact in turn."""
    from toolchain.evaluate.latency import latency_settings, measure_latency_interleaved

    lines: list[tuple[int, str]] = []
    chosen = {"prompt_lengths": (16,), "batches": (1, 2), "new_tokens": 3, "warmup": 1, "repetitions": 2,
              "threads": 1}
    results = measure_latency_interleaved([latency_settings(ort_artifact, **chosen)] * 2,
                                          lambda i, m: lines.append((i, m)))
    runs = [(i, m.split(":")[0]) for i, m in lines if re.search(r" run \d+/\d+:", m)]
    assert runs == [(i, f"16×{b} run {r}/2") for r in (1, 2) for i in (0, 1) for b in (1, 2)]
    warmups = [(i, m.split(":")[0]) for i, m in lines if "warm-up" in m]
    assert warmups == [(i, f"16×{b} warm-up") for i in (0, 1) for b in (1, 2)]
    assert [m for i, m in lines if m.startswith("loaded in ")] and len(results) == 2
    for result in results:
        assert [len(c["ttft_ms"]) for c in result["cases"]] == [2, 2]
    logged: list[str] = []
    single = measure_latency(ort_artifact, log=logged.append, **chosen)
    assert sum(bool(re.search(r" run \d+/\d+:", m)) for m in logged) == 4 and len(single["cases"]) == 2
