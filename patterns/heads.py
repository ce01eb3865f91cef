"""heads: one pattern per group of heads (the Sparse Transformer's factorised heads)."""

import torch

from gtx import STAGES, Pattern, hookimpl


def heads(inner) -> Pattern:
    """Head groups: heads(a,b,...) splits the heads evenly, in order, one pattern per group.

    Note:
        ``heads(local:w=32,strided:l=64)`` gives the first half of the heads a window and the other
        half a stride. The number of heads must be a multiple of the number of groups. Each group
        is validated like any pattern; density and edges per query count what one head attends to
        (the mean over groups).

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[heads]``: the set's edges equal the union of its
        groups' rules exactly;
        ``tests/test_attention.py::test_every_backend_agrees_with_dense_on_values_and_gradients``: every
        backend's output and q, k, v gradients equal the dense reference's at atol and rtol 1e-5, each group
        attending over its own edges.
    """
    groups = inner if isinstance(inner, tuple) else (inner,)
    if len(groups) == 1:
        return groups[0]

    def union(stage):
        rules = [g.rule(stage) for g in groups]
        return lambda q, k, n_q, n_k: torch.stack(torch.broadcast_tensors(*(r(q, k, n_q, n_k) for r in rules))).any(0)

    return Pattern(
        **{s: union(s) for s in STAGES}, heads=groups, filter=next((g.filter for g in groups if g.filter), None)
    )


@hookimpl
def register_patterns(register):
    register("heads", heads)
