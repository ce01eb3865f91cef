"""longformer: sliding window plus global tokens (Beltagy et al. 2020)."""

from gtx import Pattern, hookimpl


def longformer(w: int = 4, g: int = 1) -> Pattern:
    """Longformer: keys within w on each side, plus g global tokens that see and are seen by all.

    Args:
        w: window on each side (the reference code's ``attention_window`` per side).
        g: number of global tokens: the first g positions of the sequence.

    Note:
        |i - j| <= w or global[i] or global[j] (attention-gym's global sliding window). ``dd`` is
        that & j <= i; ``ed`` evaluates it at the aligned source position, so every target query
        sees the global source tokens. Self included. The paper's separate global projections are
        not modelled: a pattern only chooses edges.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[longformer]``: its edges on ``ee``, ``dd`` and
        ``ed`` equal, as sets and exactly, those of the rule written out from the definition in
        ``tests/oracles.py``, over random parameters and lengths 1 to 40.
    """
    if w < 0 or g < 0:
        raise ValueError(f"need w >= 0 and g >= 0, got w={w}, g={g}")

    def rule(q, k, n_q, n_k):
        return ((q - k).abs() <= w) | (q < g) | (k < g)

    return Pattern.from_rule(rule)


@hookimpl
def register_patterns(register):
    register("longformer", longformer)
