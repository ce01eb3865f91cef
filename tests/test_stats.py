"""The statistics of `gtx compare`: summaries over seeds, Welch's t-test, the Pareto front."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gtx.records.stats import paired_p, pareto_front, summarize, verdict, welch_p


def test_summary_mean_std_and_t_interval_by_hand():
    s = summarize([1.0, 2.0, 3.0])
    # std = 1; t_{0.975, 2} = 4.302653; half width = 4.302653 / sqrt(3) = 2.484138
    assert (s.n, s.mean, s.std) == (3, 2.0, 1.0)
    assert s.ci_low == pytest.approx(2 - 2.484138, abs=1e-6) and s.ci_high == pytest.approx(2 + 2.484138, abs=1e-6)
    assert summarize([0.5, np.nan, 0.7]).n == 2  # a run without the value is left out
    assert summarize([5.0, 5.0]).ci_low == summarize([5.0, 5.0]).ci_high == 5.0


def test_one_run_has_a_mean_but_no_spread():
    s = summarize([0.9])
    assert s.n == 1 and s.mean == 0.9 and all(math.isnan(v) for v in (s.std, s.ci_low, s.ci_high))
    assert summarize([]).n == 0 and math.isnan(summarize([]).mean)


def test_welch_p_known_properties():
    assert welch_p([0.1, 0.2, 0.3], [0.1, 0.2, 0.3]) == pytest.approx(1.0)
    assert welch_p([0.90, 0.91, 0.92], [0.50, 0.52, 0.51]) < 0.001
    assert welch_p([0.90, 0.95, 0.85], [0.91, 0.86, 0.96]) > 0.5
    assert math.isnan(welch_p([0.9], [0.5, 0.6])) and math.isnan(welch_p([0.9, np.nan], [0.5, 0.6]))
    # no spread: 0/0 and x/0
    assert welch_p([1.0, 1.0, 1.0], [1.0, 1.0]) == 1.0 and welch_p([1.0, 1.0], [0.5, 0.5]) == 0.0
    assert welch_p([1, 2, 3, 4], [3, 4, 5, 6]) == welch_p([3, 4, 5, 6], [1, 2, 3, 4])


def test_verdict():
    assert verdict(0.01, 0.02) == "better" and verdict(0.01, -0.02) == "worse"
    assert verdict(0.2, 0.5) == "same" and verdict(math.nan, 0.5) == "-"


def test_pareto_front_by_hand():
    acc = [0.99, 0.98, 0.97, 0.99, np.nan, 0.90]
    tps = [1000, 3000, 2000, 1000, 9999, 3000]
    # 0 and 3 are equal: both stay; 2 is beaten by 1 in both; 4 has no accuracy; 5 ties 1 on speed, worse on accuracy
    assert pareto_front(acc, tps).tolist() == [True, True, False, True, False, False]
    assert pareto_front([], []).tolist() == []


points = st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1e6)), min_size=1, max_size=12)


@given(points)
def test_pareto_front_is_non_empty_and_undominated(pts):
    x, y = np.array(pts).T
    front = pareto_front(x, y)
    assert front.any()
    for i in np.flatnonzero(front):
        assert not any(x[j] >= x[i] and y[j] >= y[i] and (x[j] > x[i] or y[j] > y[i]) for j in range(len(pts)))
    for i in np.flatnonzero(~front):  # and every point off it is dominated
        assert any(x[j] >= x[i] and y[j] >= y[i] and (x[j] > x[i] or y[j] > y[i]) for j in range(len(pts)))


def test_values_near_the_float_range_neither_overflow_nor_warn(recwarn):
    s = summarize([1e308, 1.5e308, 0.5e308])
    assert (
        s.mean == pytest.approx(1e308)
        and s.std == pytest.approx(5e307)
        and s.ci_low == pytest.approx(1e308 * (1 - 4.302653 * 0.5 / 3**0.5))
    )
    assert s.ci_high == float("inf")  # the interval's end lies past the float range
    assert welch_p([1e308, 1.5e308, 0.5e308], [1e308, 1.2e308, 0.9e308]) > 0.5
    assert paired_p([1e308, 1.5e308], [0.9e308, 1.3e308]) < 1.0
    assert not [w for w in recwarn if "overflow" in str(w.message)]
