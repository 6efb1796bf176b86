"""How far a latency median can be trusted: a distribution-free confidence interval of the median from order
statistics, of one value per measured repetition.

Timings are skewed and their noise comes in bursts (another process takes the core for a whole run), so the interval
assumes no distribution: between the j-th smallest and the j-th largest of n values the median lies with probability
1 - 2 P(Binomial(n, 1/2) < j). j is the largest that keeps that at CONFIDENCE; with too few repetitions to reach it
(n = 5 reaches 93.75 %: min and max), the interval is the whole range and its own, lower, confidence is recorded.
"""

from __future__ import annotations

from math import comb

CONFIDENCE = 0.95


def _coverage(n: int, j: int) -> float:
    """The probability that the median lies between the j-th smallest and the j-th largest of n values."""
    return 1 - 2 * sum(comb(n, i) for i in range(j)) / 2**n


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> dict | None:
    """{low, high, confidence, samples} of the median of ``values``; None for fewer than two values (one value
    says nothing of its spread)."""
    n = len(values)
    if n < 2:
        return None
    j = 1
    while j + 1 <= n // 2 and _coverage(n, j + 1) >= confidence:
        j += 1
    ordered = sorted(values)
    return {"low": ordered[j - 1], "high": ordered[n - j], "confidence": _coverage(n, j), "samples": n}
