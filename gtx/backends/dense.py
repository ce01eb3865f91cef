"""dense: scaled_dot_product_attention with a boolean (n_dst, n_src) mask built from the edges.

The reference every other backend is tested against. O(n_dst * n_src) time and memory. Edge sets
that are plain attention (every sample complete or causal, ``gtx.backends.flash``) run unmasked
instead, as SDPA's fastest kernels; an ACT subset of one too.
"""

import torch
import torch.nn.functional as F

from gtx.backends import Backend, repeat_kv
from gtx.backends.flash import flash_attention, flash_structure
from gtx.graph.tokens import EdgeSet


def _mask(edges: EdgeSet) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention mask and the rows to keep (None: all)."""
    adj = edges.dense()
    empty = edges.in_degree() == 0
    if not empty.any():
        return adj, None
    adj[empty, 0] = True  # SDPA returns NaN for an all-masked row; its output is zeroed below
    return adj, (~empty)[:, None, None].to(torch.float32)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The backend contract computed with a dense boolean mask, whatever the structure; with
    ``bias`` (E, H), a float mask holding each edge's additive score (-inf off the edges)."""
    mask, keep = edges.plan(("dense", q.device), lambda: _mask(edges))
    if bias is not None:
        scores = torch.full((q.shape[1], *mask.shape), float("-inf"), dtype=q.dtype, device=q.device)
        scores[:, edges.dst, edges.src] = bias.t().to(q.dtype)
        if keep is not None:
            scores[:, ~keep.view(-1).bool(), 0] = 0.0  # rows without edges: any finite row, output zeroed below
        mask = scores
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=1.0
    ).transpose(0, 1)  # (H, n_dst, Dv) -> (n_dst, H, Dv)
    return out if keep is None else out * keep.to(out.dtype)


class DenseBackend(Backend):
    """SDPA over a dense boolean mask (the reference); plain attention runs unmasked.

    ``flash=False`` always masks: ``auto``'s candidate, whose cost model describes the masked kernel."""

    name = "dense"
    supports_bias = True
    grouped_kv = True  # plain attention's SDPA takes the groups; the mask's path repeats them

    def __init__(self, flash: bool = True):
        self.flash = flash

    def __call__(self, q, k, v, edges, bias=None):
        structure = flash_structure(edges.root) if self.flash and bias is None else None
        if structure is not None:
            return flash_attention(q, k, v, edges, structure)
        return masked_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), edges, bias)

    def with_lse(self, q, k, v, edges):
        structure = flash_structure(edges.root) if self.flash and edges.parent is None else None
        return (
            super().with_lse(q, k, v, edges) if structure is None else flash_attention(q, k, v, edges, structure, True)
        )
