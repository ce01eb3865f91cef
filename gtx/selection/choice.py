"""Per query, the best keys by a score, never an n x n matrix: for complete or causal candidates,
scored in blocks of query rows (torch ops), or on the CPU in float32 on the C kernel
``index_kernel.c`` (scores in tiles of keys, a candidate buffer per row with quickselect). Serves
``topk`` (q.k per head) and DSA's lightning indexer (``gtx.selection.indexer``), whose choice may
also score in int8 (``quantised`` per token, ``int8_scores``), on the kernel's int8 dot products.
"""

from __future__ import annotations

import torch

from gtx import native
from gtx.graph.tokens import EdgeSet

TILE = 128  # keys per tile of the C kernel's index keys (index_kernel.c's TILE)
GROUP = 32  # query rows the C kernel scores together (index_kernel.c's GROUP)
PRECISIONS = ("float32", "int8")  # what a lightning indexer's choice may score in (``int8_scores``)


def softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in place (one buffer of a block's scores, where masking and
    ``torch.softmax`` make three); a row without a finite score becomes zeros."""
    top = scores.amax(-1, keepdim=True)
    scores.sub_(top.masked_fill_(top == float("-inf"), 0.0)).exp_()
    return scores.div_(scores.sum(-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).tiny))


def query_blocks(edges: EdgeSet, rows: int):
    """(query offset, key offset, keys seen, first row, last row + 1) per block of ``rows`` query rows
    of each sample, for complete or causal candidates (``edges.root.structure``): a causal block's
    rows see no key after its last row, so only those before are scored."""
    root = edges.root
    causal = root.structure == "causal"
    q_lens = list(root.q_lens) if root.q_lens is not None else [root.n_dst]
    k_lens = list(root.k_lens) if root.k_lens is not None else [root.n_src]
    q_off = k_off = 0
    for nq, nk in zip(q_lens, k_lens):
        for r0 in range(0, nq, rows):
            r1 = min(r0 + rows, nq)
            yield q_off, k_off, min(nk, r1) if causal else nk, r0, r1
        q_off, k_off = q_off + nq, k_off + nk


def top_scored(
    edges: EdgeSet, count: int, score, rows: int, lead: tuple[int, ...] = (), later_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the ``count`` keys with the best ``score(query rows, key slice)`` -> (rows, *lead,
    keys seen), for complete or causal candidates (``edges.structure``), scored sample by sample in
    blocks of query rows (``query_blocks``): the scores of one block exist at a time, never an edge
    list. Returns key ids and valid, (n_dst, *lead, count); invalid slots hold key 0. ``later_first``:
    equal scores rank the later key first (a sort, slower than ``topk``'s unspecified order)."""
    causal = edges.root.structure == "causal"
    keys = torch.zeros(edges.n_dst, *lead, count, dtype=torch.long, device=edges.device)
    valid = torch.zeros(edges.n_dst, *lead, count, dtype=torch.bool, device=edges.device)
    for q_off, k_off, nk, r0, r1 in query_blocks(edges, rows):
        block = slice(q_off + r0, q_off + r1)
        s = score(block, slice(k_off, k_off + nk))
        if causal:
            s = s.masked_fill(later_keys(r0, r1, nk, s.device).view(r1 - r0, *(1,) * len(lead), nk), float("-inf"))
        values, indices = top_later_first(s, count) if later_first else s.topk(min(count, nk), dim=-1)
        width = indices.shape[-1]
        keys[block, ..., :width] = indices + k_off
        valid[block, ..., :width] = values > float("-inf")
    return keys.masked_fill(~valid, 0), valid


def top_later_first(
    score: torch.Tensor, count: int, every_row: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``score.topk(count)`` over the last dimension, equal scores ranking the later index first:
    the same choice on every device (``topk`` breaks ties differently on the CPU and on CUDA, and
    ties are common: blocks no compressed key has scored yet, index scores that ReLU made 0).
    ``topk`` picks the set wherever no tie reaches its last place; rows where one does, and the
    order within each set, are decided by ``_ordered`` keys (a stable sort of every row cost NSA's
    step half a second at 16k tokens). ``every_row`` (default: off the CPU) decides every row by the
    keys and keeps them where a tie reaches the last place: no rows picked out by a mask, whose
    indexing reads the mask back (a sync on a GPU, where bfloat16 scores tie often)."""
    count = min(count, score.shape[-1])
    if count == 0:
        return score[..., :0], torch.zeros(score.shape[:-1] + (0,), dtype=torch.long, device=score.device)
    flat = score.reshape(-1, score.shape[-1])
    values, indices = flat.topk(count, dim=-1)
    tied = (flat >= values[:, -1:]).sum(-1) > count  # more candidates share the last place than it has
    if every_row is None:
        every_row = flat.device.type != "cpu"
    if every_row:
        indices = torch.where(tied[:, None], _later_first(flat, count), indices)
    elif bool(tied.any()):
        indices[tied] = _later_first(flat[tied], count)
    indices = indices.gather(-1, _ordered(flat.gather(-1, indices), indices).argsort(-1, descending=True))
    shape = (*score.shape[:-1], count)
    return flat.gather(-1, indices).view(shape), indices.view(shape)


def _later_first(rows: torch.Tensor, count: int) -> torch.Tensor:
    """Each row's ``count`` best positions by (score, position), in no particular order."""
    whole = torch.arange(rows.shape[-1], device=rows.device).expand_as(rows)
    return _ordered(rows, whole).topk(count, dim=-1).values & 0xFFFFFFFF


def _ordered(score: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """int64 keys that order as (score, position) does: the float32 bits made monotone in the high
    half (a negative float's magnitude bits flipped; -0 as +0, as the comparison sees it), the
    position in the low half."""
    bits = (score.float() + 0.0).view(torch.int32).long()
    return ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32) | position


def later_keys(r0: int, r1: int, nk: int, device) -> torch.Tensor:
    """(r1 - r0, nk): True where key position > query position, for query rows r0..r1 of a causal sample."""
    return torch.arange(nk, device=device)[None, :] > torch.arange(r0, r1, device=device)[:, None]


def top_keys(q: torch.Tensor, k: torch.Tensor, edges: EdgeSet, count: int, rows: int = 512):
    """The ``count`` best keys by q.k per query and head: key ids and valid, (n_dst, H, count), equal
    scores preferring the later key on the C kernel (unspecified in torch ops)."""
    if native.kernel("index_kernel", q, k) is None:

        def score(block, keys):  # (rows, H, keys seen)
            return (q[block].transpose(0, 1) @ k[keys].permute(1, 2, 0)).transpose(0, 1)

        return top_scored(edges, count, score, rows, lead=(q.shape[1],))
    ones = q.new_ones(q.shape[0], 1)
    heads = [top_native(q[:, h, None], ones, k[:, h], edges, count, relu=False) for h in range(q.shape[1])]
    return torch.stack([keys for keys, _ in heads], 1), torch.stack([valid for _, valid in heads], 1)


def top_native(
    iq, w, ik, edges: EdgeSet, count: int, relu: bool = True, int8: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the C kernel: per query t, the ``count`` candidate keys s with the best
    sum_j w(t, j) f(iq(t, j) . ik(s)), f = relu (a lightning indexer) or the identity; iq (n, J, d),
    w (n, J), ik (N, d), float32 on the CPU; ``int8``: scored as ``int8_scores`` defines, on int8
    dot products (VNNI where the CPU has it). Equal scores prefer the later key. Key ids (n, count),
    int32 (the kernels' ids: half the memory of int64), and valid (n, count); invalid slots hold 0."""
    lib = native.load("index_kernel")
    keys = torch.zeros(edges.n_dst, count, dtype=torch.int32)
    valid = torch.zeros(edges.n_dst, count, dtype=torch.bool)
    causal = int(edges.root.structure == "causal")
    scales = None
    if int8:
        width = -(-iq.shape[-1] // 4) * 4  # the kernel's dot products take 4 bytes at a time
        (iq, q_scale), (ik, scales) = quantised(iq, width), quantised(ik, width)
        w = w * q_scale
    iq, w = iq.contiguous(), w.contiguous()
    q_off = k_off = 0
    for nq, nk in zip(*edges.sample_lens()):
        sample = slice(k_off, k_off + nk)
        _top_sample(
            lib,
            iq[q_off:],
            w[q_off:],
            tiles(ik[sample]) if scales is None else int8_tiles(ik[sample]),
            None if scales is None else torch.nn.functional.pad(scales[sample], (0, -nk % TILE)),
            keys[q_off:],
            valid[q_off:],
            nq,
            nk,
            causal,
            k_off,
            relu,
        )
        q_off, k_off = q_off + nq, k_off + nk
    return keys, valid


def quantised(x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d) -> (q, scale): int8 q (..., width) (zero-padded from d) and float32 scales (...), per
    row symmetric, x = scale * q up to rounding, |q| <= 127 (scale = max |x| / 127; 0 for a zero row)."""
    top = x.detach().float().abs().amax(-1, keepdim=True)
    q = torch.round(x.detach().float() / top.clamp_min(torch.finfo(torch.float32).tiny) * 127).to(torch.int8)
    return torch.nn.functional.pad(q, (0, (width or x.shape[-1]) - x.shape[-1])), (top / 127).squeeze(-1)


def int8_scores(iq, w, ik, relu: bool = True) -> torch.Tensor:
    """The scores the int8 choice ranks by, iq (r, J, d), w (r, J), ik (S, d) -> (r, S):
    I8(t, s) = sk(s) sum_j w(t, j) sq(t, j) f(q8(t, j) . k8(s)), q8, k8 and their scales sq, sk from
    ``quantised`` (per token and head; per key), f = relu or the identity. The integer dot products are
    exact in float32 (|.| <= 127^2 d < 2^24 for d < 1040), so this equals the kernel's up to the rounding
    of the weighted sum."""
    (q8, sq), (k8, sk) = quantised(iq), quantised(ik)
    dots = torch.einsum("rjd,sd->rjs", q8.float(), k8.float())
    dots = dots.relu_() if relu else dots
    return torch.bmm((w * sq).unsqueeze(1), dots).squeeze(1) * sk


def tiles(ik: torch.Tensor) -> torch.Tensor:
    """(nk, d) index keys -> (ceil(nk / TILE), d, TILE), zero-padded: a tile of keys the kernel reads
    as d contiguous rows (a (d, nk) layout would put rows a power of two apart, into one cache set)."""
    padded = torch.nn.functional.pad(ik, (0, 0, 0, -len(ik) % TILE))
    return padded.view(-1, TILE, ik.shape[1]).transpose(1, 2).contiguous()


def int8_tiles(k8: torch.Tensor) -> torch.Tensor:
    """(nk, dp) int8 keys (dp a multiple of 4) -> (ceil(nk / TILE), dp / 4, TILE, 4) bytes k8 + 128,
    zero keys padded: each key's 4 dimensions at a time side by side, as VNNI's dot products read them."""
    padded = torch.nn.functional.pad(k8, (0, 0, 0, -len(k8) % TILE)).to(torch.int16).add_(128).to(torch.uint8)
    return padded.view(-1, TILE, k8.shape[1] // 4, 4).transpose(1, 2).contiguous()


def _top_sample(
    lib, iq, w, ik_tiles, k_scale, keys, valid, nq: int, nk: int, causal: int, offset: int, relu: bool
) -> None:
    """One sample's rows (views from its first query and key): keys, valid written, the kernel's groups
    of GROUP rows dealt to the kernel's parts in turn (later causal rows cost more); int8 where
    ``k_scale`` (the keys' scales) is given."""
    heads, dim = iq.shape[1:]
    ptrs = [native.pointer(x) for x in (iq, w, ik_tiles)], [native.pointer(x) for x in (keys, valid)]
    call, scale = (lib.gtx_top_index, []) if k_scale is None else (lib.gtx_top_index_i8, [native.pointer(k_scale)])
    native.check(
        call(
            *native.ints(native.parts(-(-nq // GROUP)), nq, nk, heads, dim),
            *ptrs[0],
            *scale,
            *native.ints(causal, int(relu), keys.shape[1], offset),
            *ptrs[1],
        )
    )
