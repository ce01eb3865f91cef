"""Token-level selections: per query and head, the keys it reads (``topk``, ``dsa``).

``attend_keys`` runs a ``KeySelection`` on one of three kernels (``gtx.attention.selection.kernels``
chooses): fused Triton kernels (``triton_keys``: on CUDA, or under Triton's interpreter); on the
CPU in float32 a C kernel (``keys_kernel.c``) that reads the selected keys where they lie;
elsewhere torch ops over a block of query rows at a time, gathering them. Each backward recomputes
the scores from the saved log-sum-exp, as FlashAttention does, and no n x K x D copy of the keys
outlives a block of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtx import native
from gtx.attention.selection import kernels
from gtx.graph.tokens import EdgeSet

RANGE_SHIFT = (
    8  # 2^8 keys per range of the C backward: their k, v, dk and dv rows (H x 64 dims: 512 KB) stay in a core's cache
)
_CHUNK = 1 << 21  # gathered key elements (rows x heads x keys x dims) per block of query rows, on the CPU
# ... and off it, where a block costs its ~20 kernel launches whatever its size: 8x the CPU's blocks
# (64 MB a gathered tensor in float32); at 16384 tokens and 2048 keys a query, the CPU's blocks of
# 8 rows made two thirds of a DSA step's 30,000 ops
_ACCELERATOR_CHUNK = 1 << 24


@dataclass
class KeySelection:
    """Per query and head group, the keys it attends to: ``keys`` (n_dst, H // group, K) key ids
    (int64, or int32 as the C kernels make them) and ``valid`` (n_dst, H // group, K) bool (a query
    with fewer candidates than K leaves slots invalid; an invalid slot's id still lies among the
    keys). Head h reads row h // group: ``group`` adjacent heads share one choice (1: each head its
    own, as ``topk``'s; H: one for all, as DSA's indexer makes it), and a kernel reads a shared key's
    heads as one span. Made from complete or causal candidates without listing their edges."""

    keys: torch.Tensor
    valid: torch.Tensor
    group: int = 1

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` and ``valid`` as (n_dst, H, K), one row per head: a view where each head has its
        own row or all share one (head stride 0), else a copy."""
        if self.group == 1:
            return self.keys, self.valid
        if self.keys.shape[1] == 1:
            heads = self.group
            return self.keys.expand(-1, heads, -1), self.valid.expand(-1, heads, -1)
        return self.keys.repeat_interleave(self.group, 1), self.valid.repeat_interleave(self.group, 1)

    def per_query(self) -> torch.Tensor:
        """(n_dst,) keys each query reads, the mean over heads (``gtx.attention.budget``)."""
        return self.valid.sum(-1).to(torch.float64).mean(1)  # each group holds as many heads: its mean is theirs

    def edges_per_head(self) -> float:
        return float(self.per_query().sum())

    def as_mask(self, edges: EdgeSet) -> torch.Tensor:
        """The same choice as a keep mask (E, H) over the candidate edges."""
        hit = (self.keys[edges.dst] == edges.src[:, None, None]) & self.valid[edges.dst]  # (E, H // group, K)
        hit = hit.any(-1)
        return hit if self.group == 1 else hit.repeat_interleave(self.group, 1)


def attend_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, sel: KeySelection, probs: bool = False
):
    """Attention of each query and head over its selected keys: q (n, H, D), k (N, H, D), v (N, H, E)
    in, (n, H, E) out in q's dtype (scores q . k: q arrives scaled). ``probs``: also the attention
    weights averaged over the heads, (n, K) without gradient (DSA's indexer target; float32 on the
    Triton and C kernels, q's dtype on torch ops). Records the kernel that ran under ``edges.stage``
    (``kernels.record``: ``triton:keys``, ``c:keys`` or ``torch:keys``)."""
    if kernels.use_triton(q.device):
        from gtx.attention.selection import triton_keys  # imports triton: only where it runs

        kernels.record(edges.stage, "triton:keys")
        out, mean_p = triton_keys.attend(q, k, v, sel.keys, sel.valid, sel.group, probs)
    else:
        kernels.record(edges.stage, "c:keys" if native.kernel("keys_kernel", q, k, v) is not None else "torch:keys")
        out, mean_p = _KeyAttention.apply(q, k, v, *sel.per_head())
    out = out if edges.keep is None else out * edges.keep[:, None, None].to(out.dtype)
    return (out, mean_p) if probs else out


def _blocks(n: int, heads: int, count: int, width: int, device: torch.device):
    chunk = _CHUNK if device.type == "cpu" else _ACCELERATOR_CHUNK
    rows = max(1, chunk // max(1, heads * count * width))
    for r0 in range(0, n, rows):
        yield slice(r0, min(r0 + rows, n))


class _Gather:
    """The selected keys' rows of (N, H, D) tensors as (n, H, K, D), for ``keys`` (n, H, K): index_select
    on the (key, head) rows, several times faster than gather. (A choice shared by the heads gains
    nothing from copying whole rows: the scores then need the heads first, another copy.)"""

    def __init__(self, keys: torch.Tensor, heads: int):
        self.rows = (keys * heads + torch.arange(heads, device=keys.device)[None, :, None]).flatten()
        self.shape = keys.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).index_select(0, self.rows).view(*self.shape, x.shape[-1])

    def add(self, into: torch.Tensor, pairs: torch.Tensor) -> None:
        """``into`` (N, H, D) += (n, H, K, D) contributions at the gathered rows."""
        into.view(-1, into.shape[-1]).index_add_(0, self.rows, pairs.flatten(0, 2))


def _scores(q, ks, valid):
    return torch.einsum("nhd,nhkd->nhk", q, ks).masked_fill(~valid, float("-inf"))  # batched matmuls


class _KeyAttention(torch.autograd.Function):
    """Softmax over each query's selected keys; backward from the log-sum-exp. On the CPU in float32
    the C kernel (``keys_kernel.c``) reads the selected keys in place; elsewhere blocks of query rows
    gather them (``_Gather``)."""

    @staticmethod
    def forward(ctx, q, k, v, keys, valid):
        if len(k) == 0 and not valid.any():  # no keys, none selected: every query reads nothing, as an invalid slot
            forward = _forward_none
        else:
            native.check_ids(keys, len(k))
            forward = _forward_native if native.kernel("keys_kernel", q, k, v) else _forward_torch
        out, lse, mean_p = forward(q, k, v, keys, valid)
        ctx.save_for_backward(q, k, v, keys, valid, out, lse)
        ctx.mark_non_differentiable(mean_p)
        return out, mean_p

    @staticmethod
    def backward(ctx, grad, _):
        q, k, v, keys, valid, out, lse = ctx.saved_tensors
        if len(k) == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None
        backward = _backward_native if native.kernel("keys_kernel", q, k, v) else _backward_torch
        return *backward(q, k, v, keys, valid, grad.contiguous(), out, lse), None, None


def _native_args(q, k, v, keys, valid):
    keys = keys.to(torch.int32)  # the kernel's key ids (``top_indexed`` makes them so: no copy)
    if keys.stride(-1) != 1 or keys.stride() != valid.stride():
        keys, valid = keys.contiguous(), valid.contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    shape = (q.shape[1], keys.shape[2], q.shape[2], v.shape[2])
    return shape, (q, k, v, keys, valid), (keys.stride(0), keys.stride(1))


def _forward_native(q, k, v, keys, valid):
    lib = native.load("keys_kernel")
    shape, tensors, strides = _native_args(q, k, v, keys, valid)
    n, (heads, count) = q.shape[0], shape[:2]
    out, lse, mean_p = q.new_empty(n, heads, v.shape[-1]), q.new_empty(n, heads), q.new_empty(n, count)
    ptrs = [native.pointer(t) for t in (*tensors, out, lse, mean_p)]
    native.check(
        lib.gtx_keys_forward(*native.ints(native.parts(n), n, *shape), *ptrs[:5], *native.ints(*strides), *ptrs[5:])
    )
    return out, lse, mean_p


def _backward_native(q, k, v, keys, valid, grad, out, lse):
    """The kernel's parts take disjoint ranges of keys (``RANGE_SHIFT``): each adds to its own dk and
    dv rows and to its own dq, the dq's summed after."""
    lib = native.load("keys_kernel")
    shape, tensors, strides = _native_args(q, k, v, keys, valid)
    n = q.shape[0]
    parts = native.parts(((k.shape[0] - 1) >> RANGE_SHIFT) + 1)
    delta = (grad * out).sum(-1)  # (n, H): the softmax backward's row term
    dqs, dk, dv = q.new_zeros(parts, *q.shape), torch.zeros_like(k), torch.zeros_like(v)
    ptrs = [native.pointer(t) for t in (*tensors, grad, lse, delta, dqs, dk, dv)]
    native.check(
        lib.gtx_keys_backward(
            *native.ints(parts, RANGE_SHIFT, n, k.shape[0], *shape), *ptrs[:5], *native.ints(*strides), *ptrs[5:]
        )
    )
    return dqs.sum(0), dk, dv


def _forward_none(q, k, v, keys, valid):
    n, heads = q.shape[:2]
    return q.new_zeros(n, heads, v.shape[-1]), q.new_full((n, heads), float("-inf")), q.new_zeros(n, keys.shape[2])


def _forward_torch(q, k, v, keys, valid):
    n, heads, count = q.shape[0], q.shape[1], keys.shape[2]
    out = q.new_zeros(n, heads, v.shape[-1])
    lse = q.new_full((n, heads), float("-inf"))
    mean_p = q.new_zeros(n, count)
    for r in _blocks(n, heads, count, max(q.shape[-1], v.shape[-1]), q.device):
        gather = _Gather(keys[r], heads)
        score = _scores(q[r], gather(k), valid[r])
        lse[r] = torch.logsumexp(score, -1)
        p = torch.exp(score - lse[r, :, None]).nan_to_num_(0.0)  # a query without a valid key: no weight
        out[r] = torch.einsum("nhk,nhkd->nhd", p, gather(v))
        mean_p[r] = p.mean(1)
    return out, lse, mean_p


def _backward_torch(q, k, v, keys, valid, grad, out, lse):
    # contiguous whatever the inputs' strides: gradients are added into them through flat views
    dq, dk, dv = (torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    delta = (grad * out).sum(-1)  # (n, H): the softmax backward's row term
    n, heads, count = q.shape[0], q.shape[1], keys.shape[2]
    for r in _blocks(n, heads, count, max(q.shape[-1], v.shape[-1]), q.device):
        gather = _Gather(keys[r], heads)
        ks, vs = gather(k), gather(v)
        p = torch.exp(_scores(q[r], ks, valid[r]) - lse[r, :, None]).nan_to_num_(0.0)
        ds = p * (torch.einsum("nhd,nhkd->nhk", grad[r], vs) - delta[r, :, None])
        dq[r] = torch.einsum("nhk,nhkd->nhd", ds, ks)
        gather.add(dk, ds[..., None] * q[r][:, :, None, :])
        gather.add(dv, p[..., None] * grad[r][:, :, None, :])
    return dq, dk, dv
