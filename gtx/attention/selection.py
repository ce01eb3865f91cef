"""Helpers for patterns that choose edges from the queries and keys at run time.

The forms of a selection (``Pattern.select(q, k, edges)``, see ``gtx.attention``):

- a bool mask (E, H) over the candidate edges: any chooser (``topk``, ``lsh``); the attention then
  runs per head over the kept edges, on any backend;
- a ``KeySelection``: per query and head, the keys it reads (``topk``); ``attend_keys``;
- a ``TokenBlockSelection``: per query token and head, the earlier blocks it reads besides its own
  (``moba``, MoBA's gate); ``attend_token_blocks`` merges the blocks' partial softmaxes;
- a ``BlockSelection``: per sample, head and query block of ``block`` positions, the key blocks it
  reads (``moba:...,gate=block``). ``attend_blocks`` runs it as one block-sparse SDPA call.

The last three list no edges and never build an n x n matrix; all are subsets of their candidates.
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


@dataclass
class TokenBlockSelection:
    """MoBA's choice, per query token: each token reads its own block causally and the earlier
    blocks ``blocks[t, h, :]`` (indices within its sample, in blocks of ``block`` positions) where
    ``valid``; shapes (n, H, K). Always a subset of causal attention. ``attend_token_blocks`` runs it."""

    block: int
    lens: list[int]
    blocks: torch.Tensor
    valid: torch.Tensor

    def edges_per_head(self) -> float:
        """Edges one head attends over, summed over the batch: the own blocks' causal part and a whole block per chosen one."""
        own = sum(n * (n + 1) // 2 - _tail(n, self.block) for n in self.lens)
        return own + float(self.valid.sum()) * self.block / self.valid.shape[1]

    def as_mask(self, edges: EdgeSet) -> torch.Tensor:
        """The same choice as a keep mask (E, H) over causal candidate edges."""
        q_pos, k_pos = edges.positions()
        qb, kb = (q_pos // self.block)[:, None], (k_pos // self.block)[:, None, None]
        chosen = ((self.blocks[edges.dst] == kb) & self.valid[edges.dst]).any(-1)  # (E, H)
        return chosen | (kb[..., 0] == qb)


def choose_token_blocks(q: torch.Tensor, k: torch.Tensor, lens: list[int], block: int, count: int) -> TokenBlockSelection:
    """Per token and head, the ``count`` earlier blocks whose mean key scores highest with the token's
    query (MoBA's gate): scores (B, L, H, n_blocks), never an n x n matrix. q, k (n, H, D) rows of
    concatenated samples of ``lens``."""
    n_blocks = -(-max(lens) // block)
    length = n_blocks * block
    means = block_means(k, lens, block)  # (B, H, n_blocks, D)
    score = torch.einsum("blhd,bhnd->blhn", pad_samples(q, lens, length), means)
    own = torch.arange(length, device=q.device) // block
    later = torch.arange(n_blocks, device=q.device)[None, :] >= own[:, None]  # (L, n_blocks): the own block and after
    score = score.masked_fill(later[None, :, None, :], float("-inf"))
    top = score.topk(min(count, n_blocks), dim=-1)
    rows = torch.cat([top.indices[i, :n] for i, n in enumerate(lens)]), torch.cat([top.values[i, :n] for i, n in enumerate(lens)])
    return TokenBlockSelection(block, list(lens), rows[0], rows[1] > float("-inf"))


def attend_token_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, sel: TokenBlockSelection) -> torch.Tensor:
    """Attention under a token-gated block selection: (n, H, D) in and out. The own block runs as
    causal block-diagonal attention; the chosen earlier blocks as tiles of up to ``block`` queries
    that chose the same block of the same head, scored against that block's keys; the partial
    softmaxes merge by their log-sum-exp (as MoBA's own kernel does). Memory follows the edges:
    (tokens x chosen blocks) rows of D, and block x block scores per tile."""
    b, lens = sel.block, sel.lens
    n, heads, dim = q.shape
    n_b = -(-max(lens) // b)
    length = n_b * b

    def blocks(x):  # (n, H, D) -> (B, H, n_blocks, b, D)
        return pad_samples(x, lens, length).view(len(lens), n_b, b, heads, x.shape[-1]).permute(0, 3, 1, 2, 4)

    kb, vb = blocks(k), blocks(v)
    # own block: causal within it; padding keys lie after every real query of their block, so the causal mask hides them
    scores = blocks(q) @ kb.transpose(-1, -2)  # (B, H, n_blocks, b, b)
    scores = scores.masked_fill(~torch.ones(b, b, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    own_lse = scores.logsumexp(-1)
    own = (scores - own_lse[..., None]).exp() @ vb  # (B, H, n_blocks, b, Dv)

    def rows(x):  # (B, H, n_blocks, b, ...) -> (n, H, ...)
        x = x.permute(0, 2, 3, 1, *range(4, x.dim())).reshape(len(lens), length, heads, *x.shape[4:])
        return torch.cat([x[i, :m] for i, m in enumerate(lens)])

    outs, lses = [rows(own)], [rows(own_lse)]  # per (token, head): the own block first
    slots = sel.blocks.shape[-1]
    if slots and bool(sel.valid.any()):
        sample = torch.repeat_interleave(torch.arange(len(lens), device=q.device), torch.as_tensor(lens, device=q.device))
        token, head, slot = sel.valid.nonzero(as_tuple=True)  # the pairs (token, head, chosen block)
        group = (sample[token] * heads + head) * n_b + sel.blocks[token, head, slot]  # which (sample, head, block) row of kb
        order = torch.argsort(group, stable=True)
        token, head, slot, group = token[order], head[order], slot[order], group[order]
        first = torch.searchsorted(group, group, side="left")  # where each pair's group starts
        rank = torch.arange(len(group), device=q.device) - first
        tiles_per = torch.zeros(len(lens) * heads * n_b, dtype=torch.long, device=q.device).index_add_(0, group, torch.ones_like(group))
        tiles_per = (tiles_per + b - 1) // b
        tile = (torch.cumsum(tiles_per, 0) - tiles_per)[group] + rank // b
        n_tiles = int(tiles_per.sum())
        place = tile * b + rank % b  # each pair's row among the tiles' b query places
        qt = torch.zeros(n_tiles * b, dim, dtype=q.dtype, device=q.device).index_copy(0, place, q[token, head]).view(n_tiles, b, dim)
        key_rows = torch.zeros(n_tiles, dtype=torch.long, device=q.device).index_copy(0, tile, group)  # each tile's block
        kt = kb.reshape(-1, b, dim).index_select(0, key_rows)
        vt = vb.reshape(-1, b, vb.shape[-1]).index_select(0, key_rows)
        s = qt @ kt.transpose(-1, -2)  # (tiles, b, b); earlier blocks are whole: no key is padding
        lse = s.logsumexp(-1)
        part = ((s - lse[..., None]).exp() @ vt).reshape(n_tiles * b, -1)[place]
        pair_out = torch.zeros(n, heads, slots, part.shape[-1], dtype=part.dtype, device=q.device).index_put((token, head, slot), part)
        pair_lse = torch.full((n, heads, slots), float("-inf"), dtype=lse.dtype, device=q.device)
        pair_lse = pair_lse.index_put((token, head, slot), lse.reshape(-1)[place])
        outs.append(pair_out.permute(0, 1, 3, 2))
        lses.append(pair_lse)
    out = torch.cat([outs[0][..., None], *outs[1:]], -1) if len(outs) > 1 else outs[0][..., None]  # (n, H, Dv, 1 + slots)
    weight = torch.softmax(torch.cat([lses[0][..., None], *lses[1:]], -1), -1)  # each part's share of the whole softmax
    merged = (out * weight[:, :, None, :]).sum(-1)
    return merged if edges.keep is None else merged * edges.keep[:, None, None].to(merged.dtype)
