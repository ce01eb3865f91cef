"""act: ACT-filtered edges: the wrapped pattern's edges whose query node is still active."""

from dataclasses import replace

from gtx import Pattern, hookimpl


def keep_active(edges, active):
    """Keep the edges whose query (dst) node is active; ``active`` is a bool tensor over queries."""
    return edges.filter_dst(active)


def act(inner: Pattern) -> Pattern:
    """ACT-filtered: the inner pattern's edges into still-active nodes, re-filtered every step.

    Note:
        Written ``act(local:w=4)``. With all nodes active it equals the inner pattern; the Universal
        Transformer (and ``lm``, ``encoder`` with ``universal=true``) applies it around whatever
        pattern a run chooses, so there ``act(P)`` is ``P``; a model without ACT refuses it. Keys
        are never filtered: a halted node keeps its frozen state and stays visible to active queries.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[act]``: with every node active its edges equal the
        inner pattern's rule exactly (``act(local:w)`` against ``tests/oracles.py``'s ``local``);
        ``test_act_filters_edges_into_halted_queries``: a halted query keeps no edge, an active one all of its.
    """
    return replace(inner, filter=keep_active)


@hookimpl
def register_patterns(register):
    register("act", act)
