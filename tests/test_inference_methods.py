"""The field's training-free sparse attention methods, each against its definition written out here in
plain torch from its reference code (not copied): StreamingLLM's cache (``sinks``), MInference's
vertical-slash choice (``vslash``), the Sparse Frontier's block-sparse prefill (``blocktopk``) and
Quest's page choice (``quest``). Each: the choice equals the definition on random inputs, the
attention (values and gradients) equals float64 dense attention over the definition's keys, and a tiny
run trains and evaluates with it, on the selection kernels rather than a mask over edges."""

import json
import os
import re

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx import BlockSelection, KeySelection, TokenBlockSelection, build_graph, parse_pattern, selection
from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.errors import GtxError
from gtx.records.results import load
from gtx.testing.float32 import float64_reference

INF = float("inf")
SAMPLES = st.lists(st.integers(1, 48), min_size=1, max_size=3)


def random_qkv(lens, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(lens), heads, dim, generator=g) for _ in range(3)]


def samples(lens):
    """(first row, length) of each sample of rows concatenated."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return list(zip(starts, lens))


def as_mask(keys, lens, heads):
    """Per query row and head a set of key positions within its sample -> allowed (n, H, n) bool."""
    n = sum(lens)
    allowed = torch.zeros(n, heads, n, dtype=torch.bool)
    for start, m in samples(lens):
        for t in range(m):
            for h in range(heads):
                allowed[start + t, h, [start + j for j in keys[start + t][h]]] = True
    return allowed


def dense_over(q, k, v, allowed):
    """Softmax attention of q (n, H, D), pre-scaled, over the allowed (n, H, N) keys, in float64."""
    score = torch.einsum("thd,shd->ths", q.double(), k.double()).masked_fill(~allowed, -INF)
    return torch.einsum("ths,shd->thd", score.softmax(-1), v.double())


def gtx_attention(spec, q, k, v, lens):
    pattern = parse_pattern(spec)
    edges = build_graph(pattern, None, lens).edges["dd"]
    return Attention(get_backend("dense"), pattern, q.shape[1])(q, k, v, edges)


def chosen(spec, q, k, lens):
    pattern = parse_pattern(spec)
    return pattern.select(q, k, build_graph(pattern, None, lens).edges["dd"])


def values_and_grads(f):
    """(q, k, v, weights) -> f(q, k, v) and the gradients of q, k and v under an uneven loss (weights)."""

    def run(q, k, v, weights):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = f(*xs)
        return out, *torch.autograd.grad((out * weights).sum(), xs)

    return run


def assert_attends_over(spec, keys, q, k, v, lens):
    """gtx's output under ``spec`` and its q, k, v gradients hold dense attention over ``keys`` (per
    query row and head, positions within its sample) in float64, within what float32 holds on these
    inputs (``gtx.testing.float32``)."""
    allowed = as_mask(keys, lens, q.shape[1])
    weights = torch.linspace(-1, 1, v.numel()).view_as(v)
    want = float64_reference(values_and_grads(lambda *x: dense_over(*x, allowed)), q, k, v, weights)
    want.check(values_and_grads(lambda *x: gtx_attention(spec, *x, lens))(q, k, v, weights), spec)


# --- sinks: StreamingLLM -------------------------------------------------------------------------


def streaming_cache(n, s, w):
    """The positions StreamingLLM's cache holds as it decodes each of n positions: the new key joins;
    past s + w keys, the oldest after the first s leaves (``StartRecentKVCache.evict_for_space``)."""
    cache, held = [], []
    for t in range(n):
        cache.append(t)
        if len(cache) > s + w:
            del cache[s]
        held.append(list(cache))
    return held


@settings(max_examples=30, deadline=None)
@given(lens=SAMPLES, s=st.integers(0, 5), w=st.integers(1, 9), seed=st.integers(0, 50))
def test_sinks_equal_streaming_llm_decoding_step_by_step(lens, s, w, seed):
    spec = f"sinks:s={s},w={w}"
    edges = build_graph(parse_pattern(spec), None, lens).edges["dd"]
    keys = []
    for start, n in samples(lens):
        held = streaming_cache(n, s, w)
        for t in range(n):
            assert sorted(edges.src[edges.dst == start + t].tolist()) == [start + j for j in held[t]]
            keys.append([held[t]] * 2)
    q, k, v = random_qkv(lens, seed=seed)
    assert_attends_over(spec, keys, q, k, v, lens)


# --- vslash: MInference's vertical-slash ----------------------------------------------------------


def vslash_by_definition(q, k, lens, v, sl, last, sink, local):
    """Per query row and head, the keys vertical-slash reads: per sample and head, each of the last
    ``last`` queries' softmax over the keys at or before it (float32, as gtx chooses), summed per key
    (columns) and per distance (diagonals); the first ``sink`` columns and ``local`` diagonals forced;
    the v best columns, the sl best diagonals; query t reads the columns <= t and the keys t - d."""
    keys = []
    for start, n in samples(lens):
        rows = [[None] * q.shape[1] for _ in range(n)]
        for h in range(q.shape[1]):
            column, diagonal = torch.zeros(n), torch.zeros(n)
            for i in range(n - min(last, n), n):
                p = (k[start : start + i + 1, h] @ q[start + i, h]).softmax(0)
                column[: i + 1] += p
                diagonal[: i + 1] += p.flip(0)  # key j lies at distance i - j
            column[:sink], diagonal[:local] = INF, INF
            columns = column.topk(min(v, n)).indices.tolist()
            distances = diagonal.topk(min(sl, n)).indices.tolist()
            for t in range(n):
                rows[t][h] = {c for c in columns if c <= t} | {t - d for d in distances if d <= t}
        keys += rows
    return keys


VSLASH = (
    st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 20))
    .flatmap(lambda a: st.tuples(st.just(a), st.integers(0, a[0]), st.integers(0, a[1])))
    .filter(lambda a: a[1] + a[2] >= 1)  # a sink column or the own diagonal: no query reads nothing
)


@settings(max_examples=30, deadline=None)
@given(lens=SAMPLES, params=VSLASH, seed=st.integers(0, 50))
def test_vslash_chooses_as_its_definition(lens, params, seed):
    (v, sl, last), sink, local = params
    q, k, _ = random_qkv(lens, seed=seed)
    sel = chosen(f"vslash:v={v},sl={sl},last={last},sink={sink},local={local}", q, k, lens)
    assert isinstance(sel, KeySelection)
    want = vslash_by_definition(q, k, lens, v, sl, last, sink, local)
    position = {start + t: start for start, n in samples(lens) for t in range(n)}
    for row in range(len(q)):
        for h in range(q.shape[1]):
            got = (sel.keys[row, h][sel.valid[row, h]] - position[row]).tolist()
            assert len(got) == len(set(got)), "a key read twice"  # deduplicated: each read once
            assert set(got) == want[row][h], (row, h)


@settings(max_examples=15, deadline=None)
@given(lens=SAMPLES, params=VSLASH, seed=st.integers(0, 50))
def test_vslash_attends_over_exactly_its_keys(lens, params, seed):
    (v, sl, last), sink, local = params
    q, k, v_ = random_qkv(lens, seed=seed)
    keys = vslash_by_definition(q, k, lens, v, sl, last, sink, local)
    assert_attends_over(f"vslash:v={v},sl={sl},last={last},sink={sink},local={local}", keys, q, k, v_, lens)


# --- blocktopk: the Sparse Frontier's block-sparse prefill ---------------------------------------


def blocktopk_by_definition(q, k, lens, b, top):
    """Per sample, head and query block, the key blocks read: blocks of b rows; each block's mean query
    and mean key (its real rows); block j <= i scores mean_q(i) . mean_k(j), the own block, block
    i - 1 and block 0 +inf; the ``top`` best (all where fewer)."""
    chosen = []
    for start, n in samples(lens):
        blocks = range(-(-n // b))
        qm = torch.stack([q[start + i * b : start + min(n, (i + 1) * b)].mean(0) for i in blocks])  # (blocks, H, D)
        km = torch.stack([k[start + i * b : start + min(n, (i + 1) * b)].mean(0) for i in blocks])
        sample = []
        for h in range(q.shape[1]):
            per_block = []
            for i in blocks:
                score = km[: i + 1, h] @ qm[i, h]
                score[[0, max(i - 1, 0), i]] = INF
                per_block.append(set(score.topk(min(top, i + 1)).indices.tolist()))
            sample.append(per_block)
        chosen.append(sample)
    return chosen


def blocks_to_keys(chosen, lens, b, heads):
    """Per query row and head, the positions of its chosen blocks at or before it."""
    keys = []
    for n, sample in zip(lens, chosen):
        for t in range(n):
            keys.append(
                [
                    {j for c in sample[h][t // b] for j in range(c * b, min(n, (c + 1) * b)) if j <= t}
                    for h in range(heads)
                ]
            )
    return keys


@settings(max_examples=30, deadline=None)
@given(lens=SAMPLES, b=st.integers(1, 8), top=st.integers(3, 6), seed=st.integers(0, 50))
def test_blocktopk_chooses_as_its_definition(lens, b, top, seed):
    q, k, _ = random_qkv(lens, seed=seed)
    sel = chosen(f"blocktopk:b={b},k={top}", q, k, lens)
    assert isinstance(sel, BlockSelection)
    want = blocktopk_by_definition(q, k, lens, b, top)
    for i, sample in enumerate(want):
        for h, per_block in enumerate(sample):
            for block, blocks in enumerate(per_block):
                assert set(sel.key_blocks[i, h, block][sel.valid[i, h, block]].tolist()) == blocks, (i, h, block)


@settings(max_examples=15, deadline=None)
@given(lens=SAMPLES, b=st.integers(1, 8), top=st.integers(3, 6), seed=st.integers(0, 50))
def test_blocktopk_attends_over_exactly_its_blocks(lens, b, top, seed):
    q, k, v = random_qkv(lens, seed=seed)
    keys = blocks_to_keys(blocktopk_by_definition(q, k, lens, b, top), lens, b, q.shape[1])
    assert_attends_over(f"blocktopk:b={b},k={top}", keys, q, k, v, lens)


# --- quest: Quest's pages --------------------------------------------------------------------------


def quest_by_definition(q, k, lens, p, top):
    """Per query row and head, the pages read besides its own: each earlier page (all p keys before the
    query's page) scored sum_d max(q_d min_d, q_d max_d), min and max per dimension over its keys; the
    ``top`` best (all where fewer)."""
    pages = []
    for start, n in samples(lens):
        for t in range(n):
            row = []
            for h in range(q.shape[1]):
                bounds = []
                for page in range(t // p):
                    keys = k[start + page * p : start + (page + 1) * p, h]
                    query = q[start + t, h]
                    bounds.append(torch.maximum(query * keys.amin(0), query * keys.amax(0)).sum())
                row.append(set(torch.stack(bounds).topk(min(top, len(bounds))).indices.tolist()) if bounds else set())
            pages.append(row)
    return pages


@settings(max_examples=30, deadline=None)
@given(lens=SAMPLES, p=st.integers(1, 8), top=st.integers(1, 4), seed=st.integers(0, 50))
def test_quest_chooses_as_its_definition(lens, p, top, seed):
    q, k, _ = random_qkv(lens, seed=seed)
    sel = chosen(f"quest:p={p},k={top}", q, k, lens)
    assert isinstance(sel, TokenBlockSelection) and sel.block == p
    want = quest_by_definition(q, k, lens, p, top)
    for row in range(len(q)):
        for h in range(q.shape[1]):
            assert set(sel.blocks[row, h][sel.valid[row, h]].tolist()) == want[row][h], (row, h)


@settings(max_examples=15, deadline=None)
@given(lens=SAMPLES, p=st.integers(1, 8), top=st.integers(1, 4), seed=st.integers(0, 50))
def test_quest_attends_over_exactly_its_pages(lens, p, top, seed):
    q, k, v = random_qkv(lens, seed=seed)
    pages = quest_by_definition(q, k, lens, p, top)
    rows = [t for _, n in samples(lens) for t in range(n)]
    keys = [
        [{j for page in chosen | {t // p} for j in range(page * p, (page + 1) * p) if j <= t} for chosen in per_head]
        for t, per_head in zip(rows, pages)
    ]
    assert_attends_over(f"quest:p={p},k={top}", keys, q, k, v, lens)


# --- all four: bad parameters, the kernels, a tiny run ---------------------------------------------


@pytest.mark.parametrize(
    "spec, message",
    [
        ("sinks:w=0", "need s >= 0 and w >= 1"),
        ("vslash:v=4,sink=5", "0 <= sink <= v"),
        ("vslash:sl=2,local=3", "0 <= local <= sl"),
        ("vslash:sink=0,local=0", "else a query may read nothing"),
        ("blocktopk:k=2", "k >= 3 (the own, the previous and the first block are always read)"),
        ("quest:k=0", "need p >= 1 and k >= 1"),
    ],
)
def test_bad_parameters_are_one_line(spec, message):
    with pytest.raises(GtxError, match=re.escape(message)):
        parse_pattern(spec)


KINDS = {
    "vslash": ("keys", KeySelection),
    "blocktopk": ("blocks", BlockSelection),
    "quest": ("token-blocks", TokenBlockSelection),
}
SMALL = {
    "vslash": "vslash:v=2,sl=3,last=8,sink=1,local=1",
    "blocktopk": "blocktopk:b=4,k=3",
    "quest": "quest:p=4,k=2",
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_fused_triton_kernels_serve_the_selection(name, monkeypatch):
    """Under ``GTX_KERNELS=triton`` (Triton's interpreter on the CPU) the selection runs on the Triton
    kernel of its kind and still equals float64 dense attention over what it chose."""
    kernels = selection.kernels
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if kernels.triton_error() is not None:
        pytest.skip(kernels.triton_error())
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton's interpreter is off (TRITON_INTERPRET=1)")
    monkeypatch.setenv(kernels.VARIABLE, "triton")
    lens = [21, 9]
    q, k, v = (x.to(device) for x in random_qkv(lens, dim=16, seed=3))
    pattern = parse_pattern(SMALL[name])
    edges = build_graph(pattern, None, lens).edges["dd"].to(device)
    sel = pattern.select(q, k, edges)
    kernels.take_ran()
    out = Attention(get_backend("dense"), pattern, q.shape[1])(q, k, v, edges)
    ran = kernels.take_ran().get("dd", {})
    if f"triton:{KINDS[name][0]}" not in ran:
        pytest.xfail(f"no Triton kernel for a {type(sel).__name__} ran here (it ran {sorted(ran) or 'none recorded'})")
    keys = as_mask_of(sel, edges)
    torch.testing.assert_close(out.cpu(), dense_over(q.cpu(), k.cpu(), v.cpu(), keys).float(), atol=1e-4, rtol=1e-4)


def as_mask_of(sel, edges):
    """A selection as allowed (n, H, n): its keep mask over the candidate edges, scattered."""
    if isinstance(sel, BlockSelection):  # no as_mask: its blocks' keys at or before each query, by hand
        n, heads = edges.n_dst, sel.valid.shape[1]
        allowed = torch.zeros(n, heads, n, dtype=torch.bool)
        for (start, m), key_blocks, valid in zip(samples(sel.lens), sel.key_blocks.cpu(), sel.valid.cpu()):
            for t in range(m):
                for h in range(heads):
                    for c in key_blocks[h, t // sel.block][valid[h, t // sel.block]].tolist():
                        for j in range(c * sel.block, min(m, (c + 1) * sel.block)):
                            allowed[start + t, h, start + j] = j <= t
        return allowed
    keep = sel.as_mask(edges).cpu()
    allowed = torch.zeros(edges.n_dst, keep.shape[1], edges.n_dst, dtype=torch.bool)
    allowed[edges.dst.cpu(), :, edges.src.cpu()] = keep
    return allowed


RUNS = {
    "sinks:s=2,w=8": 10,
    "vslash:v=4,sl=8,last=16,sink=1,local=2": 12,
    "blocktopk:b=8,k=3": 24,
    "quest:p=8,k=2": 24,
}


@pytest.mark.parametrize("spec", sorted(RUNS))
def test_a_tiny_run_trains_and_evaluates_on_the_selection_kernels(tmp_path, spec):
    """``gtx run`` trains and evaluates with each method; its rows read at most the budget per query, and
    the selections ran on their kernels: no backend attended over edges in ``dd`` (a mask would)."""
    args = ["run", "--task", "recall", "--model", "lm", "--pattern", spec, "--epochs", "1", "--quiet"]
    for key, value in {"seq_len": 64, "n_train": 16, "n_valid": 4, "n_test": 4}.items():
        args += ["--set", f"{key}={value}"]
    result = CliRunner().invoke(
        cli, [*args, "--dim", "16", "--heads", "2", "--dim-ff", "16", "--results", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    rows = load(tmp_path)
    assert set(rows.split) == {"train", "valid", "test"} and rows.loss.notna().all()
    assert (rows.edges_per_query_dd <= RUNS[spec]).all() and ((rows.density > 0) & (rows.density < 1)).all()
    name = spec.partition(":")[0]
    for plan in rows.backend_plan:
        ran = json.loads(plan).get("dd", {})
        if name in KINDS:  # only a selection kernel's name, "<kernels>:<kind>", where any is recorded
            assert all(kernel.partition(":")[2] == KINDS[name][0] for kernel in ran), ran
        else:
            assert ran  # a fixed pattern: its edges go to the backend
    if name in KINDS:
        lens = [40, 24]
        q, k, _ = random_qkv(lens)
        assert isinstance(chosen(spec, q, k, lens), KINDS[name][1])  # a selection kind, not a mask


def test_budget_bounds_what_each_query_reads():
    """Each selection's keys per query stay within the budget its parameters fix."""
    lens = [64, 37]
    q, k, _ = random_qkv(lens, seed=1)
    for spec in ("vslash:v=4,sl=8,last=16,sink=1,local=2", "blocktopk:b=8,k=3", "quest:p=8,k=2"):
        assert float(chosen(spec, q, k, lens).per_query().max()) <= parse_pattern(spec).budget, spec
