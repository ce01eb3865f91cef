"""lsh: per head, the candidate keys that hash to the query's bucket (Reformer's angular LSH)."""

from dataclasses import replace

import torch

from gtx import Pattern, PatternError, hookimpl, parse_pattern


def lsh(inner: Pattern = None, buckets: int = 8, seed: int = 0) -> Pattern:
    """LSH: per head, the candidates in the query's hash bucket (random rotations), plus the key at the query's own position.

    Note:
        After Kitaev et al. 2020 (Reformer): a bucket is argmax([xR, -xR]) for a fixed random
        rotation R per head (``seed``), applied to queries and keys alike (Reformer shares them),
        so q.k-similar pairs tend to share one. Every query also keeps the candidate at its own
        position (the last one before it where it has none), so no query is left empty. It scores
        no pair, but reads every candidate edge to compare buckets. No gradient through the choice.

    Checked:
        Its candidates: ``tests/test_patterns.py::test_pattern_matches_oracle[lsh]`` (full's rule, exactly). Its
        choice: ``tests/test_attention.py::test_selections_keep_a_subset_of_candidates_and_every_query`` (a
        subset of the candidates, no query left without a key) and
        ``tests/test_attention.py::test_every_backend_agrees_with_dense_on_values_and_gradients``: every
        backend's output and q, k, v gradients equal the dense reference's at atol and rtol 1e-5. No test
        compares its buckets with a definition written out.
    """
    if buckets < 2 or buckets % 2:
        raise ValueError(f"buckets must be even and >= 2, got {buckets}")
    candidates = inner or parse_pattern("full")
    if not candidates.plain:
        raise PatternError(f"lsh selects among fixed candidates; {candidates.spec!r} is not one")

    def select(q, keys, edges):
        heads, dim = q.shape[1], q.shape[2]
        rotation = torch.randn(heads, dim, buckets // 2, generator=torch.Generator().manual_seed(seed)).to(q)

        def bucket(x):
            r = torch.einsum("nhd,hdb->nhb", x, rotation)
            return torch.cat([r, -r], -1).argmax(-1)  # (n, H)

        keep = bucket(q)[edges.dst] == bucket(keys)[edges.src]
        q_pos, k_pos = edges.positions()
        nearest = torch.full((edges.n_dst,), -1, dtype=torch.long, device=q.device)
        # own position, or the last before it
        nearest = nearest.scatter_reduce(0, edges.dst, torch.where(k_pos <= q_pos, k_pos, -1), "amax")
        first = torch.zeros(edges.n_dst, dtype=torch.long, device=q.device).scatter_reduce(
            0, edges.dst, k_pos, "amin", include_self=False
        )
        fallback = torch.where(nearest >= 0, nearest, first)  # a query with only later keys keeps its first
        return keep | (k_pos == fallback[edges.dst])[:, None]

    return replace(candidates, select=select)


@hookimpl
def register_patterns(register):
    register("lsh", lsh)
