"""causal: every self-attention stage sees only earlier-or-same positions; cross attention complete."""

from gtx import Pattern, everything, hookimpl


def causal() -> Pattern:
    """Unidirectional: ee and dd see positions <= the query's; ed sees every source token.

    Note:
        Self-edges included. The encoder is causal too (a left-to-right encoder); with ``ed``
        complete, the decoder still reads the whole source.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[causal]``: its edges on ``ee``, ``dd`` and ``ed``
        equal, as sets and exactly, those of the rule written out from the definition in ``tests/oracles.py``,
        at lengths 1 to 40.
    """

    def left(q, k, n_q, n_k):
        return k <= q

    return Pattern(ee=left, dd=left, ed=everything, structures={"ee": "causal", "dd": "causal", "ed": "complete"})


@hookimpl
def register_patterns(register):
    register("causal", causal)
