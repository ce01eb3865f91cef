"""Attention over compressed blocks of keys (NSA's compressed branch, arXiv 2502.11089 eq. 7).

Each sample's keys are cut into blocks of ``size`` positions at ``stride`` (``sliding_blocks``); a
pattern compresses each block to one key and one value. Block i holds positions
``i * stride .. i * stride + size - 1`` and ends at ``ends[i]``; a query at position t sees the
blocks that end at or before it (``ends[i] <= t``), so no future key leaks through a compressed
one. A query that sees none gets zeros.

Both functions run a block of query rows at a time: (rows x blocks) scores, never n x n.
"""

from __future__ import annotations

import torch

from gtx.attention.selection import pad_samples, unpad_samples

ROWS = 256  # query rows scored at once


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


def attend_compressed(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: list[int], ends: torch.Tensor) -> torch.Tensor:
    """Each query over the compressed blocks it sees: q (n, H, D) pre-scaled rows of samples
    ``lens``; kc, vc (B, m, H, D) the samples' compressed keys and values. Returns (n, H, Dv). A
    block of query rows at a time, forward and backward (the backward recomputes the weights from
    the saved log-sum-exp): what the backward keeps is q, kc, vc and one number per row."""
    length = max(lens)
    qp = pad_samples(q, lens, length).transpose(1, 2)  # (B, H, L, D)
    out = _Compressed.apply(qp, kc.transpose(1, 2), vc.transpose(1, 2), ends)
    return unpad_samples(out.transpose(1, 2), lens)


def _row_blocks(length: int, ends: torch.Tensor):
    """(r0, r1, visible (rows, seen)) per block of ROWS query positions: the compressed blocks that end
    at or before each row, among the first ``seen`` (ends ascend: the visible blocks are a prefix)."""
    for r0 in range(0, length, ROWS):
        r1 = min(r0 + ROWS, length)
        seen = int((ends <= r1 - 1).sum())
        yield r0, r1, ends[None, :seen] <= torch.arange(r0, r1, device=ends.device)[:, None]


def _weights(q, kt, visible, lse=None):
    """Softmax weights of a block of rows (B, H, rows, seen) over the blocks each sees, and their
    log-sum-exp; a row that sees none gets zeros."""
    score = (q @ kt[:, :, :visible.shape[1]].transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(score, -1, keepdim=True) if lse is None else lse
    return torch.exp(score - lse).nan_to_num_(0.0), lse


class _Compressed(torch.autograd.Function):
    """Attention of (B, H, L, D) padded queries over (B, H, m, D) compressed keys, row blocks at a time."""

    @staticmethod
    def forward(ctx, q, kt, vt, ends):
        out = q.new_zeros(*q.shape[:3], vt.shape[-1])
        lse = q.new_full((*q.shape[:3], 1), float("-inf"))
        for r0, r1, visible in _row_blocks(q.shape[2], ends):
            if visible.shape[1]:
                p, lse[:, :, r0:r1] = _weights(q[:, :, r0:r1], kt, visible)
                out[:, :, r0:r1] = p @ vt[:, :, :visible.shape[1]]
        ctx.save_for_backward(q, kt, vt, ends, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kt, vt, ends, lse = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kt), torch.zeros_like(vt)
        for r0, r1, visible in _row_blocks(q.shape[2], ends):
            seen = visible.shape[1]
            if not seen:
                continue
            rows = slice(r0, r1)
            p, _ = _weights(q[:, :, rows], kt, visible, lse[:, :, rows])
            dp = grad[:, :, rows] @ vt[:, :, :seen].transpose(-1, -2)
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))  # the row term from p itself: float32 rounding as the forward's
            dq[:, :, rows] = ds @ kt[:, :, :seen]
            dk[:, :, :seen] += ds.transpose(-1, -2) @ q[:, :, rows]
            dv[:, :, :seen] += p.transpose(-1, -2) @ grad[:, :, rows]
        return dq, dk, dv, None


def compressed_weights(q: torch.Tensor, kc: torch.Tensor, lens: list[int], ends: torch.Tensor):
    """The compressed branch's attention weights, a block of query rows at a time: yields
    (r0, r1, weights (B, H, r1 - r0, seen)) over padded positions r0..r1 and the blocks that end
    before r1 (a prefix: ends ascend; later blocks have weight 0), zero where a block is unseen."""
    qp = pad_samples(q, lens, max(lens)).transpose(1, 2)
    kt = kc.transpose(1, 2)
    for r0, r1, visible in _row_blocks(qp.shape[2], ends):
        yield r0, r1, _weights(qp[:, :, r0:r1], kt, visible)[0]
