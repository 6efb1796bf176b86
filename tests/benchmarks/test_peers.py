"""benchmarks/peers.py's pure parts: rows (medians, bandwidth share, ratios to the best peer), the targets, the
table; benchmarks/artifact_sizes.py's bytes per token; benchmarks/harness.py's alternation and table. Nothing is
built or timed here."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from benchmark_modules import load


@pytest.fixture(scope="module")
def peers():
    return load("peers", "peers_benchmark")


@pytest.fixture(scope="module")
def sizes():
    return load("artifact_sizes", "artifact_sizes_benchmark")


@pytest.fixture(scope="module")
def harness():
    return load("harness", "harness_benchmark")


def sample(ttft_s: float, decode_s: float, batch4: float | None = None) -> dict:
    out = {"load_s": 1.0, "ttft_s": ttft_s, "decode_s": decode_s}
    if batch4 is None:
        out["batch4_skipped"] = "one sequence only"
    else:
        out["batch4_tokens_per_s"] = batch4
    return out


def footprint(bytes_per_token: int, table: int = 100) -> dict:
    return {"weight_bytes": bytes_per_token + table, "table_bytes": table, "bytes_per_token": bytes_per_token,
            "kv_bytes_per_token": 2048, "kv_precision": "u8"}


SAMPLES = {
    # dstc's two backends and three peers; the median of three samples is the middle one
    "dstc-ort": [sample(0.20, 0.010, 200.0), sample(0.30, 0.012, 180.0), sample(0.25, 0.011, 190.0)],
    "dstc-ov": [sample(0.05, 0.020, 100.0)],
    "optimum-ov-genai": [sample(0.06, 0.025, 90.0)],
    "ortgenai-builder": [sample(0.40, 0.016, 150.0)],
    "llamacpp-q4km": [sample(0.10, 0.020)],
}
FOOTPRINTS = {name: footprint(300_000_000) for name in SAMPLES}
BANDWIDTH = 50e9  # bytes/s: the limit for 300 MB/token is 6 ms/token


def test_rows_take_medians_and_the_bandwidth_share(peers):
    rows = {r["contender"]: r for r in peers.rows_for(SAMPLES, FOOTPRINTS, BANDWIDTH)}
    ort = rows["dstc-ort"]
    assert ort["ttft_ms"] == pytest.approx(250.0)
    assert ort["decode_ms_per_token"] == pytest.approx(11.0)
    assert ort["tokens_per_s"] == pytest.approx(1 / 0.011)
    assert ort["tokens_per_s_batch4"] == pytest.approx(190.0)
    assert ort["runs"] == 3
    assert ort["limit_ms_per_token"] == pytest.approx(6.0)
    assert ort["bandwidth_share"] == pytest.approx(6.0 / 11.0)
    assert rows["llamacpp-q4km"]["tokens_per_s_batch4"] is None
    assert rows["llamacpp-q4km"]["batch4_skipped"] == "one sequence only"


def test_ratios_are_to_the_best_peer_not_to_dstc(peers):
    rows = {r["contender"]: r for r in peers.rows_for(SAMPLES, FOOTPRINTS, BANDWIDTH)}
    # best peer TTFT: optimum 60 ms (dstc-ov's 50 ms is not a peer); best peer decode: builder 16 ms;
    # best peer batch-4 tokens/s: builder 150 (llama.cpp has none)
    assert rows["dstc-ov"]["ttft_ms_to_best_peer"] == pytest.approx(50 / 60)
    assert rows["optimum-ov-genai"]["ttft_ms_to_best_peer"] == pytest.approx(1.0)
    assert rows["dstc-ort"]["decode_ms_per_token_to_best_peer"] == pytest.approx(11 / 16)
    assert rows["dstc-ort"]["tokens_per_s_to_best_peer"] == pytest.approx(16 / 11)
    assert rows["dstc-ort"]["tokens_per_s_batch4_to_best_peer"] == pytest.approx(190 / 150)
    assert rows["llamacpp-q4km"]["tokens_per_s_batch4_to_best_peer"] is None


def test_without_peers_there_are_no_ratios(peers):
    only = {"dstc-ort": SAMPLES["dstc-ort"]}
    (row,) = peers.rows_for(only, FOOTPRINTS, BANDWIDTH)
    assert row["ttft_ms_to_best_peer"] is None
    assert row["decode_ms_per_token_to_best_peer"] is None


def test_targets(peers):
    rows = peers.rows_for(SAMPLES, FOOTPRINTS, BANDWIDTH)
    bandwidth, decode, ttft = peers.targets(rows)
    # 6 / 11 = 55 % and 6 / 20 = 30 % of the limit: missed
    assert bandwidth["met"] is False
    assert bandwidth["measured"] == {"dstc-ort": round(6 / 11, 3), "dstc-ov": 0.3}
    # dstc-ort decodes at 11 / 16 = 0.69x the best peer: met on one backend is enough
    assert decode["met"] is True
    # dstc-ov's TTFT beats the best peer, dstc-ort's (250 vs 60 ms) does not: both are needed
    assert ttft["met"] is False
    assert ttft["measured"]["dstc-ov"] == round(50 / 60, 3)

    fast = peers.rows_for({**SAMPLES, "dstc-ort": [sample(0.05, 0.008, 200.0)]}, FOOTPRINTS, BANDWIDTH)
    bandwidth, decode, ttft = peers.targets(fast)
    assert bandwidth["met"] is True and decode["met"] is True and ttft["met"] is True


def test_targets_not_judged_without_peers_or_backends(peers):
    rows = peers.rows_for({"dstc-ov": SAMPLES["dstc-ov"]}, FOOTPRINTS, BANDWIDTH)
    bandwidth, decode, ttft = peers.targets(rows)
    assert bandwidth["met"] is False  # judged on the one backend there is
    assert decode["met"] is None and ttft["met"] is None
    assert [t["met"] for t in peers.targets([])] == [None, None, None]


def test_table_has_a_row_per_contender_and_per_skip(peers):
    rows = peers.rows_for(SAMPLES, FOOTPRINTS, BANDWIDTH)
    text = peers.table(rows, {"dstc-ort-genai": "no genai_config.json"})
    lines = text.splitlines()
    assert len(lines) == 2 + len(SAMPLES) + 1
    columns = lines[0].count("|")
    assert all(line.count("|") == columns for line in lines)
    ort = next(line for line in lines if line.startswith("| dstc-ort |"))
    assert "| 250.0 | 11.00 |" in ort and "| 55 % |" in ort and "| 2048 (u8) |" in ort
    assert "skipped: no genai_config.json" in lines[-1]
    json.dumps(rows)  # rows go into the JSON as they are


def test_contender_names(peers):
    assert [c for c in peers.CONTENDERS if peers.is_peer(c)] == ["optimum-ov-genai", "ortgenai-builder",
                                                               "llamacpp-q4km"]
    assert {c for group in peers.BACKENDS.values() for c in group} <= set(peers.CONTENDERS)


def test_targets_judge_each_backend_on_its_better_variant(peers):
    """dstc-ort-prefill8 prefills faster and decodes as dstc-ort: TTFT is judged on it, decode on dstc-ort."""
    samples = {**SAMPLES, "dstc-ort-prefill8": [sample(0.055, 0.0115, 190.0)]}
    rows = peers.rows_for(samples, {**FOOTPRINTS, "dstc-ort-prefill8": FOOTPRINTS["dstc-ort"]}, BANDWIDTH)
    bandwidth, decode, ttft = peers.targets(rows)
    assert set(bandwidth["measured"]) == {"dstc-ort", "dstc-ov"} and set(decode["measured"]) == {"dstc-ort", "dstc-ov"}
    assert set(ttft["measured"]) == {"dstc-ort-prefill8", "dstc-ov"} and ttft["met"] is True


def test_prompt_only_weights_are_not_read_per_token(sizes, tmp_path):
    """prefill-int8's copies sit in the graph beside the 4-bit weights; a decode step does not read them."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.zeros((64, 8), np.uint8), "w_nbits"),
             numpy_helper.from_array(np.zeros((64, 8), np.int8), "w_nbits_prefill_int8"),
             numpy_helper.from_array(np.zeros(8, np.float32), "w_nbits_prefill_scale")]
    graph = helper.make_graph([helper.make_node("Identity", ["w_nbits"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits)
    onnx.save(helper.make_model(graph), tmp_path / "model.onnx")
    assert sizes._onnx_sizes(tmp_path / "model.onnx")[0] == 64 * 8


def test_routed_experts_are_read_at_their_active_share(sizes):
    assert sizes.active_experts({"hidden_size": 1536}) == 1.0
    assert sizes.active_experts({"n_routed_experts": 64, "num_experts_per_tok": 6}) == pytest.approx(6 / 64)
    # 1000 bytes of weights, 100 of them the table, 640 routed experts of which 6/64 are read
    assert sizes.per_token_bytes(1000, 100, 640, 6 / 64) == 320  # 900 - 640 * 58 / 64
    assert sizes.per_token_bytes(1000, 100, 0, 1.0) == 900


@pytest.mark.parametrize(("name", "routed"), [
    ("layers.1/mlp/experts/0/gate_proj/weight_quantized", True),  # dstc's ONNX initializer
    ("layers.1/mlp/experts/63/down_proj/MatMul_162", True),  # the OpenVINO MatMul reading it
    ("model.layers.1.mlp.experts.12.up_proj.weight", True),
    ("blk.1.ffn_gate_exps.weight", True),  # GGUF, stacked
    ("layers.1/mlp/shared_experts/gate_proj/weight_quantized", False),  # read by every token
    ("blk.1.ffn_gate_shexp.weight", False),
    ("layers.1/mlp/gate/weight", False),
])
def test_expert_weights_by_name(sizes, name, routed):
    assert bool(sizes.EXPERT.search(name)) is routed


def test_alternation_rotates_the_order_every_round(harness):
    order = list(harness.alternation(["a", "b", "c"], 4))
    assert [c for _, c in order] == list("abc" "bca" "cab" "abc")
    assert [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3


def test_markdown_table_aligns_numbers_right_and_text_left(harness):
    table = harness.markdown_table(["contender", "ms/token", "ratio"],
                                   [["dstc", 12.345, 0.5], ["peer", 7.0, None], ["tiny", 0.00123, 1]])
    assert table.splitlines() == [
        "| contender | ms/token | ratio |",
        "|-----------|---------:|------:|",
        "| dstc      |    12.35 |  0.50 |",
        "| peer      |     7.00 |     - |",
        "| tiny      |  0.00123 |     1 |"]


def test_a_measured_command_reports_its_tree_and_is_killed_over_budget(harness):
    import sys

    child = ("import subprocess, sys; "
             "subprocess.run([sys.executable, '-c', 'x = bytearray(200 << 20); import time; time.sleep(1)'])")
    run = harness.run_measured([sys.executable, "-c", child], every=0.02)
    assert run.returncode == 0 and run.peak_bytes > 200 << 20  # the grandchild's 200 MB counted
    killed = harness.run_measured([sys.executable, "-c", child], max_rss=100 << 20, every=0.02)
    assert killed.over_budget and killed.returncode == -9
