"""full: the classic Transformer: complete ``ee``, causal ``dd``, complete bipartite ``ed``."""

from gtx import Pattern, causal, everything, hookimpl


def full() -> Pattern:
    """Classic Transformer: all keys in ee and ed, all earlier-or-same positions in dd.

    Note:
        Self-edges included. ``dd`` is the causal (half-complete) graph: the most a decoder may see.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[full]``: its edges on ``ee``, ``dd`` and ``ed``
        equal, as sets and exactly, those of the rule written out from the definition in ``tests/oracles.py``,
        at lengths 1 to 40.
    """
    return Pattern(
        ee=everything,
        dd=lambda q, k, n_q, n_k: causal(q, k),
        ed=everything,
        structures={"ee": "complete", "dd": "causal", "ed": "complete"},
    )


@hookimpl
def register_patterns(register):
    register("full", full)
