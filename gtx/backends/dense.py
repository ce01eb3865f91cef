"""dense: scaled_dot_product_attention with a boolean (n_dst, n_src) mask built from the edges.

The reference every other backend is tested against. O(n_dst * n_src) time and memory.
"""

import torch
import torch.nn.functional as F

from gtx.backends import Backend
from gtx.graph import EdgeSet


def _mask(edges: EdgeSet) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The attention mask (None for a complete edge set: SDPA's unmasked kernel) and the rows to keep."""
    if edges.num_edges == edges.n_dst * edges.n_src:
        return None, None
    adj = edges.dense()
    empty = edges.in_degree() == 0
    if not empty.any():
        return adj, None
    adj[empty, 0] = True  # SDPA returns NaN for an all-masked row; its output is zeroed below
    return adj, (~empty)[:, None, None].to(torch.float32)


class DenseBackend(Backend):
    """SDPA over a dense boolean mask: the reference."""

    name = "dense"

    def __call__(self, q, k, v, edges):
        mask, keep = edges.plan(("dense", q.device), lambda: _mask(edges))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=1.0
        ).transpose(0, 1)  # (H, n_dst, Dv) -> (n_dst, H, Dv)
        return out if keep is None else out * keep.to(out.dtype)
