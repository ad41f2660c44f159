"""The paired ratios' 95% interval is the sign test's distribution-free interval for a median,
checked against the published table of its ranks."""

from __future__ import annotations

import statistics

from benchmarks_harness import load_benchmark
from hypothesis import given
from hypothesis import strategies as st

median_interval = load_benchmark("_timing").median_interval
paired_ratio_interval = load_benchmark("_timing").paired_ratio_interval

# n -> the rank k of the 95% interval's ends (the k-th smallest and the k-th largest value):
# the order-statistic interval for the median (Nair 1940; Conover, Practical Nonparametric
# Statistics, 3rd ed., Table A3; Hollander & Wolfe, Nonparametric Statistical Methods).
PUBLISHED_RANKS_95 = {6: 1, 7: 1, 8: 1, 9: 2, 10: 2, 11: 2, 12: 3, 13: 3, 14: 3, 15: 4, 16: 4,
                      17: 5, 18: 5, 19: 5, 20: 6}


def test_the_interval_takes_the_published_ranks():
    for n, k in PUBLISHED_RANKS_95.items():
        values = [float(v) for v in range(100, 100 + n)][::-1]  # given unsorted
        assert median_interval(values) == (100.0 + k - 1, 100.0 + n - k), n
    assert all(median_interval([1.0] * n) is None for n in range(6))


@given(st.lists(st.floats(0.01, 100.0), min_size=6, max_size=60))
def test_the_interval_is_two_of_the_values_around_the_median(values):
    low, high = median_interval(values)
    assert low in values and high in values
    assert low <= statistics.median(values) <= high
    wider = median_interval(values, confidence=0.99)
    assert wider is None or (wider[0] <= low and high <= wider[1])


def test_paired_ratios_interval_is_over_the_rounds_own_ratios():
    times = {"a": [2.0, 4.0, 6.0, 8.0, 10.0, 12.0], "b": [1.0, 1.0, 2.0, 2.0, 5.0, 4.0]}
    # ratios 2, 4, 3, 4, 2, 3: n = 6 takes the smallest and the largest
    assert paired_ratio_interval(times, "a", "b") == (2.0, 4.0)
