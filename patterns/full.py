"""full: the classic Transformer: complete ``ee``, causal ``dd``, complete bipartite ``ed``."""

from gtx import hookimpl
from gtx.graph.pattern import Pattern, causal, everything


def full() -> Pattern:
    """Classic Transformer: all keys in ee and ed, all earlier-or-same positions in dd.

    Note:
        Self-edges included. ``dd`` is the causal (half-complete) graph: the most a decoder may see.
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
