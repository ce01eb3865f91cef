"""strided: Sparse Transformer strided attention (Child et al. 2019, arXiv:1904.10509)."""

from gtx import Pattern, hookimpl


def strided(l: int = 4) -> Pattern:
    """Sparse Transformer strided: the previous l positions plus every l-th position.

    Args:
        l: stride (the paper uses l ~ sqrt(n)).

    Note:
        ``dd`` is the paper's autoregressive pattern exactly: A1 = {j : 0 <= i - j <= l},
        A2 = {j <= i : (i - j) mod l = 0}. ``ee`` is its two-sided version (|i - j| <= l or
        |i - j| mod l = 0); ``ed`` applies that at the aligned source position. Self included.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[strided]``: its edges on ``ee``, ``dd`` and ``ed``
        equal, as sets and exactly, those of the rule written out from the definition in ``tests/oracles.py``,
        over random parameters and lengths 1 to 40.
    """
    if l < 1:
        raise ValueError(f"l must be >= 1, got {l}")

    def rule(q, k, n_q, n_k):
        d = (q - k).abs()
        return (d <= l) | (d % l == 0)

    return Pattern.from_rule(rule)


@hookimpl
def register_patterns(register):
    register("strided", strided)
