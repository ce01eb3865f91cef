"""flex: FlexAttention (torch.nn.attention.flex_attention) with a BlockMask built from the edges; CUDA.

The BlockMask comes straight from the block layout (``BlockMask.from_kv_blocks``): blocks whose
every element is an edge are "full" (no per-element mask), the others are "partial" and consult
the layout's element mask through ``mask_mod``. FlexAttention cannot train on CPU (torch raises
"FlexAttention does not support backward on CPU"), so this backend reports itself unavailable
there rather than falling back silently.
"""

from __future__ import annotations

import torch

from gtx.backends import Backend
from gtx.backends.blocksparse import block_pairs, row_slots
from gtx.graph.tokens import EdgeSet

BLOCK = 128


def block_mask(edges: EdgeSet, block: int = BLOCK):
    """A FlexAttention BlockMask of the edge set (queries = rows, keys = columns)."""
    from torch.nn.attention.flex_attention import BlockMask

    device = edges.device
    n_qb, n_kb = -(-edges.n_dst // block), -(-edges.n_src // block)
    pairs, _ = block_pairs(edges, block)
    per_pair = torch.bincount(
        torch.searchsorted(pairs, (edges.dst // block) * n_kb + edges.src // block), minlength=len(pairs)
    )
    row, col = pairs // n_kb, pairs % n_kb
    rows_in = (torch.clamp(edges.n_dst - row * block, max=block)).to(per_pair.dtype)
    cols_in = (torch.clamp(edges.n_src - col * block, max=block)).to(per_pair.dtype)
    full = per_pair == rows_in * cols_in

    def kv_blocks(select):
        r, c = row[select], col[select]
        counts, slot = row_slots(r, n_qb)
        index = torch.zeros(n_qb, n_kb, dtype=torch.int32, device=device)  # BlockMask wants one slot per key block
        index[r, slot] = c.to(torch.int32)
        return counts.to(torch.int32)[None, None], index[None, None]

    # Element lookup for partial blocks, by absolute positions: FlexAttention reads it only there.
    adjacency = edges.plan(("flex-adjacency", device), edges.dense)

    def mask_mod(b, h, q_idx, kv_idx):
        return adjacency[q_idx, kv_idx]

    partial_counts, partial_index = kv_blocks(~full)
    full_counts, full_index = kv_blocks(full)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_index,
        full_counts,
        full_index,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(edges.n_dst, edges.n_src),
    )


_compiled = None


def flex_attention(q, k, v, mask, compile: bool = True):
    """q (n_dst, H, D), k/v (n_src, H, D) -> (n_dst, H, Dv) through FlexAttention."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention as flex

    fn = flex
    if compile:
        if _compiled is None:
            _compiled = torch.compile(flex, dynamic=False)
        fn = _compiled
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask, scale=1.0)
    return out[0].transpose(0, 1)


class FlexBackend(Backend):
    """FlexAttention with a BlockMask from the edges (CUDA; compiled)."""

    name = "flex"

    def available(self, device="cpu"):
        try:
            import torch.nn.attention.flex_attention
        except ImportError:
            return "this torch has no FlexAttention (torch >= 2.5 needed)"
        if torch.device(device).type != "cuda":
            return "FlexAttention cannot train on CPU (torch: 'FlexAttention does not support backward on CPU'); use blocksparse or auto"
        return None

    def __call__(self, q, k, v, edges):
        mask = edges.plan(("flex", q.device), lambda: block_mask(edges))
        out = flex_attention(q, k, v, mask, compile=q.is_cuda)
        return out * (edges.in_degree() > 0)[:, None, None].to(out.dtype)
