"""blocksparse: edges -> a block layout, dense attention per block row over the gathered key blocks.

Queries are cut into blocks of ``block`` rows. A query block's key blocks are the key blocks that
hold at least one of its edges; they are gathered whole (padded to the longest row) and each query block
runs one scaled_dot_product_attention over them, with an element mask only when some active block
is partly filled (a layout whose blocks are all full runs unmasked). Exact: the same function as
``dense``, forward and backward, on any device; one long sequence and a batch of many short
samples (a block-diagonal graph) are the same case. Work is O(active blocks * block^2).

A layout whose block rows form a band (query block i reads key blocks i+first .. i+first+K-1, as a
sliding window's do, whatever the pattern) keeps ``band`` = first: the CPU kernel then reads each
row's keys as a strided view (no gather of K copies): in one forward call, of one copy of the keys
padded at both ends; in its backward, a chunk of rows at a time, of the keys themselves (a copy only
for the chunks whose blocks run past them), and it adds the K diagonals of key gradients with K
slice additions instead of an index_add.
A layout is planned once per pattern, stage and sample lengths (``EdgeSet.shared_plan``): batches
of one shape reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gtx.backends import Backend
from gtx.graph.tokens import EdgeSet


@dataclass
class Layout:
    """A block plan. ``key_blocks`` (n_qb, K) lists each query block's key blocks (padding slots
    repeat block 0 and are masked); ``mask`` (n_qb, block, K*block) or None when every block is
    full; ``has_edge`` (n_dst,) marks queries with at least one edge (others output zeros); ``cell``
    (E,) each edge's place in the flattened (n_qb, block, K*block) mask (where a score bias goes), None
    for a band, whose places follow from the edges (``cells``): a window's kept 16 MB at 16384 tokens."""

    block: int
    n_qb: int
    n_kb: int
    key_blocks: torch.Tensor
    mask: torch.Tensor | None
    has_edge: torch.Tensor
    all_have_edges: bool
    cell: torch.Tensor | None
    band: int | None = None
    _additive: dict = field(default_factory=dict, repr=False, compare=False)  # additive_mask's, per dtype

    def rows(self, keep_rows: torch.Tensor) -> Layout:
        """The same plan restricted to some query blocks (for ACT: blocks holding an active query)."""
        mask = None if self.mask is None else self.mask[keep_rows]
        return Layout(
            self.block,
            self.n_qb,
            self.n_kb,
            self.key_blocks[keep_rows],
            mask,
            self.has_edge,
            self.all_have_edges,
            self.cell,
        )

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as SDPA's CPU kernel takes it, (n_qb, 1, block, K*block) in the queries' dtype (the
        kernel reads it as that type): 0 on an edge, -inf off it; made once per layout and dtype,
        shared by the layers that attend under it."""
        if self.mask is None:
            return None
        if dtype not in self._additive:
            self._additive[dtype] = torch.zeros(self.mask.shape, dtype=dtype).masked_fill_(~self.mask, float("-inf"))[
                :, None
            ]
        return self._additive[dtype]

    def cells(self, edges: EdgeSet) -> torch.Tensor:
        """``cell``, or for a band each edge's place computed from ``edges`` (those the layout was planned from)."""
        if self.cell is not None:
            return self.cell
        return _cells(
            edges, self.block, self.key_blocks.shape[1], edges.src // self.block - edges.dst // self.block - self.band
        )

    def scores(self, bias: torch.Tensor, edges: EdgeSet) -> torch.Tensor:
        """(n_qb, H, block, K*block) additive mask: each edge's bias, -inf off the edges (a row
        without edges gets one 0, its output zeroed like the boolean mask's); ``edges`` those planned."""
        k_width = self.key_blocks.shape[1] * self.block
        out = torch.full(
            (bias.shape[1], self.n_qb * self.block * k_width), float("-inf"), dtype=bias.dtype, device=bias.device
        )
        out[:, self.cells(edges)] = bias.t()
        out = out.view(-1, self.n_qb, self.block, k_width).transpose(0, 1)
        empty = ~F.pad(self.has_edge, (0, self.n_qb * self.block - len(self.has_edge))).view(self.n_qb, self.block)
        return out.masked_fill(empty[:, None, :, None] & (torch.arange(k_width, device=bias.device) == 0), 0.0)


def block_pairs(edges: EdgeSet, block: int) -> tuple[torch.Tensor, int]:
    """Sorted unique (query block, key block) ids of the edges, and the number of key blocks."""
    n_kb = -(-edges.n_src // block)
    return torch.unique((edges.dst // block) * n_kb + edges.src // block), n_kb


def row_slots(row: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For sorted row ids of active blocks: blocks per row (n_rows,) and each block's slot in its row."""
    counts = torch.bincount(row, minlength=n_rows)
    return counts, torch.arange(len(row), device=row.device) - (torch.cumsum(counts, 0) - counts)[row]


def plan(edges: EdgeSet, block: int) -> Layout:
    """Build the block layout of an edge set (vectorised; a few ms for 10^5 edges)."""
    src, dst, device = edges.src, edges.dst, edges.device
    n_qb = max(-(-edges.n_dst // block), 1)
    pairs, n_kb = block_pairs(edges, block)
    band = _band(pairs, n_qb, n_kb)
    if band is not None:
        first, k_max = band
        key_blocks = _band_blocks(n_qb, first, k_max, device).clamp_(0, n_kb - 1)
        edge_slot = src // block - dst // block - first
    else:
        row, col = pairs // n_kb, pairs % n_kb
        counts, slot = row_slots(row, n_qb)
        k_max = max(int(counts.max()) if len(counts) else 1, 1)
        key_blocks = torch.zeros(n_qb, k_max, dtype=torch.long, device=device)
        key_blocks[row, slot] = col
        edge_slot = slot[torch.searchsorted(pairs, (dst // block) * n_kb + src // block)]
    cell = _cells(edges, block, k_max, edge_slot)
    mask = torch.zeros(n_qb, block, k_max * block, dtype=torch.bool, device=device)
    mask.view(-1)[cell] = True
    has_edge = torch.zeros(n_qb * block, dtype=torch.bool, device=device)
    has_edge[dst] = True
    mask.view(n_qb * block, -1)[~has_edge, 0] = True  # SDPA needs one key per row; outputs zeroed
    has_edge = has_edge[: edges.n_dst]
    mask = None if bool(mask.all()) else mask
    if band is not None:
        cell = None  # a band's places follow from its edges: computed again where a bias needs them
    return Layout(
        block, n_qb, n_kb, key_blocks, mask, has_edge, bool(has_edge.all()), cell, None if band is None else band[0]
    )


def _cells(edges: EdgeSet, block: int, k_max: int, edge_slot: torch.Tensor) -> torch.Tensor:
    """(E,) each edge's place in the flattened (n_qb, block, K*block) mask, given its key block's slot in its row."""
    return edges.dst * (k_max * block) + edge_slot * block + edges.src % block


def _band(pairs: torch.Tensor, n_qb: int, n_kb: int) -> tuple[int, int] | None:
    """(first, K) when the active blocks are exactly a band: row i holds key blocks i+first ..
    i+first+K-1 that lie in 0..n_kb-1 (every row at least one, some row all K: no wider than the
    gathered rows), else None."""
    if not len(pairs):
        return None
    row, col = pairs // n_kb, pairs % n_kb
    first = int((col - row).min())
    k_max = int((col - row).max()) - first + 1
    if k_max != int(torch.bincount(row).max()):  # (and before an n_qb x K tensor of a wide set)
        return None
    want = _band_blocks(n_qb, first, k_max, pairs.device)
    inside = (want >= 0) & (want < n_kb)
    if not bool(inside.any(1).all()):
        return None
    want = (torch.arange(n_qb, device=pairs.device)[:, None] * n_kb + want)[inside]
    return (first, k_max) if want.shape == pairs.shape and torch.equal(want, pairs) else None


def _band_blocks(n_qb: int, first: int, k_max: int, device) -> torch.Tensor:
    """(n_qb, K): row i's key blocks i+first .. i+first+K-1, in range or not."""
    return torch.arange(n_qb, device=device)[:, None] + first + torch.arange(k_max, device=device)


def band_keys(x: torch.Tensor, layout: Layout, part: slice = slice(None)) -> torch.Tensor:
    """(rows, H, K*block, D): the key blocks i+first .. i+first+K-1 of each query block i in ``part``, one
    strided view (no copy per slot) of ``x`` where every block they name lies in it, else of a copy of
    the key rows they span, zero padded (blocks out of range are masked)."""
    b, k_max, first = layout.block, layout.key_blocks.shape[1], layout.band
    rows = range(layout.n_qb)[part]
    lo, hi = (rows.start + first) * b, (rows.stop - 1 + first + k_max) * b
    if 0 <= lo and hi <= x.shape[0]:
        span = x[lo:hi]
    else:
        span = x.new_zeros(hi - lo, *x.shape[1:])
        a, z = max(lo, 0), min(hi, x.shape[0])
        span[a - lo : z - lo] = x[a:z]
    step = span.stride()
    shape = (len(rows), k_max * b, *x.shape[1:])
    return span.as_strided(shape, (b * step[0], *step), span.storage_offset()).transpose(1, 2)


def _band_grad(grad: torch.Tensor, layout: Layout, part: slice, into: torch.Tensor) -> None:
    """``band_keys``' backward for the query blocks in ``part``: adds (rows, H, K*block, D) gradients
    into ``into`` (n_kb, block, H, D), slot j of row i at key block i+first+j (those in range)."""
    b, first, rows = layout.block, layout.band, range(layout.n_qb)[part]
    grad = grad.transpose(1, 2).unflatten(1, (-1, b))  # (rows, K, b, H, D)
    for j in range(grad.shape[1]):
        lo, hi = max(rows.start + first + j, 0), min(rows.stop + first + j, layout.n_kb)
        if lo < hi:
            into[lo:hi] += grad[lo - (rows.start + first + j) : hi - (rows.start + first + j), j]


def gather_blocks(x: torch.Tensor, layout: Layout, part: slice = slice(None)) -> torch.Tensor:
    """(n, H, D) -> (rows, H, K*block, D): the key blocks of each query block (of those in ``part``),
    gathered whole. Gathering blocks (index_select, whose backward is index_add) rather than single
    keys keeps the backward cheap."""
    b, k_max = layout.block, layout.key_blocks.shape[1]
    blocks = _pad_rows(x, layout.n_kb * b).view(layout.n_kb, b, *x.shape[1:])
    return blocks.index_select(0, layout.key_blocks[part].flatten()).view(-1, k_max * b, *x.shape[1:]).transpose(1, 2)


def _key_blocks_grad(grad: torch.Tensor, layout: Layout, part: slice, into: torch.Tensor) -> None:
    """``gather_blocks``' backward: adds (rows, H, K*block, D) gradients of the gathered blocks of
    the query blocks in ``part`` into ``into`` (n_kb, block, H, D), at the key blocks they came from."""
    into.index_add_(
        0, layout.key_blocks[part].flatten(), grad.transpose(1, 2).reshape(-1, layout.block, *into.shape[2:])
    )


# layouts kept per pattern for batches of the same lengths (a window of 256 at 16384 tokens: ~60 MB)
PLAN_CACHE_BYTES = 256 << 20

# gathered key rows per call of the kernel: at 4 heads of 32, 2 MB for each copy of k, v and their gradients
CHUNK_KEYS = 1 << 12
# a band's keys are views, only its backward's key gradients are copies (8 MB each at 4 heads of 32): fewer, larger calls
BAND_CHUNK_KEYS = 1 << 14


class _GatheredBlocks(torch.autograd.Function):
    """SDPA's CPU flash kernel, each query block over its gathered key blocks, a chunk of query blocks
    at a time. The backward keeps q, k, v, the output and its log-sum-exp, not the gathered blocks (a
    key is copied once per query block that reads it: three times the keys for a window of two
    blocks), and gathers them again, a chunk at a time: keeping them, or gathering all at once,
    grew a step's peak memory with the sequence. A band layout reads strided views of k and v
    (``band_keys``): its forward in one call, over copies padded at both ends; its backward a chunk at a
    time over k and v themselves."""

    @staticmethod
    def forward(ctx, qb, k, v, layout: Layout):
        rows, heads, b, _ = qb.shape
        mask = layout.additive_mask(qb.dtype)
        keys = _key_blocks(k, v, layout)

        def call(part):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qb[part], *keys(part), attn_mask=None if mask is None else mask[part], scale=1.0
            )

        if layout.band is not None:  # the keys are views: one call, its outputs kept as they come
            out, lse = call(slice(None))
        else:
            # laid out as the kernel lays out its own output, (rows, b, H, D) in memory: the caller's (n, H, D) view is no copy
            out = qb.new_empty(rows, b, heads, v.shape[-1]).transpose(1, 2)
            lse = qb.new_empty(rows, heads, b)
            for part in _chunks(layout):
                out[part], lse[part] = call(part)
        ctx.save_for_backward(qb, k, v, out, lse)
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad):
        qb, k, v, out, lse = ctx.saved_tensors
        layout = ctx.layout
        mask = layout.additive_mask(qb.dtype)  # the kernel reads grad as it comes: no contiguous copy
        dq = torch.empty_like(qb)
        dk, dv = (x.new_zeros(layout.n_kb, layout.block, *x.shape[1:]) for x in (k, v))
        # a band's chunks read k and v themselves (padded copies of both held two more k-sized tensors here)
        keys = _key_blocks(k, v, layout)
        add = _key_blocks_grad if layout.band is None else _band_grad
        for part in _chunks(layout):
            dq[part], dkb, dvb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[part],
                qb[part],
                *keys(part),
                out[part],
                lse[part],
                0.0,
                False,
                attn_mask=None if mask is None else mask[part],
                scale=1.0,
            )
            add(dkb, layout, part, dk)
            add(dvb, layout, part, dv)
        return dq, dk.flatten(0, 1)[: k.shape[0]], dv.flatten(0, 1)[: v.shape[0]], None


def _key_blocks(k: torch.Tensor, v: torch.Tensor, layout: Layout):
    """``part -> (keys, values)`` of the query blocks in ``part``: for a band layout views of ``k`` and
    ``v`` (``band_keys``: copies only for the parts whose blocks run past them), else gathered per call."""
    if layout.band is None:
        return lambda part: (gather_blocks(k, layout, part), gather_blocks(v, layout, part))
    return lambda part: (band_keys(k, layout, part), band_keys(v, layout, part))


def _chunks(layout: Layout):
    """Slices of query blocks whose gathered keys number about CHUNK_KEYS (a band's, BAND_CHUNK_KEYS)."""
    rows, width = layout.key_blocks.shape[0], layout.key_blocks.shape[1] * layout.block
    step = max(1, (CHUNK_KEYS if layout.band is None else BAND_CHUNK_KEYS) // width)
    return [slice(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    edges: EdgeSet | None = None,
) -> torch.Tensor:
    """Attention under a layout; ``rows`` restricts it to some query blocks (the rest output zeros);
    ``bias`` (E, H) is added to the score of each of ``edges`` (those the layout was planned from)."""
    n_dst, heads, dim = q.shape
    b = layout.block
    qp = _pad_rows(q, layout.n_qb * b).view(layout.n_qb, b, heads, dim)
    if rows is not None:
        qp = qp.index_select(0, rows)  # backward: index_add (indexing's would be a slower index_put)
    qb = qp.transpose(1, 2)  # (rows, H, b, D)
    if bias is None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and dim == v.shape[-1]:
        out = _GatheredBlocks.apply(qb, k, v, layout)
    else:  # a bias (differentiable: SDPA's kernel is not, in its mask), values of another width, a GPU: through SDPA
        mask = None if layout.mask is None else layout.mask[:, None]
        if bias is not None:
            mask = layout.scores(bias.to(q.dtype), edges)
            mask = mask if rows is None else mask.index_select(0, rows)
        out = F.scaled_dot_product_attention(
            qb, gather_blocks(k, layout), gather_blocks(v, layout), attn_mask=mask, scale=1.0
        )
    out = out.transpose(1, 2)  # (rows, b, H, Dv)
    if rows is not None:
        full = out.new_zeros(layout.n_qb, b, heads, v.shape[-1])
        out = full.index_copy(0, rows, out)
    out = out.reshape(layout.n_qb * b, heads, v.shape[-1])
    out = out if out.shape[0] == n_dst else out[:n_dst]  # a slice's backward allocates a zeroed copy, even of all rows
    return out if layout.all_have_edges else out * layout.has_edge[:, None, None].to(out.dtype)


def _layout_bytes(layout: Layout) -> int:
    """A layout's memory, counting the float32 additive mask it makes on first use."""
    mask = 0 if layout.mask is None else 5 * layout.mask.numel()
    cell = 0 if layout.cell is None else layout.cell.numel()
    return mask + 8 * (cell + layout.key_blocks.numel()) + layout.has_edge.numel()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))


class BlockSparseBackend(Backend):
    """Block-sparse: dense SDPA per query block over the key blocks that hold edges."""

    name = "blocksparse"
    supports_bias = True

    def __init__(self, block: int = 64):
        self.block = block

    def layout(self, edges: EdgeSet) -> Layout:
        return edges.shared_plan(
            ("blocksparse", self.block), lambda: plan(edges, self.block), PLAN_CACHE_BYTES, _layout_bytes
        )

    def __call__(self, q, k, v, edges, bias=None):
        # an ACT subset: reuse the full plan on the blocks with kept queries
        if edges.parent is not None and bias is None:
            layout = self.layout(edges.parent)
            keep = edges.keep
            rows = torch.nonzero(
                F.pad(keep, (0, layout.n_qb * layout.block - len(keep))).view(layout.n_qb, -1).any(1)
            ).squeeze(1)
            out = attend(q, k, v, layout.rows(rows), rows)
            return out * keep[:, None, None].to(out.dtype)
        # a biased subset: its own plan, as its bias is per its edges
        return attend(q, k, v, self.layout(edges), bias=bias, edges=edges)
