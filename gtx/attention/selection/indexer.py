"""A lightning indexer's scores, choice and KL loss (DSA, DeepSeek-V3.2): the scoring proxy of
token-level learned selection.

``I(t, s) = sum_j w(t, j) relu(q(t, j) . k(s))`` for index queries q (n, J, d), weights w (n, J)
and one index key per token k (N, d). Nothing here holds an n x n matrix: the choice scores a block
of query rows at a time; the KL reads only the kept keys. On the CPU in float32 the C kernels of
``index_kernel.c`` fuse each step (scores and a candidate buffer with quickselect; scores, KL and
its gradients), and ``dense_kernel.c`` the dense KL's element-wise steps between torch's products;
where ``kernels.use_triton`` says (CUDA by default; before the C kernels), the Triton kernels of
``triton_index`` (the choice in float32, the sparse KL); elsewhere the same definitions run as torch ops. The choice may
score in int8 (``top_indexed``'s ``precision``), the KL always in float32.

Positions enter before scoring: ``rotate`` turns the leading dimensions of index queries and keys
by their tokens' positions (``rotary_angles``), so the kernels score rotated vectors as any others.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.checkpoint import checkpoint

from gtx import native
from gtx.attention.selection import kernels
from gtx.attention.selection.choice import PRECISIONS, int8_scores, top_native, top_scored
from gtx.graph.tokens import EdgeSet

ROWS = 256  # query rows scored at once: (rows x keys) scores, never n x n
# DeepSeek-V3.2-Exp's rotary angles as its published model computes them: base 10000, stretched by
# YaRN (factor 40 from 4096 positions, ramp between 32 and 1 rotations) since it reads longer texts
ROPE_BASE, YARN_FACTOR, YARN_POSITIONS, YARN_FAST, YARN_SLOW = 10000.0, 40.0, 4096, 32, 1


def rotary_angles(positions: torch.Tensor, dims: int) -> torch.Tensor:
    """(n,) positions -> (n, dims / 2) angles in float64: pair i turns at base^(-2i / dims) per
    position, divided by YARN_FACTOR for the slow pairs (those under YARN_SLOW rotations over
    YARN_POSITIONS) and blended linearly between those and the fast ones (over YARN_FAST)."""

    def pair_of(rotations):  # the pair index that turns ``rotations`` times over YARN_POSITIONS
        return dims * math.log(YARN_POSITIONS / (rotations * 2 * math.pi)) / (2 * math.log(ROPE_BASE))

    low, high = max(math.floor(pair_of(YARN_FAST)), 0), min(math.ceil(pair_of(YARN_SLOW)), dims - 1)
    pairs = torch.arange(dims // 2, dtype=torch.float64)
    slow = ((pairs - low) / max(high - low, 1e-3)).clamp(0, 1)  # 0: kept, 1: divided by the factor
    freqs = ROPE_BASE ** (-2 * pairs / dims)
    freqs = freqs * (1 - slow) + freqs / YARN_FACTOR * slow
    return positions.to(torch.float64)[:, None] * freqs.to(positions.device)


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (n, ..., d) with its first 2 * angles.shape[-1] dimensions turned as adjacent pairs
    (2i, 2i + 1) by ``angles`` (n, pairs), each pair a complex number times exp(i angle); the rest as is."""
    if angles.shape[-1] == 0:
        return x
    cos, sin = (f(angles).to(x.dtype).view(len(x), *[1] * (x.dim() - 2), -1) for f in (torch.cos, torch.sin))
    turned = x[..., : 2 * angles.shape[-1]].unflatten(-1, (-1, 2))
    a, b = turned[..., 0], turned[..., 1]
    return torch.cat(
        [torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2), x[..., 2 * angles.shape[-1] :]], -1
    )


def index_scores(iq: torch.Tensor, w: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
    """I(t, s) = sum_j w(t, j) relu(iq(t, j) . ik(s)): iq (r, J, d), w (r, J), ik (S, d) -> (r, S);
    ik may also be per query, (r, S, d)."""
    dots = torch.einsum("rjd,sd->rjs", iq, ik) if ik.dim() == 2 else torch.einsum("rjd,rsd->rjs", iq, ik)
    dots = torch.relu(dots) if dots.requires_grad else dots.relu_()  # in place where no gradient needs the input
    return torch.bmm(w.unsqueeze(1), dots).squeeze(1)


def kl_to(target: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over rows of KL(target || softmax(logits)) over the ``valid`` entries."""
    return kl_masked(target.masked_fill(~valid, 0.0), logits.masked_fill(~valid, torch.finfo(logits.dtype).min))


def kl_masked(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum over rows of KL(p || softmax(logits)), where an entry left out has p = 0 and the logit
    finfo.min: finite, so that its 0 x log q is 0 (with -inf it is NaN) and no mask is needed after."""
    return (p * (p.clamp_min(1e-30).log_() - torch.log_softmax(logits, -1))).sum()


def top_indexed(iq, w, ik, edges: EdgeSet, count: int, precision: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the ``count`` candidate keys (complete or causal, ``edges.root.structure``) with the
    highest index score, equal scores preferring the later key: key ids (n, K) (int32 from the C and
    Triton kernels) and valid (n, K) (invalid slots hold key 0). No gradient. ``precision`` "int8": ranked by
    the scores of queries and keys quantised per token (``gtx.attention.selection.choice.int8_scores``), as
    DeepSeek's indexer runs in FP8; on the CPU on int8 dot products. Records the kernel that ran under
    ``edges.stage`` (``kernels.record``: ``triton:index``, ``c:index`` or ``torch:index``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"index precision {precision!r}: one of {', '.join(PRECISIONS)}")
    int8 = precision == "int8"
    if not int8 and kernels.use_triton(iq.device):
        from gtx.attention.selection import triton_index  # imports triton: only where it runs

        if triton_index.serves(iq.shape[1], iq.shape[2], count):
            kernels.record(edges.stage, "triton:index")
            return triton_index.top_indexed(iq, w, ik, edges, count)
    if native.kernel("index_kernel", iq, w, ik) is None:
        kernels.record(edges.stage, "torch:index")
        score = int8_scores if int8 else index_scores
        return top_scored(
            edges, count, lambda block, keys: score(iq[block], w[block], ik[keys]), ROWS, later_first=True
        )
    kernels.record(edges.stage, "c:index")
    return top_native(iq, w, ik, edges, count, int8=int8)


def index_kl(p, iq, w, ik, keys, valid) -> torch.Tensor:
    """sum over queries of KL(p || softmax(I over the kept keys)): targets p (n, K) over keys (n, K)
    (valid (n, K)); gradients reach iq, w and ik only. Never an (n, K, d) copy of index keys."""
    if kernels.use_triton(iq.device):
        from gtx.attention.selection import triton_index

        return triton_index.index_kl(p, iq, w, ik, keys, valid)
    if native.kernel("index_kernel", iq, w, ik) is not None:
        return _IndexKL.apply(p, iq, w, ik, keys, valid)

    # the kept keys gathered inside: the backward keeps no (rows, K, d) copy
    def block(p_r, iq_r, w_r, ik, keys_r, valid_r):
        return kl_to(p_r, index_scores(iq_r, w_r, ik[keys_r]), valid_r)

    total = p.new_zeros(())
    for r0 in range(0, len(keys), ROWS):
        r = slice(r0, r0 + ROWS)
        total = total + checkpoint(block, p[r], iq[r], w[r], ik, keys[r], valid[r], use_reentrant=False)
    return total


class _IndexKL(torch.autograd.Function):
    """The C kernel computes the loss and its gradients in one pass; backward scales them."""

    @staticmethod
    def forward(ctx, p, iq, w, ik, keys, valid):
        lib = native.load("index_kernel")
        iq, w, ik, valid, p = (x.contiguous() for x in (iq, w, ik, valid, p))
        keys = keys.to(torch.int32).contiguous()
        native.check_ids(keys, len(ik), "index key")
        loss, diq, dw = p.new_empty(len(keys)), torch.empty_like(iq), torch.empty_like(w)
        parts = native.parts(len(keys))
        diks = ik.new_zeros(parts, *ik.shape)  # each part adds into its own, summed after
        ptrs = [native.pointer(x) for x in (iq, w, ik, keys, valid, p, loss, diq, dw, diks)]
        native.check(
            lib.gtx_index_kl(*native.ints(parts, len(keys), len(ik), iq.shape[1], keys.shape[1], iq.shape[2]), *ptrs)
        )
        ctx.save_for_backward(diq, dw, diks.sum(0))
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        diq, dw, dik = ctx.saved_tensors
        return None, diq * grad, dw * grad, dik * grad, None, None


def dense_index_kl(q, k, lse, iq, w, ik, lens: list[int], rows: int, size: int = 1) -> torch.Tensor:
    """sum over the queries of causal samples of ``lens`` tokens (packed in a row) of KL(p || softmax(I)):
    p the main attention's distribution over the query's own and earlier keys (softmax(q . k), q (n, H, D)
    pre-scaled, averaged over heads) against the indexer's scores over the same keys; ``size`` > 1: both per
    block of ``size`` positions (p's mass per block, ik (samples, blocks, d) the blocks' index keys) over the
    query's own block and those before. ``lse`` (n, H): each query's log-sum-exp of its scores per head as the
    fused attention computed it, so that p = exp(q . k - lse) takes no softmax pass; None: computed here.
    ``rows`` query rows at a time, the widest blocks first, dealt in turn to one worker per torch thread
    on the CPU (each on one thread: blocks side by side, where splitting each op across the threads costs a
    barrier per op); the loss and its gradients in one pass, the backward only scales them: nothing is
    recomputed and no (rows, keys) buffer outlives its block. Gradients reach iq, w, ik only."""
    return _DenseKL.apply(q.detach(), k.detach(), lse, iq, w, ik, lens, rows, size)


class _DenseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, lse, iq, w, ik, lens, rows, size):
        heads = q.shape[1]
        diq, dw = iq.new_zeros(iq.shape), w.new_zeros(w.shape)  # contiguous: the kernel path writes rows of them
        own = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)  # a block's later keys
        samples, blocks, start = [], [], 0
        for sample, n in enumerate(lens):
            tokens = slice(start, start + n)
            # the sample's keys, (H, D + 1, n), with a row of ones, and queries (H, n, D + 1) with
            # -(lse + log H): their product is exp's argument (no pass to subtract it)
            kt = torch.cat([k[tokens].permute(1, 2, 0), k.new_ones(heads, 1, n)], 1)
            qt = q[tokens].transpose(0, 1)
            if lse is not None:
                qt = torch.cat([qt, -(lse[tokens].T.to(q.dtype) + math.log(heads))[..., None]], -1)
            samples.append((start, kt, qt, tokens if size == 1 else sample))
            blocks += [(sample, r0, min(r0 + rows, n)) for r0 in range(0, n, rows)]
            start += n
        # the widest blocks first, dealt in turn to the workers: each about the same work
        blocks.sort(key=lambda b: b[2], reverse=True)

        lib = native.kernel("dense_kernel", q, k, iq, w, ik)

        @torch.no_grad()  # grad mode is per thread: the workers' too
        def work(part: int, parts: int):
            if parts > 1:  # one thread each: blocks side by side, not every op split (a barrier each)
                torch.set_num_threads(1)
            total, dik = q.new_zeros(()), ik.new_zeros(ik.shape)  # contiguous, as the kernel path writes
            buffers = _Buffers(q, heads, rows, iq.shape[1], max(lens))
            for sample, r0, r1 in blocks[part::parts]:
                start, kt, qt, at = samples[sample]
                r = slice(start + r0, start + r1)
                # the kernel reads no later key (size 1): no mask where the log-sum-exp is given
                hide = None if lib is not None and size == 1 and lse is not None else own[: r1 - r0, : r1 - r0]
                s = _scores(qt[:, r0:r1], kt[..., :r1], lse is not None, hide, r0, buffers.scores(r1 - r0, r1))
                keys, c0 = ik[at][: -(-r1 // size)], r0 // size
                if lib is not None:
                    dots = buffers.dots(r1 - r0, len(keys))
                    total += _fit_native(lib, s, iq[r], w[r], keys, r0, size, diq[r], dw[r], dik[at][: len(keys)], dots)
                    continue
                p = s.exp_().sum(0)
                if size > 1:
                    p = per_block(p, size)
                # the columns after each row's own: only among those from the block's first row's own
                after = (
                    own[: r1 - r0, : r1 - r0]
                    if size == 1
                    else torch.arange(c0, len(keys), device=q.device)[None, :]
                    > (torch.arange(r0, r1, device=q.device) // size)[:, None]
                )
                loss, diq[r], dw[r], dk = _fit(p, iq[r], w[r], keys, after, c0)
                dik[at][: len(keys)] += dk
                total += loss
            return total, dik

        threads = torch.get_num_threads()
        parts = min(threads, len(blocks)) if q.device.type == "cpu" else 1
        if parts == 1:
            total, dik = work(0, 1)
        else:
            try:
                with ThreadPoolExecutor(parts) as pool:
                    done = list(pool.map(work, range(parts), [parts] * parts))
            finally:
                torch.set_num_threads(threads)  # the workers set the count new threads start with
            total, dik = sum(t for t, _ in done), sum(d for _, d in done)
        ctx.save_for_backward(diq, dw, dik)
        return total

    @staticmethod
    def backward(ctx, grad):
        diq, dw, dik = ctx.saved_tensors
        return None, None, None, diq * grad, dw * grad, dik * grad, None, None, None


class _Buffers:
    """One worker's scores and index dots, reused by each of its blocks: a fresh (heads, rows, keys)
    buffer per block is megabytes of new pages, each zeroed by the kernel on first touch."""

    def __init__(self, q, heads: int, rows: int, index_heads: int, keys: int):
        self._scores = q.new_empty(heads * rows * keys)
        self._dots = q.new_empty(rows * index_heads * keys)
        self.heads, self.index_heads = heads, index_heads

    def scores(self, rows: int, keys: int) -> torch.Tensor:
        return self._scores[: self.heads * rows * keys].view(self.heads, rows, keys)

    def dots(self, rows: int, keys: int) -> torch.Tensor:
        return self._dots[: rows * self.index_heads * keys].view(rows, self.index_heads, keys)


def _scores(qt, kt, shifted: bool, own, r0: int, out: torch.Tensor) -> torch.Tensor:
    """(H, rows, keys): for rows r0.. of a causal sample, each head's q . k - log-sum-exp - log H (the
    head-mean attention is the sum of their exps) over keys ``kt`` (H, D + 1, keys) (their last row
    ones) from queries ``qt`` (H, rows, D + 1 where ``shifted``: the last entry each row's -(log-sum-exp
    + log H), else D); ``own`` (rows, rows) hides later keys (-inf), None leaves them."""
    heads, dim = qt.shape[0], kt.shape[1] - 1
    s = torch.bmm(qt, kt if shifted else kt[:, :dim], out=out)
    if own is not None:
        s[..., r0:].masked_fill_(own, float("-inf"))
    if not shifted:
        s.sub_(s.logsumexp(-1, keepdim=True) + math.log(heads))
    return s


def _fit_native(lib, s, iq, w, keys, r0: int, size: int, diq, dw, dik, dots) -> torch.Tensor:
    """``_fit`` on the C kernel (``dense_kernel.c``) from the heads' ``_scores`` s (size 1), else from
    p per block: the element-wise steps row by row, the products on torch's. Writes
    the gradients into diq (r, J, d) and dw (r, J), adds the keys' into dik (C, d); returns the loss."""
    if size > 1:
        s = per_block(s.exp_().sum(0), size)
    torch.mm(iq.flatten(0, 1), keys.T, out=dots.view(-1, len(keys)))  # (r, J, C): d loss / d dots after the kernel
    loss = s.new_empty(len(iq))
    buffers = (s.contiguous(), w.contiguous(), dots, loss, dw)  # alive for the call
    heads = s.shape[0] if s.dim() == 3 else 0
    args = native.ints(len(iq), keys.shape[0], heads, iq.shape[1], r0, size)
    native.check(lib.gtx_dense_fit(*args, *(native.pointer(x) for x in buffers)))
    grads = dots.flatten(0, 1)
    torch.mm(grads, keys, out=diq.view(len(grads), -1))
    dik.addmm_(grads.T, iq.flatten(0, 1))
    return loss.sum()


def _fit(p, iq, w, keys, after, c0: int):
    """KL(p || softmax(I)) summed over rows, I = index scores of iq (r, J, d), w (r, J) over ``keys``
    (C, d), columns c0.. hidden where ``after``; and its gradients for iq, w, keys."""
    dots = (iq @ keys.T).relu_()  # (r, J, C)
    logits = torch.bmm(w.unsqueeze(1), dots).squeeze(1)
    logits[:, c0:].masked_fill_(after, torch.finfo(logits.dtype).min)  # finite: p is 0 there, and 0 x min is 0
    # softmax's exp once, for the loss's log-sum-exp and the gradient; the loss as one dot product
    top, mass = logits.amax(-1, keepdim=True), p.sum(-1, keepdim=True)
    grad = (logits - top).exp_()
    sums = grad.sum(-1, keepdim=True)
    loss = torch.vdot(p.flatten(), p.clamp_min(1e-30).log_().sub_(logits).flatten()) + (mass * (top + sums.log())).sum()
    grad.mul_(mass / sums).sub_(p)  # d loss / d logits
    dw = torch.bmm(dots, grad.unsqueeze(-1)).squeeze(-1)
    grad_dots = dots.sign_().mul_(w.unsqueeze(-1)).mul_(grad.unsqueeze(1))  # relu's gradient: 1 where positive
    return loss, grad_dots @ keys, dw, grad_dots.flatten(0, 1).T @ iq.flatten(0, 1)


def per_block(p: torch.Tensor, size: int) -> torch.Tensor:
    """(rows, keys) weights -> (rows, ceil(keys / size)): each block's sum."""
    return torch.nn.functional.pad(p, (0, -p.shape[-1] % size)).unflatten(-1, (-1, size)).sum(-1)
