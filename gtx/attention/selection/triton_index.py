"""A lightning indexer's choice and sparse KL on fused Triton kernels (DSA off the CPU; the CPU
under Triton's interpreter, ``TRITON_INTERPRET=1``, read when this module is first imported:
``indexer`` imports it only where the kernels run).

I(t, s) = sum_j w(t, j) relu(iq(t, j) . ik(s)) for index queries iq (n, J, d), weights w (n, J) and
index keys ik (N, d), as ``indexer.index_scores`` defines it. ``top_indexed``: one program per block
of query rows scores them against tiles of the keys they may read (a block spans the keys from its
first row's first candidate to its last row's last) and keeps a running top-k per row, merged
with each tile only where the tile beats a row's worst kept score: no score matrix, one launch.
``index_kl``: one program per query row block, the loss and its gradients for iq, w and ik in one
launch (the index keys' by float32 atomic adds), scaled by the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from gtx import native
from gtx.graph.tokens import EdgeSet

# the choice keeps a row's best in a power-of-two buffer of at least MIN_KEPT keys (a tile of keys
# is as wide: a matrix product needs 16). A program scores rows x index heads x kept (at most
# CHOICE_TILE, at least 16 rows x heads: a matrix product's least) against a tile of kept x index
# dims (at most KEY_TILE): beyond those the choice runs on torch ops (``serves``), which ptxas fitted
# for sm_90 (2 heads of 32 dims, 256 kept: 8 rows, 192 registers a thread over 8 warps, no spills).
# The interpreter takes many rows at once (a cost per operation of each program, whatever its size).
MIN_KEPT, CHOICE_TILE, KEY_TILE = 32, 4096, 8192
CHOICE_ROWS = {"compiled": 16, "interpreted": 64}
# (rows a program, elements of its (rows, heads, slots, dims) tile) of the KL, as ``triton_keys.SIZES``
KL_SIZES = {"compiled": (1, 2048), "interpreted": (1024, 1 << 21)}
_MIN, _MAX = tl.standard._elementwise_min, tl.standard._elementwise_max  # what tl.min, tl.max reduce by
LOWEST: tl.constexpr = tl.constexpr(-(2**63))  # an empty slot of the running top-k: below every packed (score, key)


@triton.jit
def _bitonic(x, FIRST: tl.constexpr, LOG: tl.constexpr, DESCENDING: tl.constexpr):
    """Each row of x (B, 2^LOG) through stages FIRST .. LOG of a bitonic sorting network: from stage 1
    any rows come out sorted (descending or ascending); stage LOG alone sorts rows that are bitonic.
    Positions as a hypercube (B, 2, ..., 2), bit i of a position on axis LOG - i; each exchange takes
    the pair's smaller and larger by two reductions over an axis of 2 (no nested jit function: the
    interpreter pays for each call: ``tl.min`` and ``tl.max`` are such calls, ``tl.reduce`` with their
    combining functions the same reductions without one)."""
    h = tl.reshape(x, [x.shape[0]] + [2] * LOG)
    for stage in tl.static_range(FIRST, LOG + 1):
        if stage < LOG:  # blocks of 2^(stage + 1) positions: their halves sorted in opposite orders
            flip = tl.reshape(tl.arange(0, 2), [1] * (LOG - stage) + [2] + [1] * stage)
        else:
            flip = DESCENDING
        for r in tl.static_range(stage):  # the pairs that differ in bit stage - 1 - r
            low = tl.reduce(h, LOG - stage + 1 + r, _MIN, keep_dims=True)
            high = tl.reduce(h, LOG - stage + 1 + r, _MAX, keep_dims=True)
            bit = tl.reshape(tl.arange(0, 2), [1] * (LOG - stage + 1 + r) + [2] + [1] * (stage - 1 - r))
            h = tl.where((flip ^ bit) != 0, high, low)  # the larger where the bit differs from flip
    return tl.reshape(h, x.shape)


@triton.jit
def _top_kernel(
    iq_ptr, w_ptr, ik_ptr, lo_ptr, hi_ptr, keys_ptr, valid_ptr, n, J, D, COUNT,
    JP: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, KP: tl.constexpr, LOG_KP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    jj, dd, cols = tl.arange(0, JP), tl.arange(0, DP), tl.arange(0, KP)
    rmask, jmask, dmask = rows < n, jj < J, dd < D
    heads = (rows[:, None] * J + jj[None, :]) * D  # (BM, JP)
    hmask = rmask[:, None] & jmask[None, :]
    iq = tl.load(
        iq_ptr + heads[:, :, None] + dd[None, None, :], mask=hmask[:, :, None] & dmask[None, None, :], other=0.0
    )
    iq = tl.reshape(iq.to(tl.float32), (BM * JP, DP))
    w = tl.load(w_ptr + rows[:, None] * J + jj[None, :], mask=hmask, other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + rows, mask=rmask, other=2**31 - 1)  # each row's candidates: keys lo .. hi - 1
    hi = tl.load(hi_ptr + rows, mask=rmask, other=0)
    best = tl.full((BM, KP), LOWEST, tl.int64)
    for s0 in range(tl.min(lo), tl.max(hi), KP):
        s = s0 + cols
        kt = tl.load(ik_ptr + s[:, None] * D + dd[None, :], mask=(s < tl.max(hi))[:, None] & dmask[None, :], other=0.0)
        dots = tl.dot(iq, tl.trans(kt.to(tl.float32)), input_precision="ieee")  # (BM x JP, KP)
        score = tl.sum(tl.reshape(tl.maximum(dots, 0.0), (BM, JP, KP)) * w[:, :, None], axis=1)
        # (score, key) as one int64 ordered as the pair: float bits made monotone above, the key below;
        # equal scores rank the later key first, as ``choice.top_later_first`` (-0 counted as +0)
        bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True).to(tl.int64)
        packed = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32) | s[None, :]
        packed = tl.where((s[None, :] >= lo[:, None]) & (s[None, :] < hi[:, None]), packed, LOWEST)
        if tl.max((tl.max(packed, axis=1) > tl.min(best, axis=1)).to(tl.int32)) > 0:  # a row's worst kept is beaten
            # best descending, the tile ascending: their larger of each position are the best KP of
            # both, in a bitonic order that one merging stage sorts
            best = _bitonic(tl.maximum(best, _bitonic(packed, 1, LOG_KP, False)), LOG_KP, LOG_KP, True)
    kept = best != LOWEST
    at = rows[:, None] * COUNT + cols[None, :]
    mask = rmask[:, None] & (cols < COUNT)[None, :]
    tl.store(keys_ptr + at, tl.where(kept, best & 0x7FFFFFFF, 0).to(tl.int32), mask=mask)
    tl.store(valid_ptr + at, kept, mask=mask)


def _kind() -> str:
    return "interpreted" if isinstance(_top_kernel, InterpretedFunction) else "compiled"


def key_ranges(edges: EdgeSet) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_dst,) int64 each query's first candidate key id and one past its last, for complete or
    causal candidates (``edges.root.structure``; causal: the query's own position is its last),
    made on the host and moved in one copy."""
    q_lens, k_lens = edges.sample_lens()
    ql, kl = torch.tensor(q_lens), torch.tensor(k_lens)
    lo = torch.repeat_interleave(torch.cumsum(kl, 0) - kl, ql)
    if edges.root.structure == "causal":
        position = torch.arange(edges.n_dst) - torch.repeat_interleave(torch.cumsum(ql, 0) - ql, ql)
        hi = lo + torch.minimum(position + 1, torch.repeat_interleave(kl, ql))
    else:
        hi = lo + torch.repeat_interleave(kl, ql)
    both = torch.stack([lo, hi]).to(edges.device)
    return both[0], both[1]


def _kept(count: int) -> int:
    return max(MIN_KEPT, triton.next_power_of_2(count))


def serves(heads: int, dim: int, count: int) -> bool:
    """Whether the choice's kernel takes ``heads`` index heads of ``dim`` dims keeping ``count``."""
    kept = _kept(count)
    return (
        triton.next_power_of_2(heads) * kept <= CHOICE_TILE and kept * max(16, triton.next_power_of_2(dim)) <= KEY_TILE
    )


def top_indexed(iq, w, ik, edges: EdgeSet, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``indexer.top_indexed`` in float32 on the kernel (where it ``serves`` the sizes): per query
    the ``count`` candidate keys with the highest index score, equal scores preferring the later
    key, best first: key ids (n, count) int32 and valid (n, count) (invalid slots hold key 0)."""
    n, heads, dim = iq.shape
    keys = torch.empty(n, count, dtype=torch.int32, device=iq.device)
    valid = torch.empty(n, count, dtype=torch.bool, device=iq.device)
    if n == 0:
        return keys, valid
    jp, kp = triton.next_power_of_2(heads), _kept(count)
    rows = CHOICE_ROWS[_kind()] if _kind() == "interpreted" else min(CHOICE_ROWS["compiled"], CHOICE_TILE // (jp * kp))
    bm = max(rows, triton.cdiv(16, jp))
    warps = 16 if bm * kp >= 4096 else 8 if bm * kp >= 2048 else 4
    lo, hi = key_ranges(edges)
    iq, w, ik = iq.contiguous(), w.contiguous(), ik.contiguous()
    _top_kernel[(triton.cdiv(n, bm),)](
        iq, w, ik, lo, hi, keys, valid, n, heads, dim, count,
        JP=jp, DP=max(16, triton.next_power_of_2(dim)), BM=bm, KP=kp, LOG_KP=kp.bit_length() - 1, num_warps=warps,
    )  # fmt: skip
    return keys, valid


@triton.jit
def _dots(iq, ik_ptr, keys_ptr, valid_ptr, rows, rmask, j0, K, dd, dmask, D, BK: tl.constexpr):
    """Slots j0 .. j0 + BK of a program's rows: valid (BM, BK), key ids (BM, BK), the gathered index
    keys (BM, BK, DP) in float32 and the dots (BM, JP, BK) with the rows' index queries iq (BM, JP, DP)."""
    j = j0 + tl.arange(0, BK)
    at = rows[:, None] * K + j[None, :]
    ok = tl.load(valid_ptr + at, mask=rmask[:, None] & (j < K)[None, :], other=0) != 0
    key = tl.load(keys_ptr + at, mask=ok, other=0).to(tl.int64)
    kt = tl.load(
        ik_ptr + key[:, :, None] * D + dd[None, None, :], mask=ok[:, :, None] & dmask[None, None, :], other=0.0
    )
    kt = kt.to(tl.float32)
    return ok, key, kt, tl.sum(iq[:, :, None, :] * kt[:, None, :, :], axis=3)


@triton.jit
def _kl_kernel(
    p_ptr, iq_ptr, w_ptr, ik_ptr, keys_ptr, valid_ptr, loss_ptr, diq_ptr, dw_ptr, dik_ptr, n, J, D, K,
    JP: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    jj, dd = tl.arange(0, JP), tl.arange(0, DP)
    rmask, dmask = rows < n, dd < D
    hmask = rmask[:, None] & (jj < J)[None, :]
    heads = (rows[:, None] * J + jj[None, :]) * D
    qmask = hmask[:, :, None] & dmask[None, None, :]
    iq = tl.load(iq_ptr + heads[:, :, None] + dd[None, None, :], mask=qmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows[:, None] * J + jj[None, :], mask=hmask, other=0.0).to(tl.float32)
    # the logits' log-sum-exp (online) and the loss's terms: sum p log p - sum p I + (sum p) lse
    m = tl.full((BM,), float("-inf"), tl.float32)
    z, mass, terms = tl.zeros((BM,), tl.float32), tl.zeros((BM,), tl.float32), tl.zeros((BM,), tl.float32)
    for j0 in range(0, K, BK):
        ok, _, _, dots = _dots(iq, ik_ptr, keys_ptr, valid_ptr, rows, rmask, j0, K, dd, dmask, D, BK)
        score = tl.sum(w[:, :, None] * tl.maximum(dots, 0.0), axis=1)  # (BM, BK), 0 where not ok
        logit = tl.where(ok, score, float("-inf"))
        p = tl.load(p_ptr + rows[:, None] * K + j0 + tl.arange(0, BK)[None, :], mask=ok, other=0.0).to(tl.float32)
        top = tl.maximum(m, tl.max(logit, axis=1))
        shift = tl.where(top == float("-inf"), 0.0, top)
        z = z * tl.exp(m - shift) + tl.sum(tl.exp(logit - shift[:, None]), axis=1)
        m = top
        mass += tl.sum(p, axis=1)
        terms += tl.sum(p * (tl.log(tl.where(p > 0.0, p, 1.0)) - score), axis=1)  # p = 0: no term
    lse = tl.where(z > 0.0, m + tl.log(tl.where(z > 0.0, z, 1.0)), 0.0)
    tl.store(loss_ptr + rows, terms + mass * lse, mask=rmask)
    # d loss / d I = (sum p) softmax(I) - p; through the weighted relu to w, iq and the kept keys
    dw, diq = tl.zeros((BM, JP), tl.float32), tl.zeros((BM, JP, DP), tl.float32)
    for j0 in range(0, K, BK):
        ok, key, kt, dots = _dots(iq, ik_ptr, keys_ptr, valid_ptr, rows, rmask, j0, K, dd, dmask, D, BK)
        logit = tl.sum(w[:, :, None] * tl.maximum(dots, 0.0), axis=1)
        p = tl.load(p_ptr + rows[:, None] * K + j0 + tl.arange(0, BK)[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.where(ok, mass[:, None] * tl.exp(logit - lse[:, None]) - p, 0.0)  # (BM, BK)
        dw += tl.sum(g[:, None, :] * tl.maximum(dots, 0.0), axis=2)
        ddots = tl.where(dots > 0.0, g[:, None, :] * w[:, :, None], 0.0)  # (BM, JP, BK)
        diq += tl.sum(ddots[:, :, :, None] * kt[:, None, :, :], axis=2)
        dik = tl.sum(ddots[:, :, :, None] * iq[:, :, None, :], axis=1)  # (BM, BK, DP)
        tl.atomic_add(
            dik_ptr + key[:, :, None] * D + dd[None, None, :], dik, mask=ok[:, :, None] & dmask[None, None, :]
        )
    tl.store(dw_ptr + rows[:, None] * J + jj[None, :], dw, mask=hmask)
    tl.store(diq_ptr + heads[:, :, None] + dd[None, None, :], diq, mask=qmask)


def index_kl(p, iq, w, ik, keys, valid) -> torch.Tensor:
    """``indexer.index_kl`` on the kernel: sum over queries of KL(p || softmax(I over the kept keys)),
    p (n, K) over keys (n, K) (valid (n, K)); gradients (float32) reach iq, w and ik only."""
    return _IndexKL.apply(p, iq, w, ik, keys, valid)


class _IndexKL(torch.autograd.Function):
    """The kernel computes the loss and its gradients in one pass; backward scales them."""

    @staticmethod
    def forward(ctx, p, iq, w, ik, keys, valid):
        n, heads, dim = iq.shape
        count = keys.shape[1]
        p, iq, w, ik, keys, valid = (x.contiguous() for x in (p, iq, w, ik, keys, valid))
        native.check_ids(keys, len(ik), "index key")
        loss = torch.empty(n, dtype=torch.float32, device=iq.device)
        diq, dw = torch.empty(iq.shape, dtype=torch.float32, device=iq.device), torch.empty_like(w, dtype=torch.float32)
        dik = torch.zeros(ik.shape, dtype=torch.float32, device=ik.device)  # atomic adds
        if n:
            rows, tile = KL_SIZES[_kind()]
            jp, dp = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
            bm = min(rows, triton.next_power_of_2(n))
            bk = min(triton.next_power_of_2(max(count, 1)), max(1, tile // (bm * jp * dp)))
            _kl_kernel[(triton.cdiv(n, bm),)](
                p, iq, w, ik, keys, valid, loss, diq, dw, dik, n, heads, dim, count, JP=jp, DP=dp, BM=bm, BK=bk
            )
        ctx.save_for_backward(diq, dw, dik)
        ctx.dtypes = iq.dtype, w.dtype, ik.dtype
        return loss.sum().to(p.dtype)  # as the other paths: in p's dtype

    @staticmethod
    def backward(ctx, grad):
        grads = [(x * grad).to(dtype) for x, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return None, *grads, None, None
