"""torch: edge-wise attention in plain torch (gather, scatter-max, index_add); any device.

Memory O(E * H * D): one message per edge is materialised. Simple and portable, not fast.
"""

import torch

from gtx.backends import Backend, float32_sums


class TorchBackend(Backend):
    """Edge-wise softmax attention with gather/scatter in plain torch."""

    name = "torch"
    supports_bias = True

    @float32_sums
    def __call__(self, q, k, v, edges, bias=None):
        src, dst = edges.src, edges.dst
        n_dst, heads = q.shape[0], q.shape[1]
        score = (q[dst] * k[src]).sum(-1)  # (E, H)
        if bias is not None:
            score = score + bias
        # Shifting every score of a query by the same constant leaves the softmax unchanged, so the
        # max needs no gradient.
        top = torch.full((n_dst, heads), float("-inf"), dtype=score.dtype, device=score.device)
        top = top.scatter_reduce(0, dst[:, None].expand_as(score), score.detach(), "amax")
        weight = torch.exp(score - top[dst])  # (E, H)
        z = torch.zeros(n_dst, heads, dtype=score.dtype, device=score.device).index_add(0, dst, weight)
        wv = torch.zeros(n_dst, heads, v.shape[-1], dtype=v.dtype, device=v.device)
        wv = wv.index_add(0, dst, weight[..., None] * v[src])
        return wv / z.clamp_min(torch.finfo(z.dtype).tiny)[..., None]  # empty queries: 0 / tiny = 0
