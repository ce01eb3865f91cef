"""Attention over compressed blocks of keys (NSA's compressed branch, arXiv 2502.11089 eq. 7).

Each sample's keys are cut into blocks of ``size`` positions at ``stride`` (``sliding_blocks``); a
pattern compresses each block to one key and one value. Block i holds positions
``i * stride .. i * stride + size - 1`` and ends at ``ends[i]``; a query at position t sees the
blocks that end at or before it (``ends[i] <= t``), so no future key leaks through a compressed
one. A query that sees none gets zeros.

Both functions run a block of query rows at a time: (rows x blocks) scores, never n x n; on an
accelerator the blocks of rows are ``chunk_scale`` times larger.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gtx.attention.selection.blocks import pad_samples, unpad_samples
from gtx.attention.selection.choice import softmax_
from gtx.attention.selection.kernels import record, use_triton
from gtx.attention.selection.token_tiles import chunk_scale

ROWS = 512  # query rows attended at once
# query rows weighed at once for a choice: its scores are rows x compressed blocks, so smaller
# blocks of rows bound the peak memory, and at long lengths are no slower (the scores stay in cache)
CHOICE_ROWS = 256


def sliding_blocks(x: torch.Tensor, lens: list[int], size: int, stride: int) -> torch.Tensor:
    """(n, H, D) rows of concatenated samples -> (B, m, size, H, D): the blocks of ``size`` positions
    at ``stride`` over each zero-padded sample, m = (max(lens) - size) // stride + 1 (0 if shorter)."""
    length = max(lens)
    padded = pad_samples(x, lens, length)  # (B, L, H, D)
    if length < size:
        return padded.new_zeros(len(lens), 0, size, *x.shape[1:])
    return padded.unfold(1, size, stride).permute(0, 1, 4, 2, 3)


def block_ends(m: int, size: int, stride: int, device) -> torch.Tensor:
    """(m,) the last position of each of ``sliding_blocks``' blocks."""
    return torch.arange(m, device=device) * stride + size - 1


def compressed_keys_seen(lens: list[int], ends: torch.Tensor) -> int:
    """Compressed keys one head attends over, summed over the queries of every sample."""
    return sum(int((n - ends).clamp_min(0).sum()) for n in lens)


def attend_compressed(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    lens: list[int],
    ends: torch.Tensor,
    weight: torch.Tensor | None = None,
    stage: str = "dd",
) -> torch.Tensor:
    """Each query over the compressed blocks it sees: q (n, H, D) pre-scaled rows of samples
    ``lens``; kc, vc (B, m, H, D) the samples' compressed keys and values; ``weight`` (n, H) or None:
    each output row scaled by it (NSA's gate). Returns (n, H, Dv), on SDPA's kernel a block of query
    rows at a time, each block recomputed in the backward (checkpoint) with its mask and weights:
    the backward keeps q, kc, vc and the weight, not SDPA's state, the masks or the output. Where
    ``kernels.use_triton``, one fused Triton kernel runs it instead (``triton_blocks.compressed``);
    the kernel that ran is recorded under ``stage``."""
    if use_triton(q.device):
        from gtx.attention.selection import triton_blocks

        record(stage, "triton:compressed")
        return triton_blocks.compressed(q, kc, vc, lens, ends, weight)
    record(stage, "sdpa:compressed")
    qp = pad_samples(q, lens, max(lens)).transpose(1, 2)  # (B, H, L, D)
    kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)  # (B, H, m, D)
    wp = None if weight is None else pad_samples(weight[..., None], lens, max(lens)).transpose(1, 2)  # (B, H, L, 1)
    # the blocks of rows by one split, not a slice each: a slice's backward is a zeroed tensor the size
    # of all rows, one per block, summed into q's gradient; the split's is one of that size, once
    step = ROWS * chunk_scale(q.device)
    q_blocks = qp.split(step, 2)
    w_blocks = None if wp is None else wp.split(step, 2)
    parts = []
    for r0, r1, take, seen in _row_blocks(lens, ends, step):
        part = qp.new_zeros(*qp.shape[:2], r1 - r0, vt.shape[-1])
        if seen:
            w = None if wp is None else take(w_blocks[r0 // step])
            rows = checkpoint(
                _attend_rows,
                take(q_blocks[r0 // step]),
                take(kt[:, :, :seen]),
                take(vt[:, :, :seen]),
                ends[:seen],
                r0,
                w,
                use_reentrant=False,
            )
            part = rows if take.every else part.index_copy(0, take.samples, rows)
        parts.append(part)
    return unpad_samples(torch.cat(parts[::-1], 2).transpose(1, 2), lens)


def _attend_rows(q, kt, vt, ends, r0, weight):
    visible = _visible(ends, r0, q.shape[2])
    empty = ~visible[:, 0]  # rows that see no block yet: attend to block 0, then zeroed
    out = F.scaled_dot_product_attention(q, kt, vt, attn_mask=visible | empty[:, None], scale=1.0)
    out = out.masked_fill(empty[:, None], 0.0)
    return out if weight is None else out * weight


def _visible(ends: torch.Tensor, r0: int, rows: int) -> torch.Tensor:
    """(rows, len(ends)) whether query position r0 + i sees block j: the block ends at or before it."""
    return ends[None, :] <= torch.arange(r0, r0 + rows, device=ends.device)[:, None]


class _Samples:
    """The samples long enough to have rows in a block of rows: ``take(x)`` keeps them along dim 0
    (x itself, not a copy, when every sample has)."""

    def __init__(self, lens: list[int], r0: int, device):
        self.every = min(lens) > r0
        # made only where needed: a tensor from the host is a sync on a GPU
        self.samples = None if self.every else torch.tensor([i for i, n in enumerate(lens) if n > r0], device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.every else x.index_select(0, self.samples)

    @property
    def rows(self):
        """Where the kept samples lie along dim 0, to write their results back: all, or their indices."""
        return slice(None) if self.every else self.samples


def _row_blocks(lens: list[int], ends: torch.Tensor, rows: int):
    """(r0, r1, take, seen) per block of ``rows`` query positions of the padded samples: ``take`` the
    samples with rows in it (a shorter one's are padding: scoring them cost up to 9x the work on
    batches of mixed lengths), ``seen`` how many compressed blocks end before r1 (ends ascend: the
    blocks any of the rows sees are a prefix). The last rows first: their buffers are the largest (they
    see the most blocks), so each later block's fit in memory an earlier one freed, where in
    ascending order each needs more than any hole left (glibc keeps freed heap memory resident)."""
    length = max(lens)
    ends_at = ends.tolist()  # once on the host: a count per block of rows was a sync each on a GPU
    for r0 in reversed(range(0, length, rows)):
        r1 = min(r0 + rows, length)
        yield r0, r1, _Samples(lens, r0, ends.device), bisect.bisect_right(ends_at, r1 - 1)


def compressed_weights(q: torch.Tensor, kc: torch.Tensor, lens: list[int], ends: torch.Tensor):
    """The compressed branch's attention weights, a block of query rows at a time: yields
    (r0, r1, take, weights (B', H, r1 - r0, seen)) over padded positions r0..r1 of the B' samples
    ``take`` keeps (see ``_row_blocks``) and the blocks that end before r1 (a prefix: ends ascend;
    later blocks have weight 0), zero where a block is unseen."""
    qp = pad_samples(q, lens, max(lens)).transpose(1, 2)
    kt = kc.transpose(1, 2)
    for r0, r1, take, seen in _row_blocks(lens, ends, CHOICE_ROWS * chunk_scale(q.device)):
        score = take(qp[:, :, r0:r1]) @ take(kt[:, :, :seen]).transpose(-1, -2)
        yield (
            r0,
            r1,
            take,
            softmax_(score.masked_fill_(~_visible(ends[:seen], r0, r1 - r0), float("-inf"))) if seen else score,
        )
