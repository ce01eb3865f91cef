"""flex: FlexAttention (torch.nn.attention.flex_attention) with a BlockMask built from the edges.

The BlockMask comes straight from the block layout (``BlockMask.from_kv_blocks``): blocks whose
every element is an edge are "full" (no per-element mask), the others are "partial" and consult
the layout's element mask through ``mask_mod``. The kernel is compiled (``torch.compile``, static
shapes): its first call at a new size compiles for seconds, later calls of that size reuse it. So
that a run's batches of slightly different sizes share kernels, queries and keys are padded to a
ladder of sizes (``padded``, at most ~19% over; padded query blocks read no key block and padded
keys are no edge, so the padding costs a copy, not attention work).

On CUDA it trains; on the CPU torch has the forward only ("FlexAttention does not support backward
on CPU"), so a CPU call that would need gradients is refused in one line (inference: ``gtx eval``,
``gtx bench prefill``, ``gtx generate``, anything under ``torch.no_grad()``, runs it).
"""

from __future__ import annotations

import math
import os
import shutil

import torch
import torch.nn.functional as F

from gtx.backends import Backend
from gtx.backends.blocksparse import block_pairs, row_slots
from gtx.errors import GtxError
from gtx.graph.tokens import EdgeSet

BLOCK = 128
# Distinct compiled sizes a process may hold (dynamo's default, 8, would fall back to the slow eager
# kernel after eight sizes: a run's evaluation batches and a model's layers' stages reach that).
RECOMPILE_LIMIT = 64
ADJACENCY_MAX = 1 << 28  # elements of the partial blocks' element lookup as one adjacency (``block_mask``)
OFFSETS_MAX = 1 << 31  # elements a tensor read by FlexAttention's kernels may hold (their offsets are int32)
PLAN_BYTES = 1 << 30  # a pattern's BlockMasks kept per stage and sample lengths (``EdgeSet.shared_plan``)


def padded(n: int, block: int = BLOCK) -> int:
    """``n`` rounded up to whole blocks, and the blocks up to the ladder ceil(2^(i/4)): few sizes, each
    at most ~19% (and one block) over ``n``."""
    blocks = max(-(-n // block), 1)
    return block * math.ceil(2 ** (math.ceil(4 * math.log2(blocks) - 1e-9) / 4) - 1e-9)


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def block_mask(edges: EdgeSet, block: int = BLOCK):
    """A FlexAttention BlockMask of the edge set (queries = rows, keys = columns), over the padded
    sizes (``padded``)."""
    from torch.nn.attention.flex_attention import BlockMask

    device = edges.device
    n_q, n_k = padded(edges.n_dst, block), padded(edges.n_src, block)
    n_qb, n_kb = n_q // block, -(-edges.n_src // block)
    pairs, _ = block_pairs(edges, block)
    edge_pair = torch.searchsorted(pairs, (edges.dst // block) * n_kb + edges.src // block)
    per_pair = torch.bincount(edge_pair, minlength=len(pairs))
    row, col = pairs // n_kb, pairs % n_kb
    full = per_pair == block * block  # a block cut by the end of the keys or queries holds padding: partial

    def kv_blocks(select):
        r, c = row[select], col[select]
        counts, slot = row_slots(r, n_qb)
        index = torch.zeros(n_qb, n_k // block, dtype=torch.int32, device=device)  # one slot per key block
        index[r, slot] = c.to(torch.int32)
        return counts.to(torch.int32)[None, None], index[None, None]

    # Element lookup for partial blocks (FlexAttention reads it only there): by absolute positions in
    # one (n_q, n_k) adjacency up to ADJACENCY_MAX elements (tiles indexed by block measured 1.7x slower
    # on the CPU), else in one bit tile per partial block: the kernel's int32 offsets overflow past
    # 2^31 elements (a union of a window and a stride at 65536 tokens has 2^31 elements of bool tiles),
    # and at 65536 tokens the adjacency alone would take 4 GB.
    if _one_adjacency(n_q, n_k):
        adjacency = torch.zeros(n_q, n_k, dtype=torch.bool, device=device)
        adjacency[edges.dst, edges.src] = True

        def mask_mod(b, h, q_idx, kv_idx):
            return adjacency[q_idx, kv_idx]

    else:
        # tile 0: no edge (blocks without edges), tile 1: every edge (full blocks), then the partial
        # blocks': exact at every element, wherever a kernel reads it. A tile row holds its keys as the
        # bits of int32 words (bit 31 is the sign: the words are summed, unique edges set distinct bits).
        words = -(-block // 32)
        count = int((~full).sum()) + 2
        if count * block * words >= OFFSETS_MAX:
            raise GtxError(
                f"backend 'flex': {count - 2:,} partial blocks of {block} x {block} exceed FlexAttention's int32 "
                "offsets; use --backend blocksparse or torch for this pattern at this length"
            )
        tile = torch.where(full, 1, torch.cumsum(~full, 0, dtype=torch.int32) + 1).to(torch.int32)
        tile_of = torch.zeros(n_qb, n_k // block, dtype=torch.int32, device=device)
        tile_of[row, col] = tile
        tiles = torch.zeros(count, block, words, dtype=torch.int32, device=device)
        tiles[1] = -1
        partial = ~full[edge_pair]
        key = edges.src[partial] % block
        bit = torch.ones_like(key, dtype=torch.int32).bitwise_left_shift((key % 32).to(torch.int32))
        tiles.index_put_((tile[edge_pair[partial]], edges.dst[partial] % block, key // 32), bit, accumulate=True)

        def mask_mod(b, h, q_idx, kv_idx):
            key = kv_idx % block
            word = tiles[tile_of[q_idx // block, kv_idx // block], q_idx % block, key // 32]
            return (word >> (key % 32)) & 1 != 0

    partial_counts, partial_index = kv_blocks(~full)
    full_counts, full_index = kv_blocks(full)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_index,
        full_counts,
        full_index,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(n_q, n_k),
    )


_compiled = None


def flex_attention(q, k, v, mask, compile: bool = True):
    """q (n_dst, H, D), k/v (n_src, H, D) -> (n_dst, H, Dv) through FlexAttention, ``mask`` from
    ``block_mask`` (its padded sizes: inputs are padded to them, the output cut back)."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention as flex

    fn = flex
    if compile:
        if _compiled is None:
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            _compiled = torch.compile(flex, dynamic=False)
        fn = _compiled
    n_q, n_k = mask.seq_lengths

    def heads_first(x, n):  # (n, H, D) -> (1, H, n padded, D): a view where the GPU needs no padding
        x = x.transpose(0, 1)[None]
        if n > x.shape[2] or x.device.type == "cpu":  # contiguous: the CPU kernel's fast layout
            x = F.pad(x, (0, 0, 0, n - x.shape[2]))
        return x

    out = fn(heads_first(q, n_q), heads_first(k, n_k), heads_first(v, n_k), block_mask=mask, scale=1.0)
    return out[0, :, : q.shape[0]].transpose(0, 1)


def compile_reason(device) -> str | None:
    """Why FlexAttention cannot be compiled for ``device`` here, or None."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return "this torch has no FlexAttention (torch >= 2.5 needed)"
    if torch.device(device).type == "cpu":
        # what torch.compile's CPU kernels are built with (inductor's default is g++, CXX overrides it);
        # looked up on the path, as importing inductor to ask it takes seconds
        if not any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "clang++") if c):
            return "torch.compile finds no C++ compiler for its CPU kernel (g++); install one, or use blocksparse"
    return None


class FlexBackend(Backend):
    """FlexAttention with a BlockMask from the edges (compiled; on the CPU, without gradients only)."""

    name = "flex"

    def available(self, device="cpu"):
        return compile_reason(device)

    def trains_on(self, device="cpu"):
        return torch.device(device).type != "cpu"

    def __call__(self, q, k, v, edges):
        if q.device.type == "cpu" and needs_grad(q, k, v):
            raise GtxError(
                "backend 'flex' runs on the CPU without gradients only (torch's FlexAttention has no CPU backward): "
                "train with --backend auto or blocksparse; flex serves gtx eval, gtx bench prefill, gtx generate"
            )
        mask, alone = edges.shared_plan("flex", lambda: _plan(edges), PLAN_BYTES, _plan_bytes)
        out = flex_attention(q, k, v, mask)
        # a query without keys gets zeros (FlexAttention leaves its row undefined)
        return out if alone is None else torch.where(alone[:, None, None], 0.0, out)


def _plan(edges: EdgeSet):
    """(BlockMask, the queries without keys as a (n_dst,) bool mask or None when there are none)."""
    alone = edges.in_degree() == 0
    return block_mask(edges), alone if bool(alone.any()) else None


def _plan_bytes(plan) -> int:
    """Bytes of a plan's element lookup (``block_mask``): the adjacency, or a bit tile per partial block."""
    mask, _ = plan
    n_q, n_k = mask.seq_lengths
    return n_q * n_k if _one_adjacency(n_q, n_k) else (int(mask.kv_num_blocks.sum()) + 2) * BLOCK**2 // 8


def _one_adjacency(n_q: int, n_k: int) -> bool:
    """Whether ``block_mask`` looks partial blocks' elements up in one (n_q, n_k) adjacency, else in tiles."""
    return n_q * n_k <= ADJACENCY_MAX
