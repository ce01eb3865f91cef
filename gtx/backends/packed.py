"""Plain attention over short packed samples on the CPU: each query reads every key of its own
sample (or, causal, those up to its position) where they lie, on the C kernel ``packed_kernel.c``,
without padding samples to a common length. ``gtx.backends.flash`` runs batches of short samples on
it (a copy task's); long samples stay on SDPA's blocked kernels."""

from __future__ import annotations

import torch

from gtx import native

KERNEL = "packed_kernel"


def attend_samples(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: torch.Tensor, causal: bool):
    """q (n, H, D) scaled, k (N, H, D), v (N, H, Dv), float32 on the CPU, ``spans`` (S, 4) int64: per
    sample its first query row, queries, first key row, keys (every query row in one sample, every
    sample with keys; causal: as many keys as queries) -> (out (n, H, Dv), log-sum-exp of each query's
    scores per head (n, H), without gradient). Needs the kernel (``available``)."""
    return _PackedAttention.apply(q, k, v, spans, causal)


def available(*tensors: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors here (float32 on the CPU, built)."""
    return native.kernel(KERNEL, *tensors) is not None


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans, causal):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        n, heads = q.shape[:2]
        out, lse = q.new_empty(n, heads, v.shape[-1]), q.new_empty(n, heads)
        _call("gtx_packed_forward", spans, causal, q, k, v, out, lse)
        ctx.save_for_backward(q, k, v, spans, out, lse)
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _):
        q, k, v, spans, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        delta = (grad * out).sum(-1)  # (n, H): the softmax backward's row term
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _call("gtx_packed_backward", spans, ctx.causal, q, k, v, grad, lse, delta, dq, dk, dv)
        return dq, dk, dv, None, None


def _call(function: str, spans: torch.Tensor, causal: bool, q, k, v, *tensors) -> None:
    spans = spans.contiguous()
    call = getattr(native.load(KERNEL), function)
    shape = native.ints(native.parts(len(spans)), len(spans))
    dims = native.ints(int(causal), q.shape[1], q.shape[2], v.shape[2])
    native.check(call(*shape, native.pointer(spans), *dims, *(native.pointer(t) for t in (q, k, v, *tensors))))
