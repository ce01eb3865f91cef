"""Statistics over seeds for ``gtx compare``: small pure functions on plain numbers.

NaN stands for a run that lacks the value (an unfinished run has no test row): every function
drops NaNs first, so ``n`` counts the runs that have the value.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps


@dataclass(frozen=True)
class Summary:
    n: int  # values, NaNs left out
    mean: float  # NaN for n = 0
    std: float  # sample standard deviation (ddof=1); NaN for n < 2
    ci_low: float  # confidence interval of the mean (Student t); NaN for n < 2
    ci_high: float


def _values(values) -> np.ndarray:
    a = np.asarray(values, dtype=float).ravel()
    return a[~np.isnan(a)]


def _scale(*arrays: np.ndarray) -> float:
    """The largest finite magnitude (1.0 for none): values divided by it stay far from overflow (1e308 squared)."""
    finite = [np.abs(x[np.isfinite(x)]).max() for x in arrays if np.isfinite(x).any()]
    return float(max(finite, default=0.0)) or 1.0


def _scaled(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays divided by one common ``_scale``: tests and intervals are scale-free, so computed on these."""
    scale = _scale(*arrays)
    return tuple(x / scale for x in arrays)


def summarize(values, level: float = 0.95) -> Summary:
    """Mean, sample std and the ``level`` confidence interval of the mean, ``mean ± t_{(1+level)/2, n-1} * std / sqrt(n)``:
    the runs are taken as independent draws (one seed each) of a normal variable."""
    a = _values(values)
    n = len(a)
    scale = _scale(a)
    a = a / scale
    mean = float(a.mean()) if n else math.nan
    if n < 2:
        return Summary(n, scale * mean, math.nan, math.nan, math.nan)
    std = float(a.std(ddof=1))
    half = float(sps.t.ppf((1 + level) / 2, n - 1)) * std / math.sqrt(n)
    with np.errstate(over="ignore"):  # an interval past the float range is infinite, as it should be
        return Summary(
            n,
            scale * mean,
            scale * std,
            float(np.float64(scale) * (mean - half)),
            float(np.float64(scale) * (mean + half)),
        )


def welch_p(a, b) -> float:
    """Two-sided p-value of Welch's t-test (unequal variances) that ``a`` and ``b`` have the same mean.

    NaN when either holds fewer than 2 values. Both constant: 1.0 if they are equal, else 0.0 (the
    t statistic is 0/0 or infinite; seeds that all reach accuracy 1.0 are the common case)."""
    a, b = _values(a), _values(b)
    if len(a) < 2 or len(b) < 2:
        return math.nan
    a, b = _scaled(a, b)
    if a.std() == 0 and b.std() == 0:
        return 1.0 if a.mean() == b.mean() else 0.0
    with warnings.catch_warnings():  # one constant side: scipy warns of precision loss, yet the p-value is the test's
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(sps.ttest_ind(a, b, equal_var=False).pvalue)


def paired_p(a, b) -> float:
    """Two-sided p-value of the paired t-test that ``a - b`` has mean 0 (pairs with a NaN left out).

    NaN for fewer than 2 pairs. Constant differences: 1.0 if all are 0, else 0.0 (as ``welch_p``)."""
    a, b = _scaled(np.asarray(a, dtype=float), np.asarray(b, dtype=float))
    d = a - b
    d = d[~np.isnan(d)]
    if len(d) < 2:
        return math.nan
    (d,) = _scaled(d)
    if d.std() == 0:
        return 1.0 if d.mean() == 0 else 0.0
    return float(sps.ttest_1samp(d, 0.0).pvalue)


def verdict(p: float, gain: float, alpha: float = 0.05) -> str:
    """``"better"`` or ``"worse"`` (the sign of ``gain``, a difference oriented so that positive is better)
    when ``p < alpha``, else ``"same"``; ``"-"`` when ``p`` is NaN (too few runs to test)."""
    if math.isnan(p):
        return "-"
    if p >= alpha:
        return "same"
    return "better" if gain > 0 else "worse"


def pareto_front(x, y) -> np.ndarray:
    """Bool mask of the points (x[i], y[i]) on the Pareto front, both coordinates to maximise: no other
    point is >= in both and > in one. Equal points are all on it; a point with a NaN is neither on it
    nor dominates another. Negate a coordinate to minimise it."""
    p = np.column_stack([np.asarray(x, dtype=float), np.asarray(y, dtype=float)])
    ok = ~np.isnan(p).any(axis=1)
    candidates = p[ok]
    front = ok.copy()
    for i in np.flatnonzero(ok):
        dominated = (candidates >= p[i]).all(axis=1) & (candidates > p[i]).any(axis=1)
        front[i] = not dominated.any()
    return front


def tost_p(a, b, margin: float) -> float:
    """p-value of the two one-sided tests (TOST, Welch's t) that the means of ``a`` and ``b`` differ
    by less than ``margin`` (> 0, in the values' units): the larger of the p-values of H0 ``mean(a) -
    mean(b) <= -margin`` and H0 ``mean(a) - mean(b) >= margin``. Below alpha: equivalent within the
    margin (the 1 - 2 alpha interval of the difference lies inside it).

    NaN when either side holds fewer than 2 values. Both constant: 0.0 if the means differ by less
    than the margin, else 1.0 (the standard error is 0)."""
    if not margin > 0:
        raise ValueError(f"margin {margin}: an equivalence margin must be > 0")
    a, b = _values(a), _values(b)
    if len(a) < 2 or len(b) < 2:
        return math.nan
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    d = a.mean() - b.mean()
    if va + vb == 0:
        return 0.0 if abs(d) < margin else 1.0
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch-Satterthwaite
    p_low = float(sps.t.sf((d + margin) / se, df))  # H0: d <= -margin
    p_high = float(sps.t.cdf((d - margin) / se, df))  # H0: d >= margin
    return max(p_low, p_high)
