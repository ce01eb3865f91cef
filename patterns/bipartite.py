"""bipartite: only cross attention mixes tokens; self-attention stages keep just the self-edge."""

from gtx import Pattern, everything, hookimpl


def bipartite() -> Pattern:
    """Cross attention only: ed complete bipartite; ee and dd hold only self-edges.

    Note:
        The self-edge keeps every query non-empty, so the self-attention sub-layers reduce to a
        per-token value projection: an ablation of within-sequence mixing.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[bipartite]``: its edges on ``ee``, ``dd`` and
        ``ed`` equal, as sets and exactly, those of the rule written out from the definition in
        ``tests/oracles.py``, at lengths 1 to 40.
    """

    def self_only(q, k, n_q, n_k):
        return q == k

    return Pattern(ee=self_only, dd=self_only, ed=everything)


@hookimpl
def register_patterns(register):
    register("bipartite", bipartite)
