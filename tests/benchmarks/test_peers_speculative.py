"""benchmarks/peers_speculative.py's pure part: the rows (tokens/s medians, speed-up over the runner's plain, ratio
to the best peer's plain, tokens per forward, acceptance, greedy match) and the table. Nothing is built or timed."""

from __future__ import annotations

import pytest
from benchmark_modules import load


@pytest.fixture(scope="module")
def spec():
    return load("peers_speculative", "peers_speculative_benchmark")


def sample(tokens: list[list[int]], seconds: list[float], **counts) -> dict:
    return {"tokens": tokens, "seconds": seconds, "counts": [dict(counts) for _ in tokens]}


PLAIN = [[1, 2, 3, 4], [5, 6, 7, 8]]
SAMPLES = {
    # dstc's plain: 8 tokens in 0.4 s, 0.2 s, 0.8 s -> median 20 tokens/s
    "dstc-ort/plain": [sample(PLAIN, [0.2, 0.2], forwards=4), sample(PLAIN, [0.1, 0.1], forwards=4),
                       sample(PLAIN, [0.4, 0.4], forwards=4)],
    # the first prompt differs at its third token (match 2/4), the second is plain's: greedy match 0.75
    "dstc-ort/mtp": [sample([[1, 2, 9, 9], [5, 6, 7, 8]], [0.05, 0.05], forwards=2, proposed=4, accepted=2)],
    "optimum-ov-genai/plain": [sample(PLAIN, [0.1, 0.1], forwards=4)],  # 40 tokens/s: the best peer's plain
    "llamacpp-f32/plain": [sample(PLAIN, [0.25, 0.25], forwards=4)],  # 16 tokens/s
    "llamacpp-f32/prompt-lookup": [sample(PLAIN, [0.2, 0.2], forwards=3)],  # no draft counts
}


def test_rows_ratios_acceptance_and_greedy_match(spec):
    rows = {r["contender"]: r for r in spec.rows_for(SAMPLES)}
    plain, mtp = rows["dstc-ort/plain"], rows["dstc-ort/mtp"]
    assert plain["tokens_per_s"] == pytest.approx(20.0)
    assert plain["tokens_per_s_best"] == pytest.approx(40.0)
    assert plain["speedup"] == pytest.approx(1.0)
    assert plain["to_best_peer_plain"] == pytest.approx(0.5)
    assert plain["greedy_match"] == pytest.approx(1.0)
    assert mtp["tokens_per_s"] == pytest.approx(80.0)
    assert mtp["speedup"] == pytest.approx(4.0)
    assert mtp["to_best_peer_plain"] == pytest.approx(2.0)
    assert mtp["tokens_per_forward"] == pytest.approx(2.0)
    assert mtp["acceptance"] == pytest.approx(0.5)
    assert mtp["greedy_match"] == pytest.approx(0.75)
    lookup = rows["llamacpp-f32/prompt-lookup"]
    assert lookup["speedup"] == pytest.approx(20.0 / 16.0)
    assert lookup["tokens_per_forward"] == pytest.approx(4 / 3)
    assert lookup["acceptance"] is None  # proposed and accepted not counted by the runner
    # a speculative method is not a plain one: the best peer's plain is optimum's, not llama.cpp's lookup
    assert rows["optimum-ov-genai/plain"]["to_best_peer_plain"] == pytest.approx(1.0)


def test_a_runner_without_plain_has_no_speedup_and_no_match(spec):
    rows = spec.rows_for({"dstc-ov/draft": [sample(PLAIN, [0.1, 0.1], forwards=2, proposed=4, accepted=4)]})
    assert rows[0]["speedup"] is None and rows[0]["greedy_match"] is None and rows[0]["to_best_peer_plain"] is None
    assert rows[0]["acceptance"] == pytest.approx(1.0)


def test_table_has_a_row_per_contender_and_the_reason_of_each_skip(spec):
    text = spec.table(spec.rows_for(SAMPLES), {"ortgenai-builder/plain": "exit 1: not currently supported"})
    lines = text.splitlines()
    assert len(lines) == 2 + len(SAMPLES) + 1
    assert lines[0].split("|")[1].strip() == "contender"
    skipped = next(line for line in lines if line.startswith("| ortgenai-builder/plain"))
    assert skipped.split("|")[-2].strip() == "skipped: exit 1: not currently supported"
    assert skipped.split("|")[2].strip() == "-"
    mtp = next(line for line in lines if line.startswith("| dstc-ort/mtp"))
    assert [c.strip() for c in mtp.split("|")[2:6]] == ["80.00", "80.00", "4.00", "2.00"]
