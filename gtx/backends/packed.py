"""Attention where each query reads one contiguous range of keys of its own sample, on the CPU: the
keys read where they lie, on the C kernel ``packed_kernel.c``, without padding samples to a common
length or blocks. Short samples, complete or causal (``gtx.backends.flash`` runs unequal ones here),
and windows over them (``local``, ``auto``'s candidate ``packed``). Where a sample's ranges move
forward with its queries and head sizes are multiples of 16, the kernel runs 16 queries (or keys) at
once, one per vector lane; elsewhere query by query."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtx import native
from gtx.backends import Backend
from gtx.graph.tokens import EdgeSet

KERNEL = "packed_kernel"
RANGES_CACHE_BYTES = 1 << 26  # ranges kept with a pattern per batch lengths (``EdgeSet.shared_plan``)
# a query's work beyond its keys, in keys: its tile reads the union of 16 queries' ranges (15 keys past a
# window's own) and moves its rows in and out of lanes (``auto``'s cost units; fit to timings)
QUERY_WORK = 32


@dataclass
class Ranges:
    """Per query, the keys it reads: ``ranges`` (n_dst, 2) int64, its first key and one past its last,
    within its sample; ``spans`` (S, 4) int64, per sample its first query row, queries, first key
    row, keys (the kernel's parts own whole samples)."""

    spans: torch.Tensor
    ranges: torch.Tensor


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors here (float32 on the CPU, built)."""
    return native.kernel(KERNEL, *tensors) is not None


def sample_spans(q_lens, k_lens) -> torch.Tensor:
    """(S, 4): per sample of ``q_lens`` queries and ``k_lens`` keys, packed in order, its first query
    row, queries, first key row, keys."""
    q_lens, k_lens = torch.as_tensor(q_lens), torch.as_tensor(k_lens)
    return torch.stack([torch.cumsum(q_lens, 0) - q_lens, q_lens, torch.cumsum(k_lens, 0) - k_lens, k_lens], 1)


def plain_ranges(q_lens, k_lens, causal: bool) -> Ranges:
    """Every sample complete (each query reads all its sample's keys) or causal (keys up to its position)."""
    spans = sample_spans(q_lens, k_lens)
    sample = torch.repeat_interleave(torch.arange(len(spans)), spans[:, 1])
    lo = spans[sample, 2]
    hi = lo + (torch.arange(len(sample)) - spans[sample, 0] + 1 if causal else spans[sample, 3])
    return Ranges(spans, torch.stack([lo, hi], 1))


def edge_ranges(edges: EdgeSet) -> Ranges | None:
    """The edge set's ranges where each query's keys are one contiguous run within its sample
    (``EdgeSet.sample_lens``); None where not. O(edges), once per set (per pattern and lengths for a
    batch's set: batches of the same lengths share it)."""
    return edges.shared_plan("packed-ranges", lambda: _edge_ranges(edges), RANGES_CACHE_BYTES, _bytes)


def _bytes(ranges: Ranges | None) -> int:
    return 0 if ranges is None else 8 * (ranges.spans.numel() + ranges.ranges.numel())


def _edge_ranges(edges: EdgeSet) -> Ranges | None:
    if edges.parent is not None:
        return None  # an ACT subset runs by its full set's ranges
    spans = sample_spans(*edges.sample_lens())
    src, dst = edges.src.cpu(), edges.dst.cpu()
    count = torch.bincount(dst, minlength=edges.n_dst)
    first = torch.cumsum(count, 0) - count  # each query's first edge (edges are sorted by query, then key)
    lo = torch.zeros(edges.n_dst, dtype=torch.long)
    lo[count > 0] = src[first[count > 0]]
    # unique sorted keys are one run where each sits as far from the query's first as its rank
    if not torch.equal(src - lo[dst], torch.arange(len(src)) - first[dst]):
        return None
    sample = torch.repeat_interleave(torch.arange(len(spans)), spans[:, 1])
    k0 = spans[sample, 2]
    lo = torch.where(count > 0, lo, k0)
    if bool(((lo < k0) | (lo + count > k0 + spans[sample, 3])).any()):
        return None  # a key of another sample: the kernel's parts would share rows
    return Ranges(spans, torch.stack([lo, lo + count], 1))


def attend_ranges(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: Ranges):
    """q (n, H, D) scaled, k (N, H, D), v (N, H, Dv), float32 on the CPU -> (out (n, H, Dv), each
    query's log-sum-exp of its scores per head (n, H), without gradient; a query without keys: 0 and
    -inf). Needs the kernel (``available``)."""
    return _PackedAttention.apply(q, k, v, ranges.spans, ranges.ranges)


class PackedBackend(Backend):
    """``auto``'s candidate for edge sets whose queries each read one contiguous run of their sample's
    keys (``edge_ranges``), on the CPU in float32; an ACT subset runs by its full set's ranges."""

    name = "packed"

    def available(self, device="cpu") -> str | None:
        if torch.device(device).type != "cpu" or native.load(KERNEL) is None:
            return "packed runs on the CPU, on a C kernel built with the system's compiler"
        return None

    def supports(self, edges: EdgeSet, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and edge_ranges(edges.root) is not None

    def __call__(self, q, k, v, edges):
        out = attend_ranges(q, k, v, edge_ranges(edges.root))[0]
        return out if edges.parent is None else out * edges.keep[:, None, None].to(out.dtype)

    def with_lse(self, q, k, v, edges):
        if edges.parent is not None:
            return super().with_lse(q, k, v, edges)
        return attend_ranges(q, k, v, edge_ranges(edges))


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans, ranges):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        n, heads = q.shape[:2]
        out, lse = q.new_empty(n, heads, v.shape[-1]), q.new_empty(n, heads)
        _call("gtx_packed_forward", spans, ranges, q, k, v, out, lse)
        ctx.save_for_backward(q, k, v, spans, ranges, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _):
        q, k, v, spans, ranges, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        delta = (grad * out).sum(-1)  # (n, H): the softmax backward's row term
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _call("gtx_packed_backward", spans, ranges, q, k, v, grad, lse, delta, dq, dk, dv)
        return dq, dk, dv, None, None


def _call(function: str, spans: torch.Tensor, ranges: torch.Tensor, q, k, v, *tensors) -> None:
    spans, ranges = spans.contiguous(), ranges.contiguous()
    call = getattr(native.load(KERNEL), function)
    shape = native.ints(native.parts(len(ranges)), len(spans))
    dims = native.ints(q.shape[1], q.shape[2], v.shape[2])
    tensors = [native.pointer(t) for t in (q, k, v, *tensors)]
    native.check(call(*shape, native.pointer(spans), native.pointer(ranges), *dims, *tensors))
