"""topk: per query and head, the k candidate keys with the highest score (exact top-k attention)."""

from dataclasses import replace

from gtx import KeySelection, Pattern, PatternError, hookimpl, parse_pattern, selection


def topk(inner: Pattern = None, k: int = 32) -> Pattern:
    """Top-k: per query and head, the k candidates with the highest q.k (default candidates: full).

    Note:
        ``topk:k=32`` or ``topk(local:w=256):k=32``. Exact: it scores every candidate edge (as
        many as the candidate pattern has, n(n+1)/2 per sample for causal), so it saves attention
        work, not scoring. The choice itself has no gradient; the kept edges' attention does.
        Queries with at most k candidates keep them all.

    Checked:
        ``tests/test_attention.py::test_selections_keep_a_subset_of_candidates_and_every_query``: at most k kept
        keys per query and head, each scoring (q.k) at least as high as every dropped one;
        ``test_topk_without_edges_is_dense_attention_over_the_keys_it_names``: the output equals the dense
        reference over the kept keys at atol and rtol 1e-5;
        ``tests/test_attention.py::test_every_backend_agrees_with_dense_on_values_and_gradients``: every
        backend's output and q, k, v gradients equal the dense reference's at atol and rtol 1e-5.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    candidates = inner or parse_pattern("full")
    if not candidates.plain:
        raise PatternError(
            f"topk selects among fixed candidates; {candidates.spec!r} is not one (write topk(P) with P a fixed pattern)"
        )

    def select(q, keys, edges):
        if edges.root.structure is not None:  # complete or causal candidates: score in blocks, list no edge
            return KeySelection(*selection.top_keys(q, keys, edges, k))
        score = (q[edges.dst] * keys[edges.src]).sum(-1)  # (E, H)
        return selection.top_per_query(score, edges.dst, edges.n_dst, k)

    return replace(candidates, select=select, budget=k)


@hookimpl
def register_patterns(register):
    register("topk", topk)
