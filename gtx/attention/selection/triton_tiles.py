"""Fused Triton kernels for attention under a ``BlockSelection`` (``moba:...,gate=block``): a
program per (sample, head, query block) attends its (block x D) query tile to its own block
(causally) and its chosen key blocks, FlashAttention style (``tl.dot``, one online softmax, float32
accumulation); the backward recomputes the scores from the saved log-sum-exp, dq per program, dk
and dv by float32 atomic adds. No gathered copy of k or v and no mask are made.

Imported only when a selection runs on Triton (``kernels.use_triton``); under Triton's interpreter
(``TRITON_INTERPRET=1``) the products run in float32, as its dot of bfloat16 tiles is wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gtx.attention.selection.triton_blocks import INTERPRETED

# float32 products in full precision (a GPU's default for float32 tiles is TF32: 10 bits of mantissa)
PRECISION: tl.constexpr = tl.constexpr("ieee")


@triton.jit
def _program(FIRST, LENS, H, group, block, n_blocks, n_slots, BP: tl.constexpr):
    """This program's head, first row, sample length, tile rows r, their (token, head) rows ``at``,
    which of them are real, and where its key blocks' slots begin."""
    i, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    first, length = tl.load(FIRST + b), tl.load(LENS + b)
    r = tl.arange(0, BP)
    ok = (r < block) & (i * block + r < length)
    slots = ((b * (H // group) + h // group) * n_blocks + i).to(tl.int64) * n_slots
    return h, first, length, r, (first + i * block + r).to(tl.int64) * H + h, ok, slots


@triton.jit
def _tiles_forward_kernel(
    Q, K, V, O, LSE, KEYS, FIRST, LENS,
    H, D, DV, block, group, n_blocks, n_slots,
    BP: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    h, first, length, r, at, ok, slots = _program(FIRST, LENS, H, group, block, n_blocks, n_slots, BP)
    d, e = tl.arange(0, DP), tl.arange(0, DVP)
    dm, em = (d < D)[None, :], (e < DV)[None, :]
    q = tl.load(Q + at[:, None] * D + d[None, :], mask=ok[:, None] & dm, other=0.0)
    if F32:  # (the interpreter's dot of bfloat16 tiles is wrong)
        q = q.to(tl.float32)
    m = tl.full([BP], float("-inf"), tl.float32)
    l = tl.zeros([BP], tl.float32)
    acc = tl.zeros([BP, DVP], tl.float32)
    for j in range(n_slots):
        kb = tl.load(KEYS + slots + j)
        if kb >= 0:
            kok = (r < block) & (kb * block + r < length)
            seen = ok[:, None] & kok[None, :] & ((r[None, :] <= r[:, None]) | (j > 0))  # slot 0: causal
            kat = (first + kb * block + r).to(tl.int64) * H + h
            kt = tl.load(K + kat[:, None] * D + d[None, :], mask=kok[:, None] & dm, other=0.0)
            vt = tl.load(V + kat[:, None] * DV + e[None, :], mask=kok[:, None] & em, other=0.0)
            if F32:
                kt, vt = kt.to(tl.float32), vt.to(tl.float32)
            s = tl.where(seen, tl.dot(q, tl.trans(kt), input_precision=PRECISION), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m - shift)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
    l = tl.where(l == 0.0, 1.0, l)
    tl.store(O + at[:, None] * DV + e[None, :], (acc / l[:, None]).to(O.dtype.element_ty), mask=ok[:, None] & em)
    tl.store(LSE + at, m + tl.log(l), mask=ok)


@triton.jit
def _tiles_backward_kernel(
    Q, K, V, O, DO, LSE, DQ, DK, DVB, KEYS, FIRST, LENS,
    H, D, DV, block, group, n_blocks, n_slots,
    BP: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, F32: tl.constexpr,
):  # fmt: skip
    h, first, length, r, at, ok, slots = _program(FIRST, LENS, H, group, block, n_blocks, n_slots, BP)
    d, e = tl.arange(0, DP), tl.arange(0, DVP)
    dm, em = (d < D)[None, :], (e < DV)[None, :]
    q = tl.load(Q + at[:, None] * D + d[None, :], mask=ok[:, None] & dm, other=0.0)
    do = tl.load(DO + at[:, None] * DV + e[None, :], mask=ok[:, None] & em, other=0.0)
    o = tl.load(O + at[:, None] * DV + e[None, :], mask=ok[:, None] & em, other=0.0)
    if F32:
        q, do = q.to(tl.float32), do.to(tl.float32)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    lse = tl.load(LSE + at, mask=ok, other=0.0)
    dq = tl.zeros([BP, DP], tl.float32)
    for j in range(n_slots):
        kb = tl.load(KEYS + slots + j)
        if kb >= 0:
            kok = (r < block) & (kb * block + r < length)
            seen = ok[:, None] & kok[None, :] & ((r[None, :] <= r[:, None]) | (j > 0))
            kat = (first + kb * block + r).to(tl.int64) * H + h
            kt = tl.load(K + kat[:, None] * D + d[None, :], mask=kok[:, None] & dm, other=0.0)
            vt = tl.load(V + kat[:, None] * DV + e[None, :], mask=kok[:, None] & em, other=0.0)
            if F32:
                kt, vt = kt.to(tl.float32), vt.to(tl.float32)
            p = tl.where(seen, tl.exp(tl.dot(q, tl.trans(kt), input_precision=PRECISION) - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(vt), input_precision=PRECISION) - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), kt, input_precision=PRECISION)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            tl.atomic_add(DK + kat[:, None] * D + d[None, :], dk, mask=kok[:, None] & dm, sem="relaxed")
            tl.atomic_add(DVB + kat[:, None] * DV + e[None, :], dv, mask=kok[:, None] & em, sem="relaxed")
    tl.store(DQ + at[:, None] * D + d[None, :], dq.to(DQ.dtype.element_ty), mask=ok[:, None] & dm)


class _Tiles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keys, first, lens, block, group):
        n, heads, dim = q.shape
        o = q.new_empty(n, heads, v.shape[-1])
        lse = q.new_empty(n, heads, dtype=torch.float32)
        ctx.meta = (block, group, _sizes(q, v, block))
        _tiles_forward_kernel[_grid(keys, heads)](
            q, k, v, o, lse, keys, first, lens, heads, dim, v.shape[-1], block, group, keys.shape[2], keys.shape[3],
            **ctx.meta[2],
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, o, lse, keys, first, lens)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad, _):
        q, k, v, o, lse, keys, first, lens = ctx.saved_tensors
        block, group, sizes = ctx.meta
        n, heads, dim = q.shape
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        _tiles_backward_kernel[_grid(keys, heads)](
            q, k, v, o, grad.contiguous(), lse, dq, dk, dv, keys, first, lens,
            heads, dim, v.shape[-1], block, group, keys.shape[2], keys.shape[3], **sizes,
        )  # fmt: skip
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _grid(keys: torch.Tensor, heads: int) -> tuple[int, int]:
    return keys.shape[2], keys.shape[0] * heads


def _sizes(q: torch.Tensor, v: torch.Tensor, block: int) -> dict:
    """Tile sizes: powers of two, at least 16 (``tl.dot``'s least); 8 warps from 64 x 32 tiles, where
    4 spilled registers compiled for an H200 (sm_90)."""
    p2 = [max(16, triton.next_power_of_2(x)) for x in (block, q.shape[-1], v.shape[-1])]
    warps = 8 if p2[0] * max(p2[1:]) >= 64 * 32 else 4
    return {"BP": p2[0], "DP": p2[1], "DVP": p2[2], "F32": INTERPRETED or q.dtype == torch.float32, "num_warps": warps}


def blocks(q, k, v, lens: list[int], block: int, key_blocks, valid, group: int) -> torch.Tensor:
    """Attention under a block selection on the Triton kernels: q, k, v (N, H, D) rows of samples
    ``lens``, q pre-scaled; ``key_blocks``, ``valid`` (B, H // group, n_blocks, K), slot 0 the own
    block. Returns (N, H, Dv) in q's dtype."""
    lens_t = torch.as_tensor(lens, device=q.device)
    first = (torch.cumsum(lens_t, 0) - lens_t).to(torch.int32)
    keys = torch.where(valid, key_blocks, -1).to(torch.int32).contiguous()
    out, _ = _Tiles.apply(*(x.contiguous() for x in (q, k, v)), keys, first, lens_t.to(torch.int32), block, group)
    return out
