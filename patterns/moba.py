"""moba: Mixture of Block Attention: per query block, the top-k earlier key blocks by mean-pooled keys."""

from dataclasses import replace

import torch

from gtx import hookimpl
from gtx.attention.selection import BlockSelection, block_means
from gtx.graph.pattern import Pattern
from gtx.graph.spec import parse_pattern


def moba(b: int = 64, k: int = 3) -> Pattern:
    """MoBA: per query block of b positions, its own block (causal) and the k earlier key blocks whose mean key scores highest.

    Note:
        After Lu et al. 2025 (MoBA), with block-level gating: a query block's mean query is scored
        against each earlier block's mean key, per head; no n x n score matrix is formed, and the
        selected blocks run as one block-sparse SDPA call. Decoder self-attention (``dd``) only;
        other stages keep full attention. The choice has no gradient (as in MoBA); the attention
        over the chosen blocks does.
    """
    if b < 1 or k < 0:
        raise ValueError(f"need b >= 1 and k >= 0, got b={b}, k={k}")
    candidates = parse_pattern("full")

    def select(q, keys, edges):
        if edges.stage != "dd":
            return None  # full attention on the other stages
        lens = list(edges.sample_lens()[0])
        qm, km = block_means(q, lens, b), block_means(keys, lens, b)  # (B, H, n, D)
        n = qm.shape[2]
        score = qm @ km.transpose(-1, -2)  # (B, H, n, n): query block x key block
        earlier = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        score = score.masked_fill(~earlier, float("-inf"))
        top = score.topk(min(k, max(n - 1, 0)), dim=-1)
        own = torch.arange(n, device=q.device).expand(*score.shape[:2], n)[..., None]
        key_blocks = torch.cat([own, top.indices], -1)
        valid = torch.cat([torch.ones_like(own, dtype=torch.bool), top.values > float("-inf")], -1)
        return BlockSelection(b, lens, key_blocks.masked_fill(~valid, 0), valid)

    return replace(candidates, select=select, budget=(k + 1) * b)


@hookimpl
def register_patterns(register):
    register("moba", moba)
