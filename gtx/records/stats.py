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


@dataclass(frozen=True)
class Paired:
    """A run's per-sample outcomes (in [0, 1]) against a baseline's on the same samples, in order.

    ``test``: ``mcnemar`` where every outcome is 0 or 1, else ``bootstrap``; ``n`` the pairs;
    ``base_acc`` and ``acc`` the two means over them; ``worse`` and ``better`` the discordant pairs
    (the run's outcome below the baseline's, above it); ``p`` two-sided (no difference), ``p_worse``
    one-sided (the run is not worse: small when it is)."""

    test: str
    n: int
    base_acc: float
    acc: float
    worse: int
    better: int
    p: float
    p_worse: float


def mcnemar_p(worse: int, better: int) -> tuple[float, float]:
    """Exact McNemar test on the discordant pairs: under no difference each of the ``worse + better``
    is a fair coin's toss. (two-sided p: twice the smaller tail of Binomial(worse + better, 1/2), at
    most 1; one-sided p that the run is not worse: P(X >= worse)). No discordant pair: (1, 1)."""
    n = worse + better
    if n == 0:
        return 1.0, 1.0
    two = min(1.0, 2 * float(sps.binom.cdf(min(worse, better), n, 0.5)))
    return two, float(sps.binom.sf(worse - 1, n, 0.5))


def bootstrap_p(diff, resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap of the mean of ``diff`` (run minus baseline, per sample), under the null of
    mean 0: the differences are centred, resampled with replacement ``resamples`` times (a fixed
    ``seed``: the same p every time) and the observed mean compared with the resampled means:
    (two-sided p, one-sided p that the run is not worse), each (1 + as extreme) / (1 + resamples),
    never 0. No pair: (1, 1)."""
    d = np.asarray(diff, dtype=float)
    if len(d) == 0:
        return 1.0, 1.0
    mean = d.mean()
    rng = np.random.default_rng(seed)
    means = (d - mean)[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    tol = 1e-12  # the centred means of equal differences are 0 up to rounding
    two = (1 + np.count_nonzero(np.abs(means) >= abs(mean) - tol)) / (1 + resamples)
    one = (1 + np.count_nonzero(means <= mean + tol)) / (1 + resamples)
    return float(two), float(one)


def paired_test(outcomes, base, resamples: int = 10_000, seed: int = 0) -> Paired:
    """``outcomes`` against ``base``, sample by sample (equal lengths, values in [0, 1]): exact McNemar
    where all are 0 or 1, else the paired bootstrap of the mean difference (``bootstrap_p``)."""
    a, b = np.asarray(outcomes, dtype=float), np.asarray(base, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired outcomes of {a.shape} and {b.shape} samples: a paired test needs the same samples")
    worse, better = int(np.count_nonzero(a < b)), int(np.count_nonzero(a > b))
    binary = bool(np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all())
    p, p_worse = mcnemar_p(worse, better) if binary else bootstrap_p(a - b, resamples, seed)
    acc, base_acc = (float(x.mean()) if len(x) else math.nan for x in (a, b))
    return Paired("mcnemar" if binary else "bootstrap", len(a), base_acc, acc, worse, better, p, p_worse)
