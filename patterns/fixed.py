"""fixed: Sparse Transformer fixed attention (Child et al. 2019, arXiv:1904.10509)."""

from gtx import Pattern, hookimpl


def fixed(l: int = 8, c: int = 2) -> Pattern:
    """Sparse Transformer fixed: the query's own block of l, plus the last c positions of every block.

    Args:
        l: block length.
        c: summary width, 1 <= c <= l (the paper: c in {8, 16, 32} for l in {128, 256}).

    Note:
        A1 = {j : floor(j/l) = floor(i/l)}, A2 = {j : j mod l in {l-c, ..., l-1}}. ``ee`` is
        A1 | A2 (two-sided), ``dd`` the paper's autoregressive form (A1 | A2) & j <= i, ``ed``
        the ``ee`` rule at the aligned source position. Self included.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[fixed]``: its edges on ``ee``, ``dd`` and ``ed``
        equal, as sets and exactly, those of the rule written out from the definition in ``tests/oracles.py``,
        over random parameters and lengths 1 to 40.
    """
    if l < 1 or not 1 <= c <= l:
        raise ValueError(f"need l >= 1 and 1 <= c <= l, got l={l}, c={c}")

    def rule(q, k, n_q, n_k):
        return (q // l == k // l) | (k % l >= l - c)

    return Pattern.from_rule(rule)


@hookimpl
def register_patterns(register):
    register("fixed", fixed)
