"""Helpers for patterns that choose edges from the queries and keys at run time.

Two forms of a selection (``Pattern.select(q, k, edges)``, see ``gtx.attention``):

- a bool mask (E, H) over the candidate edges: any chooser (``topk``, ``lsh``); the attention then
  runs per head over the kept edges, on any backend;
- a ``BlockSelection``: per sample, head and query block of ``block`` positions, the key blocks it
  reads (``moba``), always a subset of causal attention. ``attend_blocks`` runs it as one
  block-sparse SDPA call over all heads, never building an edge list or an n x n matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gtx.graph.tokens import EdgeSet


def top_per_query(score: torch.Tensor, dst: torch.Tensor, n_dst: int, k: int) -> torch.Tensor:
    """Keep mask (E, H): per query and head, the ``k`` highest-scoring edges (all of them where a
    query has fewer); ties broken by edge order. ``score`` (E, H), edges sorted by dst."""
    counts = torch.bincount(dst, minlength=n_dst)
    start = torch.cumsum(counts, 0) - counts
    keep = torch.zeros_like(score, dtype=torch.bool)
    for h in range(score.shape[1]):
        order = torch.argsort(score[:, h], descending=True, stable=True)
        order = order[torch.argsort(dst[order], stable=True)]  # grouped by query, best first
        rank = torch.arange(len(order), device=dst.device) - start[dst[order]]
        keep[order[rank < k], h] = True
    return keep


@dataclass
class BlockSelection:
    """Causal block attention: query block i of a sample reads its own block (causally) and the
    earlier key blocks ``key_blocks[b, h, i, 1:]`` where ``valid``. Shapes (B, H, n_blocks, K);
    slot 0 is the own block. Samples are padded to ``n_blocks * block`` positions."""

    block: int
    lens: list[int]
    key_blocks: torch.Tensor
    valid: torch.Tensor

    def edges_per_head(self) -> float:
        """Edges one head attends over, summed over the batch (for the results' edges per query)."""
        own = sum(n * (n + 1) // 2 - _tail(n, self.block) for n in self.lens) if self.lens else 0
        earlier = float(self.valid[..., 1:].sum()) * self.block * self.block / self.valid.shape[1]
        return own + earlier


def _tail(n: int, b: int) -> int:
    """Causal pairs between different blocks of one sample (what the own-block term leaves out)."""
    full, rest = divmod(n, b)
    within = full * b * (b + 1) // 2 + rest * (rest + 1) // 2
    return n * (n + 1) // 2 - within


def pad_samples(x: torch.Tensor, lens: list[int], length: int) -> torch.Tensor:
    """(N, H, D) rows of concatenated samples -> (B, length, H, D), zero padded."""
    if len(set(lens)) == 1 and lens[0] == length:
        return x.view(len(lens), length, *x.shape[1:])
    return torch.stack([F.pad(part, (0, 0, 0, 0, 0, length - len(part))) for part in torch.split(x, lens)])


def block_means(x: torch.Tensor, lens: list[int], block: int) -> torch.Tensor:
    """(N, H, D) -> (B, H, n_blocks, D): the mean of each block's real rows (padding left out)."""
    n_blocks = -(-max(lens) // block)
    padded = pad_samples(x, lens, n_blocks * block).view(len(lens), n_blocks, block, *x.shape[1:])
    real = torch.zeros(len(lens), n_blocks * block, device=x.device)
    for i, n in enumerate(lens):
        real[i, :n] = 1
    count = real.view(len(lens), n_blocks, block).sum(-1).clamp_min(1)
    return (padded.sum(2) / count[..., None, None]).transpose(1, 2)


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, sel: BlockSelection) -> torch.Tensor:
    """Attention under a block selection: (N, H, D) in and out, one SDPA call for every head."""
    b, lens = sel.block, sel.lens
    n_b, slots = sel.key_blocks.shape[2], sel.key_blocks.shape[3]
    length = n_b * b

    def blocks(x):  # (N, H, D) -> (B, H, n_blocks, b, D)
        return pad_samples(x, lens, length).view(len(lens), n_b, b, *x.shape[1:]).permute(0, 3, 1, 2, 4)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)
    batch, heads, dim = len(lens), q.shape[1], q.shape[2]
    # each (sample, head, query block)'s key blocks as rows of the flattened (B*H*n_blocks, b, D) blocks:
    # index_select (backward: index_add) is several times faster than gather with an expanded index
    base = torch.arange(batch * heads, device=q.device).view(batch, heads, 1, 1) * n_b
    index = (base + sel.key_blocks).flatten()

    def gather(x):  # (B, H, n_blocks, b, D) -> (B*H*n_blocks, 1, slots * b, D)
        return x.reshape(-1, b, x.shape[-1]).index_select(0, index).view(-1, 1, slots * b, x.shape[-1])

    causal = torch.ones(b, b, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([causal.expand(batch, heads, n_b, b, b), sel.valid[..., 1:, None, None].expand(-1, -1, -1, -1, b, b)
                      .transpose(3, 4).reshape(batch, heads, n_b, b, (slots - 1) * b)], -1)
    out = F.scaled_dot_product_attention(qb.reshape(-1, 1, b, dim), gather(kb), gather(vb), attn_mask=mask.reshape(-1, 1, b, slots * b), scale=1.0)
    out = out.view(batch, heads, length, v.shape[-1]).transpose(1, 2)  # (B, length, H, Dv)
    rows = torch.cat([out[i, :n] for i, n in enumerate(lens)]) if len(lens) > 1 or lens[0] != length else out[0]
    return rows if edges.keep is None else rows * edges.keep[:, None, None].to(rows.dtype)


@dataclass
class KeySelection:
    """Per query and head, the keys it attends to: ``keys`` (n_dst, H, K) key ids, ``valid`` (n_dst, H, K)
    (a query with fewer candidates than K leaves slots invalid). Made from complete or causal
    candidates without listing their edges (``topk``)."""

    keys: torch.Tensor
    valid: torch.Tensor

    def edges_per_head(self) -> float:
        return float(self.valid.sum()) / self.valid.shape[1]

    def as_mask(self, edges: EdgeSet) -> torch.Tensor:
        """The same choice as a keep mask (E, H) over the candidate edges."""
        hit = (self.keys[edges.dst] == edges.src[:, None, None]) & self.valid[edges.dst]  # (E, H, K)
        return hit.any(-1)


def top_keys(q: torch.Tensor, k: torch.Tensor, edges: EdgeSet, count: int, rows: int = 512) -> KeySelection:
    """The ``count`` best keys by q.k per query and head, for complete or causal candidates
    (``edges.structure``), scored sample by sample in blocks of query rows: the n x n scores of one
    block exist at a time, never an edge list."""
    root = edges.root
    causal = root.structure == "causal"
    q_lens = list(root.q_lens) if root.q_lens is not None else [root.n_dst]
    k_lens = list(root.k_lens) if root.k_lens is not None else [root.n_src]
    heads = q.shape[1]
    keys = torch.zeros(q.shape[0], heads, count, dtype=torch.long, device=q.device)
    valid = torch.zeros(q.shape[0], heads, count, dtype=torch.bool, device=q.device)
    q_off = k_off = 0
    for nq, nk in zip(q_lens, k_lens):
        kk = k[k_off:k_off + nk].transpose(0, 1)  # (H, nk, D)
        for r0 in range(0, nq, rows):
            r1 = min(r0 + rows, nq)
            score = q[q_off + r0:q_off + r1].transpose(0, 1) @ kk.transpose(1, 2)  # (H, rows, nk)
            if causal:
                later = torch.arange(nk, device=q.device)[None, :] > torch.arange(r0, r1, device=q.device)[:, None]
                score = score.masked_fill(later, float("-inf"))
            top = score.topk(min(count, nk), dim=-1)  # (H, rows, K)
            width = top.indices.shape[-1]
            keys[q_off + r0:q_off + r1, :, :width] = top.indices.permute(1, 0, 2) + k_off
            valid[q_off + r0:q_off + r1, :, :width] = top.values.permute(1, 0, 2) > float("-inf")
        q_off, k_off = q_off + nq, k_off + nk
    return KeySelection(keys, valid)


def attend_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, sel: KeySelection) -> torch.Tensor:
    """Attention of each query and head over its selected keys: (n, H, D) in and out."""
    heads = q.shape[1]
    rows = (sel.keys * heads + torch.arange(heads, device=q.device)[None, :, None]).flatten()  # (key, head) rows of k viewed (n_src * H, D)
    ks, vs = (x.reshape(-1, x.shape[-1]).index_select(0, rows).view(*sel.keys.shape, x.shape[-1]) for x in (k, v))  # (n_dst, H, K, D)
    score = torch.einsum("nhd,nhkd->nhk", q, ks).masked_fill(~sel.valid, float("-inf"))  # batched matmuls: no (n, H, K, D) product
    out = torch.einsum("nhk,nhkd->nhd", torch.softmax(score, -1), vs)
    return out if edges.keep is None else out * edges.keep[:, None, None].to(out.dtype)
