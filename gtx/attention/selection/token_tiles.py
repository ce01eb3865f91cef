"""MoBA's per-token block kernel on SDPA's fused CPU kernel (plain torch ops on other devices): the
path a ``TokenBlockSelection`` runs on where the Triton kernels do not (``kernels.use_triton``).

Each token's own block runs as causal block attention; the chosen earlier blocks as tiles of up to
``block`` queries that chose the same block of the same head, against that block's keys, in chunks;
their partial softmaxes merge by log-sum-exp. ``TokenBlocks.apply(q, k, v, gate, TokenBlockPlan(sel,
heads, device))`` -> (out (n, H, Dv), masses (n, H, 1 + K)); the selection has a row per head.
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 128  # own blocks (of one sample and head) per chunk: 256 (and 256 tiles) held 14 MB more at 16k tokens
TILES = 128  # tiles of chosen blocks per chunk
# Chunks on an accelerator are this many times larger: there a chunk costs some 20 kernel launches
# whatever its size, and at BLOCK_ROWS and TILES a MoBA step on an H200 spent 625 ms of CPU time
# launching 47 ms of GPU work; 32x larger chunks hold ~100 MB at 16k tokens
ACCELERATOR_CHUNKS = 32
GATE_ROWS = 1024  # query tokens per chunk of the gate's gradient: its product with the output stays small


def chunk_scale(device) -> int:
    """How many times larger a chunk of rows is on ``device``: 1 on the CPU, whose chunks are sized for
    its caches; ``ACCELERATOR_CHUNKS`` elsewhere, where a chunk costs its kernel launches."""
    return 1 if torch.device(device).type == "cpu" else ACCELERATOR_CHUNKS


class TokenBlockPlan:
    """Where each (token, head, chosen block) pair sits among the tiles: tiles of ``block`` query
    places, one tile group per (sample, head, block), filled in token order. The blocks of q, k, v
    are each sample's own, (sample, head, block) in order: a short sample of a mixed batch has
    its few blocks, not the longest sample's count."""

    def __init__(self, sel, heads: int, device):
        """``sel``: a ``TokenBlockSelection`` with a row per head (group=1)."""
        self.block, self.heads = sel.block, heads
        self.scale = chunk_scale(device)
        b = self.block
        lens = torch.as_tensor(sel.lens, device=device)
        n_blocks = (lens + b - 1) // b  # per sample
        sample = torch.repeat_interleave(torch.arange(len(sel.lens), device=device), lens)
        first = (torch.cumsum(n_blocks, 0) - n_blocks) * heads  # each sample's first block row
        # (B, H): a head's first block row
        start = first[:, None] + torch.arange(heads, device=device)[None, :] * n_blocks[:, None]
        self.n_rows = int(n_blocks.sum()) * heads
        # each token's place in its sample
        position = torch.arange(len(sample), device=device) - (torch.cumsum(lens, 0) - lens)[sample]
        # (n, H): each (token, head)'s place in the blocks
        place = (start[sample] + (position // b)[:, None]) * b + (position % b)[:, None]
        place_of = place.flatten()  # by (token, head) row of (n * H, ...) views
        # each block place's (token, head) row, or one past them. The indices the backward keeps are
        # int32 (half of int64's bytes; rows of n * H stay far below 2^31), made int64 a chunk at a
        # time where an op needs it
        self.source = (
            torch.full((self.n_rows * b,), len(sample) * heads, dtype=torch.long, device=device)
            .index_copy_(0, place_of, torch.arange(len(sample) * heads, device=device))
            .to(torch.int32)
        )
        self.padded = len(place_of) < len(self.source)
        token, head, slot = sel.valid.nonzero(as_tuple=True)
        # the (sample, head, block) row of the key blocks
        group = start[sample[token], head] + sel.blocks[token, head, slot]
        order = torch.argsort(group, stable=True)
        token, head, slot, group = token[order], head[order], slot[order], group[order]
        self.slots = sel.blocks.shape[-1]
        pair = token * heads + head
        self.pair = pair.to(torch.int32)  # each pair's (token, head) row of (n * H, D) views
        self.mass_at = (pair * (1 + self.slots) + 1 + slot).to(torch.int32)  # its place in (n * H, 1 + K) masses
        rank = torch.arange(len(group), device=device) - torch.searchsorted(group, group, side="left")
        per_group = torch.zeros(self.n_rows, dtype=torch.long, device=device).index_add_(
            0, group, torch.ones_like(group)
        )
        tiles = (per_group + b - 1) // b
        tile = (torch.cumsum(tiles, 0) - tiles)[group] + rank // b
        self.n_tiles = int(tiles.sum())
        self.place = (tile * b + rank % b).to(torch.int32)  # each pair's query place among the tiles' n_tiles * b
        self.key_rows = torch.zeros(self.n_tiles, dtype=torch.long, device=device).index_copy(0, tile, group)

    def blocks(self, x: torch.Tensor, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """(n, H, D) -> (rows, 1, b, D): the given block rows (a slice or ids) of every sample and
        head, a sample's last block zero padded."""
        source = self.places(rows)
        flat = x.reshape(-1, x.shape[-1])
        out = flat.index_select(0, source.clamp_max(len(flat) - 1))
        if self.padded:
            out.masked_fill_((source == len(flat))[:, None], 0.0)
        return out.view(-1, 1, self.block, x.shape[-1])

    def places(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """(rows * b,): the (token, head) row of each place of the given block rows, n * H for padding:
        where ``blocks``' output goes back to in an (n * H + 1, ...) buffer whose last row takes the padding."""
        return self.source.view(self.n_rows, self.block)[rows].reshape(-1).long()

    def block_rows(self):
        """Slices of ``BLOCK_ROWS`` block rows (times ``scale``): the own blocks run a chunk at a time, so
        that their copies of q, k, v and the gradients stay small."""
        step = BLOCK_ROWS * self.scale
        return [slice(r0, min(r0 + step, self.n_rows)) for r0 in range(0, self.n_rows, step)]

    def chunks(self, keys: slice = slice(None)):
        """(key block rows, pair slice, places within the chunk) per chunk of up to ``TILES`` tiles (times
        ``scale``), of the tiles whose key block rows lie in ``keys`` (all by default): tiles run a
        chunk at a time, so that their copies of q, k, v and the gradients stay small."""
        # the tiles whose key block rows lie in ``keys`` (tiles are in key block row order)
        lo, hi = (0, self.n_tiles) if keys == slice(None) else _found(self.key_rows, [keys.start, keys.stop])
        bounds = [*range(lo, hi, TILES * self.scale), hi]
        firsts = _found(self.place // self.block, bounds)  # each chunk's first pair: pairs are in tile order
        for t0, t1, p0, p1 in zip(bounds, bounds[1:], firsts, firsts[1:]):
            yield self.key_rows[t0:t1], slice(p0, p1), (self.place[p0:p1] - t0 * self.block).long()


def _found(ascending: torch.Tensor, values: list[int]) -> list[int]:
    """Where each of ``values`` goes in ``ascending`` (searchsorted), in one search and one copy to the
    host: a read per value would be a sync each on a GPU."""
    return torch.searchsorted(ascending, torch.tensor(values, dtype=ascending.dtype, device=ascending.device)).tolist()


def _tiles(pairs: torch.Tensor, places: torch.Tensor, n_tiles: int, block: int) -> torch.Tensor:
    """(pairs, D) -> (n_tiles, 1, block, D): each pair's row at its place in the tiles, empty places zero."""
    out = torch.zeros(n_tiles * block, pairs.shape[-1], dtype=pairs.dtype, device=pairs.device)
    return out.index_copy(0, places, pairs).view(n_tiles, 1, block, -1)


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` viewed as (-1, last dim): index_select, several times faster than advanced indexing."""
    return x.reshape(-1, x.shape[-1]).index_select(0, rows)


FUSED_DEVICES = ("cpu",)  # where SDPA's fused kernel that returns the log-sum-exp exists (its CPU flash kernel)


def _flash(q, k, v, causal: bool):
    """Softmax attention of (T, 1, b, D) tiles, unscaled: (out, lse (T, 1, b)). Other devices than the
    CPU run the same in plain torch ops: (T, b, b) scores, the size of the tiles' edges."""
    if q.device.type in FUSED_DEVICES:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=1.0)
    score = _scores(q, k, causal)
    lse = torch.logsumexp(score, -1)
    return torch.exp(score - lse[..., None]) @ v, lse


def _flash_backward(grad, q, k, v, out, lse, causal: bool):
    """Gradients (dq, dk, dv) of ``_flash`` given its output and log-sum-exp (which may be the merged ones)."""
    if q.device.type in FUSED_DEVICES:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=1.0
        )
    p = torch.exp(_scores(q, k, causal) - lse[..., None])
    ds = p * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ grad


def _scores(q, k, causal: bool):
    score = q @ k.transpose(-1, -2)
    if causal:
        later = torch.ones(score.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        score = score.masked_fill(later, float("-inf"))
    return score


_HEADROOM = 16.0  # how far a part's lse may pass a row's shift: weights up to e^16, far from float32's e^88


class TokenBlocks(torch.autograd.Function):
    """Own blocks and chosen blocks as separate softmaxes merged by log-sum-exp. Backward: each part
    through ``_flash_backward`` with the merged output and the part's share of the gradient, which
    is the gradient of the merged softmax (the split-softmax identity FlashAttention's splits use).
    Outputs and gradients go straight to (n * H + 1, D) row buffers, a chunk at a time (the last row
    takes padding): no buffer of every block's rows or of every chosen block's output."""

    @staticmethod
    def forward(ctx, q, k, v, gate, plan: TokenBlockPlan):
        q, k, v = (x.contiguous() for x in (q, k, v))  # read a chunk at a time: each a view, not a copy
        pair, b, rows_n = plan.pair, plan.block, q.shape[0] * q.shape[1]
        acc, own_lse = q.new_empty(rows_n + 1, v.shape[-1]), q.new_empty(rows_n + 1)
        for r in plan.block_rows():  # padding keys lie after every real query of their block
            o, lse = _flash(plan.blocks(q, r), plan.blocks(k, r), plan.blocks(v, r), True)
            places = plan.places(r)
            acc.index_copy_(0, places, o.reshape(-1, o.shape[-1]))
            own_lse.index_copy_(0, places, lse.reshape(-1))
        acc, own_lse = acc[:rows_n], own_lse[:rows_n]
        # online merge, a chunk of chosen blocks at a time: acc holds sum exp(lse_i - top) out_i and total
        # sum exp(lse_i - top), top a shift per row that rises (rescaling the row) only where a part's lse
        # passes it by more than _HEADROOM: rarely, where rescaling at every new maximum moves rows every chunk
        top, total = own_lse.clone(), torch.ones_like(own_lse)
        part_lse = own_lse.new_empty(len(pair))
        for rows, pairs, places in plan.chunks():
            tile_out, tile_lse = _flash(
                _tiles(_take(q, pair[pairs]), places, len(rows), b), plan.blocks(k, rows), plan.blocks(v, rows), False
            )
            at, lse = pair[pairs], tile_lse.reshape(-1).index_select(0, places)
            part_lse[pairs] = lse
            over = lse > top[at] + _HEADROOM
            if over.any():
                new_top = top.scatter_reduce(0, at[over].long(), lse[over], "amax")
                risen = (new_top > top).nonzero().squeeze(1)
                scale = torch.exp(top[risen] - new_top[risen])
                acc.index_copy_(0, risen, acc.index_select(0, risen).mul_(scale[:, None]))
                total[risen] *= scale
                top = new_top
            weight = torch.exp(lse - top[at])
            acc.index_add_(0, at, _take(tile_out, places).mul_(weight[:, None]))
            total.index_add_(0, at, weight)
        lse = top + torch.log(total)
        out = acc.div_(total[:, None]).view(*q.shape[:2], v.shape[-1])
        own_w, part_w = torch.exp(own_lse - lse), torch.exp(part_lse - lse[pair])
        own_lse = own_lse.view(q.shape[:2])
        mass = own_w.new_zeros(*own_lse.shape, 1 + plan.slots)  # (n, H, 1 + K): each block's share of the softmax
        mass[..., 0] = own_w.view_as(own_lse)
        mass.view(-1)[plan.mass_at] = part_w
        ctx.plan = plan
        ctx.mark_non_differentiable(mass)
        # k, v, not their blocks: the backward copies them again
        ctx.save_for_backward(q, k, v, out, own_lse, part_lse, own_w, part_w, gate)
        return (out if gate is None else out * gate), mass

    @staticmethod
    def backward(ctx, grad, _):
        plan = ctx.plan
        q, k, v, out, own_lse, part_lse, own_w, part_w, gate = ctx.saved_tensors
        grad = grad.contiguous()
        b, rows_n = plan.block, q.shape[0] * q.shape[1]
        dgate = None
        if gate is not None:
            # the gated output's gradient is grad * gate: the gate joins each part's weight (per row)
            # rather than a gated copy of grad; its own gradient a chunk of rows at a time
            dgate = gate.new_empty(gate.shape)
            for t0 in range(0, q.shape[0], GATE_ROWS):
                rows = slice(t0, t0 + GATE_ROWS)
                dgate[rows] = (grad[rows] * out[rows]).sum(-1, keepdim=True)
            g = gate.reshape(own_w.shape)
            own_w, part_w = own_w * g, part_w * g.reshape(-1)[plan.pair]
        dq, dk, dv = (x.new_empty(rows_n + 1, x.shape[-1]) for x in (q, k, v))
        # a chunk of block rows at a time: their own blocks' gradients, then the chosen tiles whose keys
        # are these blocks add to the same chunk's dk, dv, which go to the rows once. Last chunk first:
        # a query's chosen blocks come before its own, so its dq is written before they add to it
        for r in reversed(plan.block_rows()):
            dqo, dko, dvo = _flash_backward(
                plan.blocks(grad, r) * plan.blocks(own_w.view(*own_lse.shape, 1), r),
                plan.blocks(q, r),
                plan.blocks(k, r),
                plan.blocks(v, r),
                plan.blocks(out, r),
                plan.blocks(own_lse[..., None], r)[..., 0],
                True,
            )
            places = plan.places(r)
            dq.index_copy_(0, places, dqo.reshape(-1, dqo.shape[-1]))  # every real place once
            dko, dvo = dko.reshape(-1, b, dko.shape[-1]), dvo.reshape(-1, b, dvo.shape[-1])
            for rows, pairs, at in plan.chunks(r):
                pair = plan.pair[pairs]
                n_tiles = len(rows)
                # empty places: 0, harmless where the gradient is 0
                lse = _tiles(part_lse[pairs, None], at, n_tiles, b)[..., 0]
                dqt, dkt, dvt = _flash_backward(
                    _tiles(_take(grad, pair) * part_w[pairs, None], at, n_tiles, b),
                    _tiles(_take(q, pair), at, n_tiles, b),
                    plan.blocks(k, rows),
                    plan.blocks(v, rows),
                    _tiles(_take(out, pair), at, n_tiles, b),
                    lse,
                    False,
                )
                # in place: a copy per chunk would move all of dq each time
                dq.index_add_(0, pair, _take(dqt, at))
                dko.index_add_(0, rows - r.start, dkt.view(-1, b, dkt.shape[-1]))
                dvo.index_add_(0, rows - r.start, dvt.view(-1, b, dvt.shape[-1]))
            dk.index_copy_(0, places, dko.view(-1, dko.shape[-1]))
            dv.index_copy_(0, places, dvo.view(-1, dvo.shape[-1]))
        return dq[:rows_n].view_as(q), dk[:rows_n].view_as(k), dv[:rows_n].view_as(v), dgate, None
