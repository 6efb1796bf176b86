"""The confidence interval of a latency median: distribution-free, from order statistics (toolchain/evaluate/
spread.py)."""

from __future__ import annotations

import random

import pytest

from toolchain.evaluate.spread import median_interval


def test_the_interval_is_the_tightest_order_statistics_that_keep_95_percent():
    assert median_interval([3.0]) is None and median_interval([]) is None
    # five repetitions (eval's default) cannot reach 95 %: the whole range, at 1 - 2/32
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == {"low": 1.0, "high": 5.0, "confidence": 0.9375,
                                                          "samples": 5}
    assert median_interval([1.0, 2.0]) == {"low": 1.0, "high": 2.0, "confidence": 0.5, "samples": 2}
    # twenty: the 6th smallest to the 6th largest (95.9 %); the 7th would give 88.5 %
    twenty = median_interval([float(v) for v in range(20, 0, -1)])
    assert (twenty["low"], twenty["high"]) == (6.0, 15.0) and twenty["confidence"] == pytest.approx(0.95861, abs=1e-5)


def test_the_interval_holds_the_true_median_as_often_as_it_says():
    """Skewed timings (log-normal, median 1): over 4000 draws of 11 repetitions, the share of intervals holding
    the true median is the stated confidence within sampling error."""
    rng = random.Random(0)
    hits, stated = 0, median_interval([float(i) for i in range(11)])["confidence"]
    for _ in range(4000):
        interval = median_interval([rng.lognormvariate(0, 0.5) for _ in range(11)])
        hits += interval["low"] <= 1.0 <= interval["high"]
    assert stated == pytest.approx(0.9883, abs=1e-4) and abs(hits / 4000 - stated) < 0.01
