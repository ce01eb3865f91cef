"""Helpers for patterns that choose edges from the queries and keys at run time.

The forms of a selection (``Pattern.select(q, k, edges)``, see ``gtx.attention``):

- a bool mask (E, H) over the candidate edges: any chooser (``topk``, ``lsh``); the attention then
  runs per head over the kept edges, on any backend;
- a ``gtx.attention.selection.keys.KeySelection``: per query and head, the keys it reads (``topk``, ``dsa``);
  ``attend_keys``;
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

from gtx.attention.selection import token_tiles
from gtx.attention.selection.kernels import record, use_triton
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
    earlier key blocks ``key_blocks[b, h // group, i, 1:]`` where ``valid``. Shapes
    (B, H // group, n_blocks, K): ``group`` heads in a row share one choice (head h reads row
    h // group; group=1: a choice per head); slot 0 is the own block. Samples are padded to
    ``n_blocks * block`` positions."""

    block: int
    lens: list[int]
    key_blocks: torch.Tensor
    valid: torch.Tensor
    group: int = 1

    def per_head(self) -> BlockSelection:
        """The same choice with a row per head (group=1): itself where it has one."""
        if self.group == 1:
            return self
        kb, valid = (x.repeat_interleave(self.group, 1) for x in (self.key_blocks, self.valid))
        return BlockSelection(self.block, self.lens, kb, valid)

    def per_query(self) -> torch.Tensor:
        """(n,) keys each query token reads, the mean over heads (over the rows: each stands for
        ``group`` heads): its own block's causal part and a whole block per chosen earlier one
        (``gtx.attention.budget``)."""
        chosen = self.valid[..., 1:].sum(-1).to(torch.float64).mean(1)  # (B, n_blocks)
        parts = []
        for i, n in enumerate(self.lens):
            pos = torch.arange(n, device=self.valid.device)
            parts.append(pos % self.block + 1 + chosen[i, pos // self.block] * self.block)
        return torch.cat(parts)

    def edges_per_head(self) -> float:
        """Edges one head attends over, summed over the batch."""
        return float(self.per_query().sum())


def pad_samples(x: torch.Tensor, lens: list[int], length: int) -> torch.Tensor:
    """(N, H, D) rows of concatenated samples -> (B, length, H, D), zero padded."""
    if len(set(lens)) == 1 and lens[0] == length:
        return x.view(len(lens), length, *x.shape[1:])
    return torch.stack([F.pad(part, (0, 0, 0, 0, 0, length - len(part))) for part in torch.split(x, lens)])


def unpad_samples(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """``pad_samples``' inverse: (B, length, ...) -> (sum(lens), ...), padding dropped."""
    if len(lens) > 1:
        return torch.cat([x[i, :n] for i, n in enumerate(lens)])
    x = x.squeeze(0)  # a view, whose backward is a view too: indexing's backward allocates a zeroed copy
    return x if x.shape[0] == lens[0] else x[: lens[0]]


def block_means(x: torch.Tensor, lens: list[int], block: int) -> torch.Tensor:
    """(N, H, D) -> (B, H, n_blocks, D): the mean of each block's real rows (padding left out)."""
    n_blocks = -(-max(lens) // block)
    padded = pad_samples(x, lens, n_blocks * block).view(len(lens), n_blocks, block, *x.shape[1:])
    real = torch.zeros(len(lens), n_blocks * block, device=x.device)
    for i, n in enumerate(lens):
        real[i, :n] = 1
    count = real.view(len(lens), n_blocks, block).sum(-1).clamp_min(1)
    return (padded.sum(2) / count[..., None, None]).transpose(1, 2)


def attend_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, sel: BlockSelection
) -> torch.Tensor:
    """Attention under a block selection: (N, H, D) in and out, one SDPA call for every head, or the
    Triton kernels (``kernels.use_triton``); the kernel that ran is recorded under the edges' stage."""
    if use_triton(q.device):
        from gtx.attention.selection import triton_tiles

        record(edges.stage, "triton:blocks")
        rows = triton_tiles.blocks(q, k, v, sel.lens, sel.block, sel.key_blocks, sel.valid, sel.group)
        return rows if edges.keep is None else rows * edges.keep[:, None, None].to(rows.dtype)
    record(edges.stage, "sdpa:blocks")
    sel = sel.per_head()
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
    mask = torch.cat(
        [
            causal.expand(batch, heads, n_b, b, b),
            sel.valid[..., 1:, None, None]
            .expand(-1, -1, -1, -1, b, b)
            .transpose(3, 4)
            .reshape(batch, heads, n_b, b, (slots - 1) * b),
        ],
        -1,
    )
    out = F.scaled_dot_product_attention(
        qb.reshape(-1, 1, b, dim), gather(kb), gather(vb), attn_mask=mask.reshape(-1, 1, b, slots * b), scale=1.0
    )
    out = out.view(batch, heads, length, v.shape[-1]).transpose(1, 2)  # (B, length, H, Dv)
    rows = unpad_samples(out, lens)
    return rows if edges.keep is None else rows * edges.keep[:, None, None].to(rows.dtype)


@dataclass
class TokenBlockSelection:
    """MoBA's choice, per query token: each token reads its own block causally and the earlier
    blocks ``blocks[t, h // group, :]`` (indices within its sample, in blocks of ``block``
    positions) where ``valid``; shapes (n, H // group, K): ``group`` heads in a row share one
    choice (head h reads row h // group: NSA's ``g``, DSA's one choice for every head; group=1: a
    choice per head). Always a subset of causal attention. ``attend_token_blocks`` runs it."""

    block: int
    lens: list[int]
    blocks: torch.Tensor
    valid: torch.Tensor
    group: int = 1

    def per_head(self) -> TokenBlockSelection:
        """The same choice with a row per head (group=1): itself where it has one."""
        if self.group == 1:
            return self
        blocks, valid = (x.repeat_interleave(self.group, 1) for x in (self.blocks, self.valid))
        return TokenBlockSelection(self.block, self.lens, blocks, valid)

    def per_query(self) -> torch.Tensor:
        """(n,) keys each query token reads, the mean over heads (over the rows: each stands for
        ``group`` heads): its own block's causal part and a whole block per chosen one
        (``gtx.attention.budget``)."""
        own = torch.cat([torch.arange(n, device=self.valid.device) % self.block + 1 for n in self.lens])
        return own + self.valid.sum(-1).to(torch.float64).mean(1) * self.block

    def edges_per_head(self) -> float:
        """Edges one head attends over, summed over the batch."""
        return float(self.per_query().sum())

    def as_mask(self, edges: EdgeSet) -> torch.Tensor:
        """The same choice as a keep mask (E, H) over causal candidate edges."""
        q_pos, k_pos = edges.positions()
        qb, kb = (q_pos // self.block)[:, None], (k_pos // self.block)[:, None, None]
        chosen = ((self.blocks[edges.dst] == kb) & self.valid[edges.dst]).any(-1)  # (E, H // group)
        return chosen.repeat_interleave(self.group, 1) | (kb[..., 0] == qb)


def choose_token_blocks(
    q: torch.Tensor, k: torch.Tensor, lens: list[int], block: int, count: int
) -> TokenBlockSelection:
    """Per token and head, the ``count`` earlier blocks whose mean key scores highest with the token's
    query (MoBA's gate): scores (L, H, blocks of the sample) one sample at a time, never an n x n
    matrix. q, k (n, H, D) rows of concatenated samples of ``lens``."""
    means = block_means(k, lens, block)  # (B, H, n_blocks, D)
    slots = min(count, means.shape[2])
    blocks = torch.zeros(*q.shape[:2], slots, dtype=torch.long, device=q.device)
    valid = torch.zeros(*q.shape[:2], slots, dtype=torch.bool, device=q.device)
    start = 0
    for i, n in enumerate(lens):  # a sample at a time: padded to the longest, recall's mixed lengths scored 3.5-9x more
        n_b = -(-n // block)
        score = torch.einsum("lhd,hnd->lhn", q[start : start + n], means[i, :, :n_b])
        own = torch.arange(n, device=q.device) // block
        later = torch.arange(n_b, device=q.device)[None, :] >= own[:, None]  # (L, n_b): the own block and after
        kept = min(slots, n_b)
        top = score.masked_fill(later[:, None, :], float("-inf")).topk(kept, dim=-1)
        blocks[start : start + n, :, :kept] = top.indices
        valid[start : start + n, :, :kept] = top.values > float("-inf")
        start += n
    return TokenBlockSelection(block, list(lens), blocks, valid)


def attend_token_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    edges: EdgeSet,
    sel: TokenBlockSelection,
    masses: bool = False,
    gate: torch.Tensor | None = None,
):
    """Attention under a token-gated block selection: (n, H, D) in and out. The own block runs as
    causal block-diagonal attention; the chosen earlier blocks as tiles of up to ``block`` queries
    that chose the same block of the same head, against that block's keys; both on SDPA's fused CPU
    kernel (plain torch ops on other devices), their partial softmaxes merged by log-sum-exp (as
    MoBA's own kernel does; ``token_tiles``). Memory follows the edges: no n x n matrix, and per
    chosen block one row of D per query. ``masses``: also each block's share of the attention, averaged over the heads, without gradient: (n, 1 + K), the
    own block first, then ``sel.blocks``' slots (0 where a slot is not valid). ``gate`` (n, H, 1) or
    None: each output row scaled by it (NSA's gate), inside the backward's per-chunk weights: no
    gated copy of the output's gradient. Where ``kernels.use_triton``, the fused Triton kernels run
    it instead (``triton_blocks``); the kernel that ran is recorded under the edges' stage."""
    if use_triton(q.device):
        from gtx.attention.selection import triton_blocks

        record(edges.stage, "triton:token-blocks")
        out, mass = triton_blocks.token_blocks(
            q, k, v, sel.lens, sel.block, sel.blocks, sel.valid, sel.group, gate, masses
        )
    else:
        record(edges.stage, ("cpu-flash" if q.device.type in token_tiles.FUSED_DEVICES else "torch") + ":token-blocks")
        out, mass = token_tiles.TokenBlocks.apply(
            q, k, v, gate, token_tiles.TokenBlockPlan(sel.per_head(), q.shape[1], q.device)
        )
        mass = mass.mean(1) if masses else None
    out = out if edges.keep is None else out * edges.keep[:, None, None].to(out.dtype)
    return (out, mass) if masses else out
