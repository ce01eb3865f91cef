"""flash: edge sets that plain attention computes, run by SDPA's fastest kernels.

Two structures are recognised, per sample of a batch (``EdgeSet.q_lens``/``k_lens``; a set
without them is one sample): every sample *complete* (each query attends to every key of its
sample, any q_len and k_len) or every sample *causal* (q_len == k_len and query i attends to keys
0..i of its sample). Such a set runs as SDPA unmasked or with ``is_causal=True`` (top-left
aligned, which is what q_len == k_len needs) on (B, H, n, D) tensors: samples of one shape as one
batched call on views of q, k, v; samples of unequal lengths padded into a few buckets of similar
lengths, one call each (a causal bucket needs no mask; a complete one masks its padded keys).
On the CPU in float32, unequal samples of up to a few hundred keys per query (``SHORT``) run instead
on a C kernel over the packed rows (``gtx.backends.packed``): no padding, no gathers, one call (a
copy task's short samples; SDPA's kernels win once each query reads more keys). Exact: the
same function as ``dense``, forward and backward. ``dense`` and ``auto`` use it whenever it applies.

An ACT subset (``EdgeSet.filter_dst``) runs its full set's plan and zeroes the dropped queries:
a kept query keeps all its edges, so its output is the full set's; a dropped query's zeroed output
sends no gradient anywhere.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from gtx.backends import packed, repeat_kv
from gtx.graph.tokens import EdgeSet

COMPLETE, CAUSAL = "complete", "causal"


# Bucketing unequal samples: one SDPA call (forward + backward, with its index selects) costs about
# as much as CALL_WORK units of work (query-key pairs * heads * head dim), and a pair under a key
# mask MASK_COST unmasked ones, so padding samples into fewer calls pays while it adds less work
# than the calls it saves. CPU: measured (about 0.2 ms a call, 16k pairs at 4 heads x 32 dims);
# CUDA: estimated from launch overheads against the kernels' throughput.
CALL_WORK = {"cpu": 2**21, "cuda": 2**30}
MASK_COST = 1.5
# Unequal samples whose queries read at most this many keys on average run on the packed kernel
# (CPU, float32): up to here ``bench/packed.py`` measures it faster than SDPA's padded calls, forward
# and backward, at 4 x 32 and 1 x 128 heads; complete samples of 1 x 128 break even near 250 keys,
# 4 x 32 near 400 (docs/results.md, short samples).
SHORT = 200


@dataclass
class Bucket:
    """``count`` samples padded to ``n_q`` queries and ``n_k`` keys each, run as one SDPA call.
    ``q_idx`` (count*n_q,) and ``k_idx`` (count*n_k,) are the node ids of its rows (a padding row
    repeats a real one of its sample), or None when the rows are all the nodes in order; ``mask``
    (count, 1, 1, n_k) marks real keys, None when no key is padding or padded keys cannot be seen."""

    count: int
    n_q: int
    n_k: int
    q_idx: torch.Tensor | None
    k_idx: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class FlashPlan:
    """How a recognised edge set runs: its buckets, and ``order`` (n_dst,), the row of every query
    in the buckets' concatenated outputs, or None when that is the identity."""

    causal: bool
    buckets: list[Bucket]
    order: torch.Tensor | None
    ranges: packed.Ranges | None = None  # the samples on the packed kernel instead (``attend_ranges``)


def flash_structure(edges: EdgeSet) -> str | None:
    """The edge set's structure, ``COMPLETE``, ``CAUSAL`` or None (cached with the edges). An ACT
    subset is never either: it runs through its full set's structure (``flash_attention``)."""
    return edges.plan("flash-structure", lambda: _structure(edges))


def _structure(edges: EdgeSet) -> str | None:
    """``flash_structure``, uncached: an O(samples) count, then one O(edges) check when it fits."""
    if edges.parent is not None:
        return None
    if edges.structure is not None:  # known from the pattern (``batch_edges``): no edge to read
        return edges.structure
    q_lens, k_lens = edges.sample_lens()
    if edges.n_dst == 0 or any(nq and not nk for nq, nk in zip(q_lens, k_lens)):
        return None  # queries without keys: no softmax to run (dense zeroes them)
    # Counting first rules out almost every other set at no cost; the per-edge check then makes
    # the count sufficient: unique in-sample edges (below the diagonal for causal) that number
    # q_len*k_len (n(n+1)/2) per sample in total are all of them.
    if edges.num_edges == sum(nq * nk for nq, nk in zip(q_lens, k_lens)):
        structure = COMPLETE
    elif q_lens == k_lens and edges.num_edges == sum(n * (n + 1) // 2 for n in q_lens):
        structure = CAUSAL
    else:
        return None
    return structure if _edges_within_samples(edges, q_lens, k_lens, structure == CAUSAL) else None


def _edges_within_samples(edges: EdgeSet, q_lens, k_lens, causal: bool) -> bool:
    """Edges strictly sorted by (dst, src) (hence unique), each key in its query's sample, and with
    ``causal`` no key after its query (positions within the sample)."""
    src, dst = edges.src, edges.dst
    key = dst * edges.n_src + src
    if len(key) > 1 and not bool((key[1:] > key[:-1]).all()):
        return False
    if len(q_lens) == 1:  # ids are in range by EdgeSet's contract
        return not causal or bool((src <= dst).all())
    device = dst.device
    ql, kl = torch.tensor(q_lens, device=device), torch.tensor(k_lens, device=device)
    sample = torch.repeat_interleave(torch.arange(len(ql), device=device), ql)[dst]
    q_pos = dst - (torch.cumsum(ql, 0) - ql)[sample]
    k_pos = src - (torch.cumsum(kl, 0) - kl)[sample]
    ok = (k_pos >= 0) & (k_pos < kl[sample])
    if causal:
        ok &= k_pos <= q_pos
    return bool(ok.all())


def make_plan(edges: EdgeSet, structure: str, head_dims: int, served: bool = False) -> FlashPlan:
    """Samples of one shape run as views of q, k, v; others are padded into buckets (``buckets``)
    sized for inputs of ``head_dims`` = heads * head dim, or where ``served`` (the packed kernel
    serves the inputs) and at most ``SHORT`` keys per query on average, run packed. Plans are shared
    by every edge set of the same sample lengths, structure and device (``_plan``): a batch's stages
    over the same samples (a copy task's ``ee`` and ``ed``) plan once, and so does a batch whose
    lengths recur."""
    q_lens, k_lens = edges.sample_lens()
    call_pairs = CALL_WORK["cpu" if edges.device.type == "cpu" else "cuda"] / head_dims
    return _plan(q_lens, k_lens, structure == CAUSAL, call_pairs, edges.device, SHORT if served else 0)


@lru_cache(maxsize=16)  # a plan is a few index tensors of the batch's size: a handful per step is plenty
def _plan(q_lens: tuple, k_lens: tuple, causal: bool, call_pairs: float, device: torch.device, short: int) -> FlashPlan:
    """``make_plan`` for samples of ``q_lens`` queries and ``k_lens`` keys; ``call_pairs``: what one
    more call costs, in query-key pairs; ``short``: the most keys per query on average that run packed
    (0: none). Read-only: callers share it."""
    if len(set(zip(q_lens, k_lens))) == 1:
        return FlashPlan(causal, [Bucket(len(q_lens), q_lens[0], k_lens[0], None, None, None)], None)
    pairs = sum(n * (n + 1) // 2 if causal else n * m for n, m in zip(q_lens, k_lens))
    if pairs <= short * sum(q_lens):
        return FlashPlan(causal, [], None, packed.plain_ranges(q_lens, k_lens, causal))
    # Padding a causal sample at its end needs no mask: its queries never see later keys. A complete
    # sample's padded queries are dropped, its padded keys must be masked.
    samples = sorted((i for i in range(len(q_lens)) if q_lens[i]), key=lambda i: (k_lens[i], q_lens[i]))
    q_off = torch.cumsum(torch.tensor((0, *q_lens)), 0).tolist()
    k_off = torch.cumsum(torch.tensor((0, *k_lens)), 0).tolist()
    runs = buckets([(q_lens[i], k_lens[i]) for i in samples], causal, call_pairs)
    plan, rows, start = [], 0, 0
    order = torch.empty(sum(q_lens), dtype=torch.long)
    for end in runs:
        members = samples[start:end]
        n_q, n_k = max(q_lens[i] for i in members), max(k_lens[i] for i in members)
        q_idx, q_real = _padded_ids([q_off[i] for i in members], [q_lens[i] for i in members], n_q)
        k_idx, k_real = _padded_ids([k_off[i] for i in members], [k_lens[i] for i in members], n_k)
        order[q_idx[q_real]] = torch.nonzero(q_real).squeeze(1) + rows
        mask = None if causal or bool(k_real.all()) else k_real.view(len(members), 1, 1, n_k).to(device)
        plan.append(Bucket(len(members), n_q, n_k, q_idx.to(device), k_idx.to(device), mask))
        rows, start = rows + len(members) * n_q, end
    return FlashPlan(causal, plan, order.to(device))


def _padded_ids(offsets: list[int], lens: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node ids of samples padded to ``width`` rows (padding repeats a sample's last node), flat,
    and which of them are real."""
    pos = torch.arange(width)
    lens_t = torch.tensor(lens)[:, None]
    ids = torch.tensor(offsets)[:, None] + torch.minimum(pos[None], lens_t - 1)
    return ids.flatten(), (pos[None] < lens_t).flatten()


def buckets(shapes: list[tuple[int, int]], causal: bool, call_pairs: float) -> list[int]:
    """Split sorted (n_q, n_k) sample shapes into consecutive runs, each padded to its largest
    shape and run as one call, minimising calls * ``call_pairs`` + padded query-key pairs (a
    masked run's pairs cost ``MASK_COST`` each); returns the end of every run. O(len(shapes)^2)
    over distinct shapes."""
    count_of = Counter(shapes)
    distinct = sorted(count_of, key=lambda s: (s[1], s[0]))
    counts = [count_of[s] for s in distinct]
    ends = [sum(counts[: j + 1]) for j in range(len(distinct))]
    best, cut = [0.0] + [float("inf")] * len(distinct), [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        n_q = n_k = count = 0
        k_equal = True
        for i in range(j - 1, -1, -1):  # the run distinct[i:j]
            q, k = distinct[i]
            k_equal &= n_k in (0, k)
            n_q, n_k, count = max(n_q, q), max(n_k, k), count + counts[i]
            pairs = count * (n_q * (n_q + 1) // 2 if causal else n_q * n_k)
            cost = best[i] + call_pairs + pairs * (1.0 if causal or k_equal else MASK_COST)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(distinct)
    while j:
        runs.append(ends[j - 1])
        j = cut[j]
    return runs[::-1]


def _run_bucket(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Bucket, causal: bool, lse: bool = False):
    """(count*n_q, H, Dv): the bucket as one (count, H, n, D) SDPA call. Four dimensions matter:
    SDPA's CPU flash kernel takes only 4-D inputs (3-D ones fall back to the math kernel). k and v
    may hold fewer heads than q (grouped-query attention: SDPA's ``enable_gqa``, as transformers
    calls it, no copy). With ``lse``, also each query's log-sum-exp of its scores per head,
    (count*n_q, H), from the CPU flash kernel itself (the one SDPA runs there, called directly: SDPA
    returns no log-sum-exp); elsewhere None."""
    if b.q_idx is not None:  # index_select: its backward is index_add
        q, k, v = q.index_select(0, b.q_idx), k.index_select(0, b.k_idx), v.index_select(0, b.k_idx)
    sums = None
    if lse and q.device.type == "cpu":
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # the kernel called directly has no groups
    q4 = q.view(b.count, b.n_q, *q.shape[1:]).transpose(1, 2)
    k4 = k.view(b.count, b.n_k, *k.shape[1:]).transpose(1, 2)
    v4 = v.view(b.count, b.n_k, *v.shape[1:]).transpose(1, 2)
    if lse and q.device.type == "cpu":
        mask = None if b.mask is None else torch.zeros(b.mask.shape, dtype=q.dtype).masked_fill_(~b.mask, -torch.inf)
        out, sums = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=mask, scale=1.0
        )
        sums = sums.transpose(1, 2).reshape(b.count * b.n_q, q.shape[1])
    else:  # (count, H, n_q, Dv)
        grouped = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=b.mask, is_causal=causal, scale=1.0, **grouped)
    out = out.transpose(1, 2).reshape(b.count * b.n_q, q.shape[1], v.shape[-1])
    return (out, sums) if lse else out


def flash_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, structure: str) -> FlashPlan:
    """The plan ``flash_attention`` runs ``edges`` (or the full set of an ACT subset) by for inputs like
    q, k, v: SDPA's calls, or the packed kernel's ranges; made once per edge set."""
    root = edges.root
    head_dims = q.shape[1] * q.shape[2]
    served = packed.available(q, k, v)
    return root.plan(
        ("flash", structure, q.device, head_dims, served), lambda: make_plan(root, structure, head_dims, served)
    )


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, structure: str, lse: bool = False
):
    """The backend contract (q (n_dst, H, D) scaled, k (n_src, H, D), v (n_src, H, Dv) ->
    (n_dst, H, Dv)) for an edge set whose ``flash_structure`` is ``structure``, or an ACT subset
    of one (then ``structure`` is its full set's); k and v may hold fewer heads than q (grouped-query
    attention, ``repeat_kv``'s order). ``lse`` (a full set only): (out, each query's
    log-sum-exp of its scores per head, (n_dst, H), no gradient; None off the CPU)."""
    plan = flash_plan(q, k, v, edges, structure)
    if lse and edges.parent is not None:
        raise ValueError("flash_attention: lse=True takes a full edge set, not an ACT subset")
    if plan.ranges is not None:
        out, sums = packed.attend_ranges(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), plan.ranges)
    else:
        runs = [_run_bucket(q, k, v, b, plan.causal, lse) for b in plan.buckets]
        outs, sums = zip(*runs) if lse else (runs, [None])
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        sums = None if sums[0] is None else sums[0] if len(sums) == 1 else torch.cat(sums)
    if plan.order is not None:
        out = out.index_select(0, plan.order)
        sums = None if sums is None else sums.index_select(0, plan.order)
    if edges.parent is not None:  # dropped queries have no edges: zeros, and no gradient through them
        out = out * edges.keep[:, None, None].to(out.dtype)
    return (out, sums) if lse else out
