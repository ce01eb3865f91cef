"""vslash: MInference's vertical-slash pattern (Jiang et al. 2024): per head, the key columns and the
diagonals the sample's last queries attend to most."""

from dataclasses import replace

import torch

from gtx import KeySelection, Pattern, hookimpl, parse_pattern, selection


def lines(q: torch.Tensor, k: torch.Tensor, v: int, sl: int, last: int, sink: int, local: int):
    """One sample's verticals and slashes, q and k (n, H, D) with q pre-scaled: the ``last`` queries'
    softmax over the keys at or before them, summed per key (a column) and per distance q - k (a
    diagonal); the first ``sink`` columns and the ``local`` nearest diagonals always kept. Returns
    (columns (H, v'), distances (H, sl')), v' = min(v, n), sl' = min(sl, n)."""
    n = len(q)
    pos = torch.arange(n - min(last, n), n, device=q.device)  # the last queries' positions
    distance = pos[:, None] - torch.arange(n, device=q.device)[None, :]  # (last, n); < 0: a later key
    score = torch.einsum("thd,shd->hts", q[pos], k).masked_fill(distance < 0, float("-inf"))
    p = score.softmax(-1)  # (H, last, n), 0 on later keys
    column = p.sum(1)
    diagonal = torch.zeros_like(column).index_add_(1, distance.clamp_min(0).flatten(), p.flatten(1))
    column[:, :sink], diagonal[:, :local] = float("inf"), float("inf")
    return selection.top_later_first(column, v)[1], selection.top_later_first(diagonal, sl)[1]


def vslash(v: int = 64, sl: int = 128, last: int = 64, sink: int = 4, local: int = 64) -> Pattern:
    """Vertical-slash (MInference): per sample and head, the v key columns and sl diagonals that the
    sample's last queries attend to most; each query reads those of them at or before it.

    Args:
        v: vertical columns (key positions) per head, the first ``sink`` among them.
        sl: slash diagonals (distances q - k) per head, the ``local`` nearest among them.
        last: the queries the choice is estimated from: the sample's last ``last`` (MInference's 64).
        sink: the first key positions always kept as columns (MInference 30, the Sparse Frontier 4).
        local: the nearest diagonals always kept, 0 (the query itself) first (MInference 100, the
            Sparse Frontier 64). At least one of sink and local: every query then reads a key.

    Note:
        As MInference's ``vertical_and_slash_kernel`` (and the Sparse Frontier's copy of it) chooses:
        the softmax of the last queries (pre-scaled) over the keys, causal among themselves; columns
        ranked by their summed probability, diagonals by the probability summed along them. Query t
        reads the columns c <= t and the keys t - d of the diagonals d <= t, each key once
        (a ``KeySelection``: C kernel on the CPU). MInference's kernel reads the slashes in blocks
        of 64 keys, a superset; here exactly the pattern. Decoder self-attention (``dd``) only, other
        stages keep full attention. A prefill method: the choice reads the sample's last queries, so
        in training a query's keys depend on later tokens (which keys, never their values). The
        choice has no gradient. Budget: v + sl keys per query.

    Checked:
        ``tests/test_inference_methods.py::test_vslash_chooses_as_its_definition`` (columns, diagonals and
        each query's keys, exactly, against MInference's choice written out in plain torch) and
        ``test_vslash_attends_over_exactly_its_keys``: the output equals float64 dense attention over the
        keys the definition chooses at atol and rtol 1e-5, the q, k, v gradients at atol 2e-5 and rtol 1e-5.
    """
    if min(v, sl, last) < 1 or not (0 <= sink <= v and 0 <= local <= sl):
        raise ValueError(
            f"need v, sl, last >= 1 and 0 <= sink <= v, 0 <= local <= sl (the kept lines are among the chosen), "
            f"got v={v}, sl={sl}, last={last}, sink={sink}, local={local}"
        )
    if sink + local < 1:
        raise ValueError(
            "keep the first column (sink >= 1) or the query's own diagonal (local >= 1): else a query may read nothing"
        )
    candidates = parse_pattern("full")

    def select(q, k, edges):
        if edges.stage != "dd":
            return None  # full attention on the other stages
        keys = torch.zeros(len(q), q.shape[1], v + sl, dtype=torch.long, device=q.device)
        valid = torch.zeros(keys.shape, dtype=torch.bool, device=q.device)
        start = 0
        for n in edges.sample_lens()[0]:
            columns, distances = lines(q[start : start + n], k[start : start + n], v, sl, last, sink, local)
            t = torch.arange(n, device=q.device)[:, None, None]
            both = torch.cat([columns.expand(n, -1, -1), t - distances], -1)  # (n, H, v' + sl')
            both = both.masked_fill((both < 0) | (both > t), n).sort(-1).values  # n: nothing
            fresh = torch.ones_like(both, dtype=torch.bool)
            fresh[..., 1:] = both[..., 1:] != both[..., :-1]  # a key both a column and on a diagonal: once
            width = both.shape[-1]
            valid[start : start + n, :, :width] = fresh & (both < n)
            keys[start : start + n, :, :width] = both.masked_fill(both == n, 0) + start
            start += n
        return KeySelection(keys.masked_fill(~valid, 0), valid)

    return replace(candidates, select=select, budget=v + sl)


@hookimpl
def register_patterns(register):
    register("vslash", vslash)
