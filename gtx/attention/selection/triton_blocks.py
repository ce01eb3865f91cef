"""Fused Triton kernels for attention over spans of keys: a token-gated block selection
(``TokenBlockSelection``: MoBA, NSA's selected branch, ``dsa:b``) and NSA's compressed branch.

Each query token reads an "own" span of keys (its own block up to itself, or the compressed keys it
sees) and the ``K`` chosen blocks of ``block`` keys its head group's row names (``Spans``), one
online softmax over all of them. A program takes a tile of query tokens times the heads of one head
group: a group's heads share one choice, read once. No gathered copy of k or v is made, nor any
n x n, n x K x block or n x K x D buffer; accumulation is in float32, the output in the inputs'
dtype. The backward recomputes the scores from the saved log-sum-exp: dq per program, dk and dv by
float32 atomic adds.

Imported only when a selection runs on Triton (``kernels.use_triton``): Triton decides when this
module is first imported whether its kernels compile or run under its interpreter
(``TRITON_INTERPRET=1``, on the CPU), and the tiles are sized for that.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: whether the kernels run under Triton's interpreter (decided by Triton when this module is imported)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# (rows of a program) x (keys of a tile) x (head dim) values held at once, and (token, head) rows a
# program takes (at least one token's group). The interpreter pays per operation, not per value, so
# its programs are large. Compiled for an H200 (sm_90, 4 warps), one token per program and 2048
# values needed 80-220 registers and no spills; 16 tokens per program spilled at any tile size.
TILE_VALUES = 1 << 20 if INTERPRETED else 2048
ROWS = 1024 if INTERPRETED else 1


@triton.jit
def _span_forward(
    K, V, q, h, start, count, bound, m, l, acc,
    H, D, DV,
    KT: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr, MASSES: tl.constexpr,
):  # fmt: skip
    """One span of keys into the rows' online softmax (m, l, acc); with MASSES also the span's own
    log-sum-exp per row (-inf where the row reads none of it)."""
    d, e = tl.arange(0, DP), tl.arange(0, DVP)
    bm = tl.full(m.shape, float("-inf"), tl.float32)
    bl = tl.zeros(m.shape, tl.float32)
    for k0 in range(0, bound, KT):
        key = k0 + tl.arange(0, KT)
        ok = key[None, :] < count[:, None]  # (R, KT)
        row = (start[:, None] + key[None, :]).to(tl.int64) * H + h[:, None]
        kt = tl.load(
            K + row[:, :, None] * D + d[None, None, :], mask=ok[:, :, None] & (d < D)[None, None, :], other=0.0
        )
        s = tl.where(ok, tl.sum(q[:, None, :] * kt.to(tl.float32), axis=2), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: nothing to scale
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        vt = tl.load(
            V + row[:, :, None] * DV + e[None, None, :], mask=ok[:, :, None] & (e < DV)[None, None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt.to(tl.float32), axis=1)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
        if MASSES:
            bm_new = tl.maximum(bm, tl.max(s, axis=1))
            bshift = tl.where(bm_new == float("-inf"), 0.0, bm_new)
            bl = bl * tl.exp(bm - bshift) + tl.sum(tl.exp(s - bshift[:, None]), axis=1)
            bm = bm_new
    return m, l, acc, bm + tl.log(tl.where(bl == 0.0, 1.0, bl))  # -inf where empty


@triton.jit
def _span_backward(
    K, V, DK, DVB, q, do, lse, delta, dq, h, start, count, bound,
    H, D, DV,
    KT: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
):  # fmt: skip
    """One span's share of the gradients: returns dq plus it; adds to dk, dv (float32) atomically."""
    d, e = tl.arange(0, DP), tl.arange(0, DVP)
    for k0 in range(0, bound, KT):
        key = k0 + tl.arange(0, KT)
        ok = key[None, :] < count[:, None]
        row = (start[:, None] + key[None, :]).to(tl.int64) * H + h[:, None]
        kmask = ok[:, :, None] & (d < D)[None, None, :]
        vmask = ok[:, :, None] & (e < DV)[None, None, :]
        kt = tl.load(K + row[:, :, None] * D + d[None, None, :], mask=kmask, other=0.0).to(tl.float32)
        vt = tl.load(V + row[:, :, None] * DV + e[None, None, :], mask=vmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * kt, axis=2)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.sum(do[:, None, :] * vt, axis=2) - delta[:, None])
        dq += tl.sum(ds[:, :, None] * kt, axis=1)
        tl.atomic_add(
            DK + row[:, :, None] * D + d[None, None, :], ds[:, :, None] * q[:, None, :], mask=kmask, sem="relaxed"
        )
        tl.atomic_add(
            DVB + row[:, :, None] * DV + e[None, None, :], p[:, :, None] * do[:, None, :], mask=vmask, sem="relaxed"
        )
    return dq


@triton.jit
def _rows(n, H, group, QT: tl.constexpr, GP: tl.constexpr):
    """A program's rows: (token, head) of QT tokens times the GP (padded) heads of its group."""
    r = tl.arange(0, QT * GP)
    t = tl.program_id(0) * QT + r // GP
    hh = r % GP
    ok = (t < n) & (hh < group)
    t = tl.where(ok, t, 0)
    return t, tl.program_id(1) * group + hh, ok


@triton.jit
def _own_span(FIRST, OWN_START, OWN_COUNT, t, ok, block, OWN_BLOCK: tl.constexpr):
    """Each row's own span (first key row, keys): its own block up to itself (OWN_BLOCK: key rows are
    query rows, blocks of ``block`` from each sample's first row), else as given."""
    if OWN_BLOCK:
        first = tl.load(FIRST + t, mask=ok, other=0)
        into = (t - first) % block
        return first, t - into, tl.where(ok, into + 1, 0)
    return t, tl.load(OWN_START + t, mask=ok, other=0), tl.load(OWN_COUNT + t, mask=ok, other=0)


@triton.jit
def _slot_span(BLOCKS, VALID, first, at, ok, block):
    """A chosen block's span (first key row, keys: ``block``, or 0 where the slot is empty)."""
    chosen = tl.load(VALID + at, mask=ok, other=0) != 0
    return first + tl.load(BLOCKS + at, mask=chosen, other=0).to(tl.int32) * block, tl.where(chosen, block, 0)


@triton.jit
def _spans_forward_kernel(
    Q, K, V, O, OUT, LSE, BLSE, GATE, FIRST, OWN_START, OWN_COUNT, BLOCKS, VALID,
    n, H, D, DV, n_slots, block, group, s_gate_n, s_gate_h,
    QT: tl.constexpr, GP: tl.constexpr, KT: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    HAS_GATE: tl.constexpr, MASSES: tl.constexpr, OWN_BLOCK: tl.constexpr,
):  # fmt: skip
    t, h, ok = _rows(n, H, group, QT, GP)
    d, e = tl.arange(0, DP), tl.arange(0, DVP)
    at = t.to(tl.int64) * H + h  # the (token, head) row
    q = tl.load(Q + at[:, None] * D + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    m = tl.full([QT * GP], float("-inf"), tl.float32)
    l = tl.zeros([QT * GP], tl.float32)
    acc = tl.zeros([QT * GP, DVP], tl.float32)
    first, start, count = _own_span(FIRST, OWN_START, OWN_COUNT, t, ok, block, OWN_BLOCK)
    m, l, acc, blse = _span_forward(
        K, V, q, h, start, count, tl.max(count, axis=0), m, l, acc, H, D, DV, KT, DP, DVP, MASSES
    )
    if MASSES:
        tl.store(BLSE + at * (n_slots + 1), blse, mask=ok)
    slot = t.to(tl.int64) * (H // group) * n_slots + tl.program_id(1) * n_slots
    for j in range(n_slots):
        start, count = _slot_span(BLOCKS, VALID, first, slot + j, ok, block)
        # a slot empty in every row of the program runs no tile
        m, l, acc, blse = _span_forward(
            K, V, q, h, start, count, tl.max(count, axis=0), m, l, acc, H, D, DV, KT, DP, DVP, MASSES
        )
        if MASSES:
            tl.store(BLSE + at * (n_slots + 1) + 1 + j, blse, mask=ok)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # a row that reads nothing: zeros
    tl.store(LSE + at, m + tl.log(tl.where(l == 0.0, 1.0, l)), mask=ok)
    omask = ok[:, None] & (e < DV)[None, :]
    tl.store(O + at[:, None] * DV + e[None, :], out.to(O.dtype.element_ty), mask=omask)
    if HAS_GATE:
        gate = tl.load(GATE + t * s_gate_n + h * s_gate_h, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + at[:, None] * DV + e[None, :], (out * gate[:, None]).to(OUT.dtype.element_ty), mask=omask)


@triton.jit
def _spans_backward_kernel(
    Q, K, V, O, DO, LSE, GATE, DQ, DK, DVB, DGATE, FIRST, OWN_START, OWN_COUNT, BLOCKS, VALID,
    n, H, D, DV, n_slots, block, group, s_gate_n, s_gate_h,
    QT: tl.constexpr, GP: tl.constexpr, KT: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    HAS_GATE: tl.constexpr, OWN_BLOCK: tl.constexpr,
):  # fmt: skip
    t, h, ok = _rows(n, H, group, QT, GP)
    d, e = tl.arange(0, DP), tl.arange(0, DVP)
    at = t.to(tl.int64) * H + h
    qmask, omask = ok[:, None] & (d < D)[None, :], ok[:, None] & (e < DV)[None, :]
    q = tl.load(Q + at[:, None] * D + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    do = tl.load(DO + at[:, None] * DV + e[None, :], mask=omask, other=0.0).to(tl.float32)
    o = tl.load(O + at[:, None] * DV + e[None, :], mask=omask, other=0.0).to(tl.float32)
    delta = tl.sum(do * o, axis=1)  # the gate's gradient; with the gate, the softmax's delta is gate times it
    if HAS_GATE:
        gate = tl.load(GATE + t * s_gate_n + h * s_gate_h, mask=ok, other=0.0).to(tl.float32)
        tl.store(DGATE + at, delta, mask=ok)
        do = do * gate[:, None]
        delta = delta * gate
    lse = tl.load(LSE + at, mask=ok, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # a row that reads no key: its keys are all masked
    dq = tl.zeros([QT * GP, DP], tl.float32)
    first, start, count = _own_span(FIRST, OWN_START, OWN_COUNT, t, ok, block, OWN_BLOCK)
    dq = _span_backward(
        K, V, DK, DVB, q, do, lse, delta, dq, h, start, count, tl.max(count, axis=0), H, D, DV, KT, DP, DVP
    )
    slot = t.to(tl.int64) * (H // group) * n_slots + tl.program_id(1) * n_slots
    for j in range(n_slots):
        start, count = _slot_span(BLOCKS, VALID, first, slot + j, ok, block)
        dq = _span_backward(
            K, V, DK, DVB, q, do, lse, delta, dq, h, start, count, tl.max(count, axis=0), H, D, DV, KT, DP, DVP
        )
    tl.store(DQ + at[:, None] * D + d[None, :], dq.to(DQ.dtype.element_ty), mask=qmask)


class Spans:
    """Which keys each query token reads, laid out for the kernels. Either its own block up to itself
    (``first`` (n,) int32: each token's sample's first row; key rows are query rows) or a span given
    by ``own_start``, ``own_count`` (n,) int32 (first key row, keys); and the chosen blocks
    ``blocks``, ``valid`` (n, H // group, K) (int64 block indices within the token's sample, from
    ``first``; bool), each of ``block`` keys."""

    def __init__(self, block: int, group: int, blocks, valid, first=None, own_start=None, own_count=None):
        self.block, self.group, self.blocks, self.valid = block, group, blocks, valid
        self.first, self.own_start, self.own_count = first, own_start, own_count

    def pointers(self):
        """The kernels' FIRST, OWN_START, OWN_COUNT, BLOCKS, VALID (an unused one: any tensor)."""
        some = self.first if self.first is not None else self.own_start
        return (
            some,
            self.own_start if self.own_start is not None else some,
            self.own_count if self.own_count is not None else some,
            self.blocks,
            self.valid,
        )


def _tiles(heads_p2: int, block: int, dim_p2: int) -> tuple[int, int]:
    """(query tokens per program, keys per tile), powers of two, for a program of one head group."""
    qt = max(1, ROWS // heads_p2)
    fits = max(1, TILE_VALUES // (qt * heads_p2 * dim_p2))
    return qt, min(triton.next_power_of_2(max(block, 1)), 1 << (fits.bit_length() - 1))


def _launch(spans: Spans, n: int, heads: int, dim: int, dim_v: int, longest: int):
    gp = triton.next_power_of_2(spans.group)
    dp, dvp = triton.next_power_of_2(dim), triton.next_power_of_2(dim_v)
    qt, kt = _tiles(gp, max(spans.block, longest), max(dp, dvp))
    grid = (triton.cdiv(n, qt), heads // spans.group)
    return grid, {"QT": qt, "GP": gp, "KT": kt, "DP": dp, "DVP": dvp}


class SpanAttention(torch.autograd.Function):
    """(q, k, v, gate, spans, masses) -> (out, lse, block lse): q (n, H, D), k and v (rows, H, D)
    and (rows, H, Dv), contiguous; ``gate`` (n, H, 1) or None, each output row scaled by it; q
    pre-scaled (scores are plain dot products). ``out`` (n, H, Dv) in q's dtype; ``lse`` (n, H) float32
    (-inf where a row reads no key: its output is zeros); with ``masses``, ``block lse`` (n, H, 1 + K)
    float32, each span's own log-sum-exp (-inf where empty), else None. Gradients for q, k, v, gate."""

    @staticmethod
    def forward(ctx, q, k, v, gate, spans: Spans, masses: bool, longest: int):
        n, heads, dim = q.shape
        dim_v, n_slots = v.shape[-1], spans.blocks.shape[-1]
        o = q.new_empty(n, heads, dim_v)
        out = o if gate is None else torch.empty_like(o)
        lse = q.new_empty(n, heads, dtype=torch.float32)
        blse = q.new_empty(n, heads, n_slots + 1, dtype=torch.float32) if masses else lse
        g = gate if gate is not None else lse
        grid, tiles = _launch(spans, n, heads, dim, dim_v, longest)
        if n:
            _spans_forward_kernel[grid](
                q, k, v, o, out, lse, blse, g, *spans.pointers(),
                n, heads, dim, dim_v, n_slots, spans.block, spans.group, g.stride(0), g.stride(1),
                HAS_GATE=gate is not None, MASSES=masses, OWN_BLOCK=spans.first is not None, **tiles,
            )  # fmt: skip
        ctx.spans, ctx.longest = spans, longest
        ctx.mark_non_differentiable(lse, blse)
        ctx.save_for_backward(q, k, v, o, lse, gate)
        return out, lse, blse if masses else None

    @staticmethod
    def backward(ctx, grad, _lse, _blse):
        q, k, v, o, lse, gate = ctx.saved_tensors
        spans = ctx.spans
        n, heads, dim = q.shape
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        dgate = q.new_empty(n, heads, dtype=torch.float32) if gate is not None else lse
        g = gate if gate is not None else lse
        grid, tiles = _launch(spans, n, heads, dim, v.shape[-1], ctx.longest)
        if n:
            _spans_backward_kernel[grid](
                q, k, v, o, grad.contiguous(), lse, g, dq, dk, dv, dgate, *spans.pointers(),
                n, heads, dim, v.shape[-1], spans.blocks.shape[-1], spans.block, spans.group,
                g.stride(0), g.stride(1), HAS_GATE=gate is not None, OWN_BLOCK=spans.first is not None, **tiles,
            )  # fmt: skip
        dgate = None if gate is None else dgate.view(gate.shape).to(gate.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dgate, None, None, None


def token_blocks(q, k, v, lens, block, blocks, valid, group, gate=None, masses=False):
    """Attention under a token-gated block selection on the Triton kernels: q, k, v (n, H, D) rows of
    samples ``lens``, q pre-scaled; ``blocks``, ``valid`` (n, H // group, K), the earlier blocks of
    ``block`` positions each token reads besides its own; ``gate`` (n, H, 1) or None. Returns
    (out (n, H, Dv), masses (n, 1 + K) averaged over heads (own block first), or None)."""
    spans = Spans(block, group, blocks.contiguous(), valid.contiguous(), first=_firsts(lens, q.device))
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, lse, blse = SpanAttention.apply(q, k, v, gate, spans, masses, block)
    return out, (torch.exp(blse - lse[..., None]).mean(1) if masses else None)


def compressed(q, kc, vc, lens: list[int], ends: torch.Tensor, weight=None):
    """NSA's compressed branch on the Triton kernels: q (n, H, D) pre-scaled rows of samples
    ``lens``; kc, vc (B, m, H, D) each sample's compressed keys; ``ends`` (m,) ascending, the last
    position of each compressed block: a query at position t sees those with ``ends <= t`` (a
    prefix); ``weight`` (n, H) or None scales each output row. Returns (n, H, Dv), zeros where a
    query sees none."""
    batch, m, heads = kc.shape[:3]
    first = _firsts(lens, q.device)
    seen = torch.searchsorted(
        ends.to(torch.int32),
        torch.arange(len(first), device=q.device, dtype=torch.int32) - first,
        right=True,
        out_int32=True,
    )
    if batch == 1:
        start = torch.zeros_like(first)  # the compressed keys' first row: each sample's m keys
    else:
        lens_t = torch.as_tensor(lens, device=q.device)
        start = torch.repeat_interleave(
            torch.arange(0, batch * m, m, dtype=torch.int32, device=q.device), lens_t, output_size=len(first)
        )
    none = seen.new_empty(len(first), 1, 0)
    spans = Spans(1, heads, none, none, own_start=start, own_count=seen)
    kr, vr = (x.contiguous().view(batch * m, heads, x.shape[-1]) for x in (kc, vc))
    gate = None if weight is None else weight[..., None]
    out, _, _ = SpanAttention.apply(q.contiguous(), kr, vr, gate, spans, False, m)
    return out


def _firsts(lens: list[int], device) -> torch.Tensor:
    """(n,) int32, each token's sample's first row, for samples of ``lens`` in a row."""
    if len(lens) == 1:
        return torch.zeros(lens[0], dtype=torch.int32, device=device)
    lens_t = torch.as_tensor(lens, dtype=torch.int32, device=device)
    return torch.repeat_interleave(torch.cumsum(lens_t, 0, dtype=torch.int32) - lens_t, lens_t, output_size=sum(lens))
