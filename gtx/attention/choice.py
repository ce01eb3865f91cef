"""Per query, the best keys by a score, never an n x n matrix: for complete or causal candidates,
scored in blocks of query rows (torch ops), or on the CPU in float32 on the C kernel
``index_kernel.c`` (scores in tiles of keys, a candidate buffer per row with quickselect). Serves
``topk`` (q.k per head) and DSA's lightning indexer (``gtx.attention.indexer``).
"""

from __future__ import annotations

import torch

from gtx.attention import native
from gtx.graph.tokens import EdgeSet

TILE = 128  # keys per tile of the C kernel's index keys (index_kernel.c's TILE)
GROUP = 32  # query rows the C kernel scores together (index_kernel.c's GROUP)


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


def top_later_first(score: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``score.topk(count)`` over the last dimension, equal scores ranking the later index first:
    the same choice on every device (``topk`` breaks ties differently on the CPU and on CUDA, and
    ties are common: blocks no compressed key has scored yet, index scores that ReLU made 0)."""
    values, order = score.flip(-1).sort(dim=-1, descending=True, stable=True)  # a stable sort of the reversed scores
    count = min(count, score.shape[-1])
    return values[..., :count], score.shape[-1] - 1 - order[..., :count]


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


def top_native(iq, w, ik, edges: EdgeSet, count: int, relu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """On the C kernel: per query t, the ``count`` candidate keys s with the best
    sum_j w(t, j) f(iq(t, j) . ik(s)), f = relu (a lightning indexer) or the identity; iq (n, J, d),
    w (n, J), ik (N, d), float32 on the CPU. Equal scores prefer the later key. Key ids (n, count),
    int32 (the kernels' ids: half the memory of int64), and valid (n, count); invalid slots hold 0."""
    lib = native.load("index_kernel")
    keys = torch.zeros(edges.n_dst, count, dtype=torch.int32)
    valid = torch.zeros(edges.n_dst, count, dtype=torch.bool)
    causal = int(edges.root.structure == "causal")
    iq, w = iq.contiguous(), w.contiguous()
    q_off = k_off = 0
    for nq, nk in zip(*edges.sample_lens()):
        _top_sample(
            lib,
            iq[q_off:],
            w[q_off:],
            tiles(ik[k_off : k_off + nk]),
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


def tiles(ik: torch.Tensor) -> torch.Tensor:
    """(nk, d) index keys -> (ceil(nk / TILE), d, TILE), zero-padded: a tile of keys the kernel reads
    as d contiguous rows (a (d, nk) layout would put rows a power of two apart, into one cache set)."""
    padded = torch.nn.functional.pad(ik, (0, 0, 0, -len(ik) % TILE))
    return padded.view(-1, TILE, ik.shape[1]).transpose(1, 2).contiguous()


def _top_sample(lib, iq, w, ik_tiles, keys, valid, nq: int, nk: int, causal: int, offset: int, relu: bool) -> None:
    """One sample's rows (views from its first query and key): keys, valid written, the kernel's groups
    of GROUP rows dealt to the kernel's parts in turn (later causal rows cost more)."""
    heads, dim = iq.shape[1:]
    ptrs = [native.pointer(x) for x in (iq, w, ik_tiles)], [native.pointer(x) for x in (keys, valid)]
    native.check(
        lib.gtx_top_index(
            *native.ints(native.parts(-(-nq // GROUP)), nq, nk, heads, dim),
            *ptrs[0],
            *native.ints(causal, int(relu), keys.shape[1], offset),
            *ptrs[1],
        )
    )
