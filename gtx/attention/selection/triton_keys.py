"""Attention over a ``KeySelection`` on fused Triton kernels: on CUDA, and on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, read when this module is first imported: ``keys.attend_keys``
imports it only where the kernels run).

One program per query and head group (``KeySelection.group`` adjacent heads sharing one choice):
it reads each selected key's rows for the group's heads (one span of group x D elements of k and
of v), runs an online softmax over the slots a tile at a time (invalid slots skipped, neither
read nor weighed) and writes the output and its log-sum-exp. Nothing holds a gathered n x K x D
copy of the keys or an n x n buffer. The backward recomputes each weight from the saved
log-sum-exp, as FlashAttention does: dq per program, dk and dv by atomic adds into float32 rows.
Inputs may be float32, bfloat16 or float16; scores, softmax and sums run in float32; any head size
(tiles padded to powers of two, masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from gtx import native

# (queries a program, elements of its gathered (queries, slots, heads, dims) tile in the forward;
# the backward's tile, which also holds v and both gradients' addresses, is half that). A tile
# holds max(1, elements // (queries x heads x dims)) slots, at most K rounded up to a power of two.
# Compiled (a GPU): one query a program (no two queries share their keys: a tile is all gathers)
# and 2048 elements, which ptxas fits for sm_90 without spills (4 heads of 32 dims a key: 16 slots
# forward, 80 registers a thread; 8 backward, 110; tiles of 8192 spilled both). Interpreted: the interpreter pays
# its cost per operation of each program, whatever the arrays' size: many queries at once.
SIZES = {"compiled": (1, 2048), "interpreted": (256, 1 << 20)}
WARPS = 4


@triton.jit
def _scores(q, k_ptr, keys_ptr, valid_ptr, key_at, ok_at, j0, K, rmask, heads, hmask, d, dmask, H, D, BK: tl.constexpr):
    """Slots j0 .. j0 + BK of a program's queries and group: valid (BM, BK), the (key, head) row ids
    (BM, BK, GP) of k, the gathered k tile (BM, BK, GP, DP) in float32 and the scores (BM, BK, GP),
    -inf where the slot is invalid. ``key_at``, ``ok_at`` (BM, 1): each query's row of ids, of flags."""
    j = j0 + tl.arange(0, BK)[None, :]
    ok = tl.load(valid_ptr + ok_at + j, mask=rmask[:, None] & (j < K), other=0) != 0
    key = tl.load(keys_ptr + key_at + j, mask=ok, other=0).to(tl.int64)
    row = key[:, :, None] * H + heads[None, None, :]
    kmask = (ok[:, :, None] & hmask[None, None, :])[:, :, :, None] & dmask[None, None, None, :]
    kt = tl.load(k_ptr + row[:, :, :, None] * D + d[None, None, None, :], mask=kmask, other=0.0).to(tl.float32)
    s = tl.sum(kt * q[:, None, :, :], axis=3)
    return ok, row, kt, tl.where(ok[:, :, None], s, float("-inf"))


@triton.jit
def _values(v_ptr, ok, row, hmask, e, emask, E):
    """The gathered v tile (BM, BK, GP, EP) in float32 at rows ``row`` of valid slots ``ok``, and its mask."""
    vmask = (ok[:, :, None] & hmask[None, None, :])[:, :, :, None] & emask[None, None, None, :]
    vt = tl.load(v_ptr + row[:, :, :, None] * E + e[None, None, None, :], mask=vmask, other=0.0)
    return vt.to(tl.float32), vmask


@triton.jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    keys_ptr,
    valid_ptr,
    out_ptr,
    lse_ptr,
    p_ptr,
    n,
    H,
    K,
    D,
    E,
    key_sn,
    key_sg,
    ok_sn,
    ok_sg,
    G: tl.constexpr,
    GP: tl.constexpr,
    DP: tl.constexpr,
    EP: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PROBS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1)
    hh = tl.arange(0, GP)
    rmask, heads, hmask = rows < n, c * G + hh, hh < G
    d, e = tl.arange(0, DP), tl.arange(0, EP)
    dmask, emask = d < D, e < E
    at = rows[:, None] * H + heads[None, :]  # (BM, GP): the (query, head) rows
    amask = rmask[:, None] & hmask[None, :]
    q = tl.load(q_ptr + at[:, :, None] * D + d[None, None, :], mask=amask[:, :, None] & dmask[None, None, :], other=0.0)
    q = q.to(tl.float32)
    key_at, ok_at = (rows * key_sn + c * key_sg)[:, None], (rows * ok_sn + c * ok_sg)[:, None]
    m = tl.full((BM, GP), float("-inf"), tl.float32)
    total = tl.zeros((BM, GP), tl.float32)
    acc = tl.zeros((BM, GP, EP), tl.float32)
    for j0 in range(0, K, BK):
        ok, row, _, s = _scores(
            q, k_ptr, keys_ptr, valid_ptr, key_at, ok_at, j0, K, rmask, heads, hmask, d, dmask, H, D, BK
        )
        top = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(top == float("-inf"), 0.0, top)  # nothing valid yet: every weight 0, no NaN
        p = tl.exp(s - shift[:, None, :])
        scale = tl.exp(m - shift)
        vt, _ = _values(v_ptr, ok, row, hmask, e, emask, E)
        total = total * scale + tl.sum(p, axis=1)
        acc = acc * scale[:, :, None] + tl.sum(p[:, :, :, None] * vt, axis=1)
        m = top
    has = total > 0.0  # a query without a valid slot: zero output, log-sum-exp -inf
    lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    out = acc / tl.where(has, total, 1.0)[:, :, None]
    omask = amask[:, :, None] & emask[None, None, :]
    tl.store(out_ptr + at[:, :, None] * E + e[None, None, :], out.to(out_ptr.dtype.element_ty), mask=omask)
    tl.store(lse_ptr + at, lse, mask=amask)
    if PROBS:  # the group's weights summed over its heads / H: (n, H / G, K), summed over groups after
        shift = tl.where(has, lse, 0.0)
        groups = tl.num_programs(1)
        for j0 in range(0, K, BK):
            ok, _, _, s = _scores(
                q, k_ptr, keys_ptr, valid_ptr, key_at, ok_at, j0, K, rmask, heads, hmask, d, dmask, H, D, BK
            )
            p = tl.where(hmask[None, None, :], tl.exp(s - shift[:, None, :]), 0.0)
            j = j0 + tl.arange(0, BK)[None, :]
            tl.store(p_ptr + (rows[:, None] * groups + c) * K + j, tl.sum(p, axis=2) / H, mask=rmask[:, None] & (j < K))


@triton.jit
def _backward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    keys_ptr,
    valid_ptr,
    grad_ptr,
    out_ptr,
    lse_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    n,
    H,
    K,
    D,
    E,
    key_sn,
    key_sg,
    ok_sn,
    ok_sg,
    G: tl.constexpr,
    GP: tl.constexpr,
    DP: tl.constexpr,
    EP: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    c = tl.program_id(1)
    hh = tl.arange(0, GP)
    rmask, heads, hmask = rows < n, c * G + hh, hh < G
    d, e = tl.arange(0, DP), tl.arange(0, EP)
    dmask, emask = d < D, e < E
    at = rows[:, None] * H + heads[None, :]
    amask = rmask[:, None] & hmask[None, :]
    qmask, omask = amask[:, :, None] & dmask[None, None, :], amask[:, :, None] & emask[None, None, :]
    q = tl.load(q_ptr + at[:, :, None] * D + d[None, None, :], mask=qmask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + at[:, :, None] * E + e[None, None, :], mask=omask, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + at[:, :, None] * E + e[None, None, :], mask=omask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + at, mask=amask, other=float("-inf"))
    delta = tl.sum(grad * out, axis=2)  # (BM, GP): the softmax backward's row term
    has = lse > float("-inf")
    shift = tl.where(has, lse, 0.0)
    key_at, ok_at = (rows * key_sn + c * key_sg)[:, None], (rows * ok_sn + c * ok_sg)[:, None]
    dq = tl.zeros((BM, GP, DP), tl.float32)
    for j0 in range(0, K, BK):
        ok, row, kt, s = _scores(
            q, k_ptr, keys_ptr, valid_ptr, key_at, ok_at, j0, K, rmask, heads, hmask, d, dmask, H, D, BK
        )
        vt, vmask = _values(v_ptr, ok, row, hmask, e, emask, E)
        live = ok[:, :, None] & (has & hmask[None, :])[:, None, :]
        p = tl.where(live, tl.exp(s - shift[:, None, :]), 0.0)
        ds = p * (tl.sum(vt * grad[:, None, :, :], axis=3) - delta[:, None, :])
        dq += tl.sum(ds[:, :, :, None] * kt, axis=1)
        kmask = (ok[:, :, None] & hmask[None, None, :])[:, :, :, None] & dmask[None, None, None, :]
        at_k = row[:, :, :, None] * D + d[None, None, None, :]
        tl.atomic_add(dk_ptr + at_k, ds[:, :, :, None] * q[:, None, :, :], mask=kmask)
        at_v = row[:, :, :, None] * E + e[None, None, None, :]
        tl.atomic_add(dv_ptr + at_v, p[:, :, :, None] * grad[:, None, :, :], mask=vmask)
    tl.store(dq_ptr + at[:, :, None] * D + d[None, None, :], dq.to(dq_ptr.dtype.element_ty), mask=qmask)


# what Triton made of the kernels when this module was imported: interpreted (TRITON_INTERPRET=1) or compiled
INTERPRETED = isinstance(_forward_kernel, InterpretedFunction)


def attend(q, k, v, keys, valid, group: int, probs: bool = False):
    """Attention of each query and head over its selected keys: q (n, H, D) (scaled: a score is
    q . k), k (N, H, D), v (N, H, E), keys and valid (n, H // group, K) (head h reads row
    h // group). Returns out (n, H, E) in q's dtype (differentiable in q, k, v) and, where
    ``probs``, the weights averaged over the heads (n, K) float32 without gradient (else an empty
    tensor). Key ids out of range are an IndexError, as on the other paths."""
    return _TritonKeys.apply(q, k, v, keys, valid, group, probs)


def _config(q, v, keys, group: int, backward: bool = False) -> dict:
    """The kernels' compile-time sizes (``SIZES``): group, its power-of-two padding, padded dims,
    queries and slots a program's tile."""
    gp = triton.next_power_of_2(group)
    dp, ep = triton.next_power_of_2(q.shape[2]), triton.next_power_of_2(v.shape[2])
    queries, tile = SIZES["interpreted" if INTERPRETED else "compiled"]
    tile = tile // 2 if backward else tile
    bm = min(queries, triton.next_power_of_2(max(q.shape[0], 1)))
    slots = max(1, tile // (bm * gp * max(dp, ep)))
    bk = min(triton.next_power_of_2(max(keys.shape[2], 1)), slots)
    return {"G": group, "GP": gp, "DP": dp, "EP": ep, "BM": bm, "BK": bk}


def _strides(keys, valid) -> list[int]:
    """Row and group strides of keys and valid in elements; their slots must be contiguous."""
    return [keys.stride(0), keys.stride(1), valid.stride(0), valid.stride(1)]


class _TritonKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keys, valid, group, probs):
        n, heads, count = q.shape[0], q.shape[1], keys.shape[2]
        if keys.stride(2) != 1 or valid.stride(2) != 1:
            keys, valid = keys.contiguous(), valid.contiguous()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # written whole by the kernel: no launch to fill them first
        out = q.new_empty(n, heads, v.shape[2])
        lse = torch.empty(n, heads, dtype=torch.float32, device=q.device)
        groups = heads // group
        parts = torch.empty(n, groups, count if probs else 0, dtype=torch.float32, device=q.device)
        if len(k) == 0 and not valid.any():  # no keys, none selected: every query reads nothing
            out.zero_()
            lse.fill_(float("-inf"))
            parts.zero_()
        elif n:
            native.check_ids(keys, len(k))
            config = _config(q, v, keys, group)
            _forward_kernel[(triton.cdiv(n, config["BM"]), groups)](
                q, k, v, keys, valid, out, lse, parts, n, heads, count, q.shape[2], v.shape[2],
                *_strides(keys, valid), **config, PROBS=probs, num_warps=WARPS,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, keys, valid, out, lse)
        ctx.group = group
        mean_p = parts[:, 0] if groups == 1 else parts.sum(1)
        ctx.mark_non_differentiable(mean_p)
        return out, mean_p

    @staticmethod
    def backward(ctx, grad, _):
        q, k, v, keys, valid, out, lse = ctx.saved_tensors
        n, heads, count = q.shape[0], q.shape[1], keys.shape[2]
        dq = torch.empty_like(q)  # written whole by the kernel
        # float32 rows the atomic adds sum into, in the inputs' dtype after
        dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v))
        if not len(k):
            dq.zero_()
        elif n:
            config = _config(q, v, keys, ctx.group, backward=True)
            _backward_kernel[(triton.cdiv(n, config["BM"]), heads // ctx.group)](
                q, k, v, keys, valid, grad.contiguous(), out, lse, dq, dk, dv, n, heads, count, q.shape[2], v.shape[2],
                *_strides(keys, valid), **config, num_warps=WARPS,
            )  # fmt: skip
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
