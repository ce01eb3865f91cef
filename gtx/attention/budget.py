"""The budget account: per stage, the keys each query's attention read, counted where it runs.

``Attention`` adds every call to its ``Account``: the keys one head read (the mean over heads),
summed over the call's queries that attend (an ACT step's active nodes alone, ``EdgeSet.keep``),
those queries, and the keys the stage allows them (``allowed_keys``), plus any keys a method offers
beyond the stage's tokens (NSA's compressed keys). The results' ``edges_per_query_<stage>`` is keys
over queries and ``density`` keys over allowed, summed over layers, steps and batches: a mean per
query per attention call, never above 1 (a count above what the queries can see is refused).
"""

from __future__ import annotations

import torch

from gtx.errors import PluginError
from gtx.graph.tokens import EdgeSet


def allowed_keys(edges: EdgeSet) -> torch.Tensor:
    """(n_dst,) float: per query, the keys its stage allows over its sample (``possible_edges`` per
    query): for ``dd`` its position + 1 (the causal triangle; a sample's queries are its last
    positions, as in decoding, where it has more keys), else its sample's key count."""
    root = edges.root

    def build():
        q_lens, k_lens = (torch.as_tensor(x) for x in root.sample_lens())
        if root.stage == "dd":
            start = torch.repeat_interleave(torch.cumsum(q_lens, 0) - q_lens, q_lens)
            per = torch.arange(int(q_lens.sum())) - start + 1 + torch.repeat_interleave(k_lens - q_lens, q_lens)
        else:
            per = torch.repeat_interleave(k_lens, q_lens)
        return per.to(torch.float64).to(root.device)

    return root.plan("allowed keys", build)


def allowed_total(edges: EdgeSet) -> float:
    """``allowed_keys(edges)`` summed, for a full set (not an ACT subset): from the sample lengths
    alone, no tensor (a plain call's account costs a few additions)."""

    def total():
        q_lens, k_lens = edges.sample_lens()
        if edges.stage == "dd":
            return float(sum(nq * (nq + 1) // 2 + nq * (nk - nq) for nq, nk in zip(q_lens, k_lens)))
        return float(sum(nq * nk for nq, nk in zip(q_lens, k_lens)))

    return edges.plan("allowed keys total", total)


def on_active(count, edges: EdgeSet) -> float:
    """A per-query count (n_dst,) summed over the queries the call attends with (``edges.keep``), or a number as given."""
    if not isinstance(count, torch.Tensor):
        return float(count)
    count = count.to(torch.float64)
    return float((count if edges.keep is None else count[edges.keep]).sum())


class Account:
    """Per stage: [keys read, queries, keys allowed], summed over calls since ``take``."""

    def __init__(self):
        self.stages: dict[str, list[float]] = {}

    def add(self, spec: str, edges: EdgeSet, keys: float, offered=0.0) -> None:
        """One call's ``keys`` (one head's, over its active queries); ``offered``: keys beyond the
        stage's tokens the method made available to them (a number, or per query)."""
        queries = edges.n_dst if edges.keep is None else int(edges.keep.sum())
        every = allowed_total(edges) if edges.keep is None else on_active(allowed_keys(edges), edges)
        allowed = every + on_active(offered, edges)
        if keys > allowed * (1 + 1e-9) + 1e-6:
            raise PluginError(
                f"pattern {spec!r} reports {keys:g} keys read by {queries} queries ({edges.stage}), more than the "
                f"{allowed:g} they can see; count keys read by several branches once (run.read)"
            )
        total = self.stages.setdefault(edges.stage, [0.0, 0.0, 0.0])
        total[0] += keys
        total[1] += queries
        total[2] += allowed

    def take(self) -> dict[str, tuple[float, float, float]]:
        """The sums since the last call, per stage; then cleared."""
        out = {stage: tuple(t) for stage, t in self.stages.items()}
        self.stages.clear()
        return out


def generated_keys(pattern, prompt: int, generated: int) -> tuple[float, int]:
    """(keys, queries): the keys the queries of generated tokens read under ``pattern``'s ``dd`` rule
    after a prompt of ``prompt`` tokens, summed, and those queries: the ``generated - 1`` positions
    from ``prompt`` on (the first generated token is read off the prompt's last query, the last one
    is read by none). A fixed pattern's edges; a selection's budget, at most its candidates'; head
    groups averaged. NaN keys for a pattern that learns which keys it reads (nsa, dsa)."""
    queries = max(generated - 1, 0)
    n = prompt + queries
    if pattern.heads:
        return sum(generated_keys(p, prompt, generated)[0] for p in pattern.heads) / len(pattern.heads), queries
    if pattern.trainable is not None:
        return float("nan"), queries
    if not queries:
        return 0.0, 0
    if pattern.structure("dd", n, n) == "causal":  # full, and selections among every earlier key: no edge built
        degree = torch.arange(prompt, n, dtype=torch.float64) + 1
    else:
        degree = torch.bincount(pattern.edges("dd", n, n)[1], minlength=n)[prompt:].to(torch.float64)
    if pattern.budget:
        degree = degree.clamp(max=pattern.budget)
    return float(degree.sum()), queries
