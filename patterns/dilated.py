"""dilated: a dilated sliding window (Longformer's dilation)."""

from gtx import Pattern, hookimpl


def dilated(w: int = 2, d: int = 2) -> Pattern:
    """Dilated window: w keys on each side, d positions apart.

    Args:
        w: keys on each side.
        d: dilation, >= 1 (d = 1 is ``local:w=w``).

    Note:
        |i - j| <= w*d and (i - j) mod d = 0 (Longformer §3.3). ``dd`` is that & j <= i, ``ed``
        the rule at the aligned source position. Self included.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[dilated]``: its edges on ``ee``, ``dd`` and ``ed``
        equal, as sets and exactly, those of the rule written out from the definition in ``tests/oracles.py``,
        over random parameters and lengths 1 to 40.
    """
    if w < 0 or d < 1:
        raise ValueError(f"need w >= 0 and d >= 1, got w={w}, d={d}")

    def rule(q, k, n_q, n_k):
        diff = q - k
        return (diff.abs() <= w * d) & (diff % d == 0)

    return Pattern.from_rule(rule)


@hookimpl
def register_patterns(register):
    register("dilated", dilated)
