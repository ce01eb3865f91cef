"""Every backend computes the same function as ``dense``: outputs and gradients of q, k, v."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx.backends import Backend, get_backend
from gtx.backends.dgl_compat import GraphboltUnavailable, import_dgl
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import EdgeSet, build_graph
from gtx.model.engine import propagate_attention
from gtx.plugins.registry import BACKENDS
from gtx.testing.float32 import float64_reference

# the backends that compute gradients on the CPU (flex runs there without gradients only: tested below)
BACKEND_NAMES = [
    n
    for n in BACKENDS.names()
    if BACKENDS.get(n).obj.available("cpu") is None and BACKENDS.get(n).obj.trains_on("cpu") and n != "dense"
]


def random_edges(seed: int, n_q: int, n_k: int, density: float, allow_empty: bool = False) -> EdgeSet:
    """Random adjacency; every third query gets exactly one edge; optionally some queries get none."""
    gen = torch.Generator().manual_seed(seed)
    adj = torch.rand(n_q, n_k, generator=gen) < density
    single = torch.arange(n_q) % 3 == 0
    adj[single] = False
    adj[single, torch.randint(0, n_k, (int(single.sum()),), generator=gen)] = True
    empty = (torch.rand(n_q, generator=gen) < 0.2) if allow_empty else torch.zeros(n_q, dtype=torch.bool)
    adj[~empty & (adj.sum(1) == 0), 0] = True
    adj[empty] = False
    dst, src = adj.nonzero(as_tuple=True)
    return EdgeSet(src, dst, n_k, n_q)


def graphs(max_len: int, densities: list[float], **more):
    """hypothesis' ``given`` over random_edges' arguments: a seed, n_q and n_k in [1, max_len], a density
    among ``densities``; ``more``: the test's other strategies."""
    n = st.integers(1, max_len)
    return given(seed=st.integers(0, 2**16), n_q=n, n_k=n, density=st.sampled_from(densities), **more)


def drawn(edges, heads=2, dim=4, dim_v=3, seed=0, dtype=torch.float32):
    """Seeded random q, k, v for ``edges`` and the weights of an uneven loss on the output."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(edges.n_dst, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(edges.n_src, heads, dim, generator=gen, dtype=dtype)
    v = torch.randn(edges.n_src, heads, dim_v, generator=gen, dtype=dtype)
    return q, k, v, torch.randn(edges.n_dst, heads, dim_v, generator=gen, dtype=dtype)


def attention_of(backend, edges):
    """(q, k, v, weights) -> the output of ``backend`` on ``edges`` and the gradients of q, k and v."""

    def run(q, k, v, weights):
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = propagate_attention(*xs, edges, backend)
        return out.detach(), *torch.autograd.grad((out * weights).sum(), xs, materialize_grads=True)

    return run


def attention_and_grads(backend, edges, **kw):
    """The output and q, k, v gradients of ``backend`` on ``drawn(edges, **kw)``."""
    return attention_of(backend, edges)(*drawn(edges, **kw))


def dense_float64(edges, **kw):
    """The dense backend on ``drawn(edges, **kw)`` in float64, and the bound float32 holds to it."""
    return float64_reference(attention_of(get_backend("dense"), edges), *drawn(edges, **kw))


def assert_agree(name, edges, **kw):
    dense_float64(edges, **kw).check(attention_and_grads(get_backend(name), edges, **kw), f"{name} (out, dq, dk, dv)")


@pytest.mark.parametrize("name", BACKEND_NAMES)
@settings(max_examples=25, deadline=None)
@graphs(40, [0.02, 0.2, 0.6, 1.0])
def test_backend_agrees_with_dense(name, seed, n_q, n_k, density):
    assert_agree(name, random_edges(seed, n_q, n_k, density), seed=seed)


@pytest.mark.parametrize("name", BACKEND_NAMES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), n_q=st.integers(1, 30), n_k=st.integers(1, 30))
def test_queries_without_edges_get_zeros(name, seed, n_q, n_k):
    edges = random_edges(seed, n_q, n_k, 0.3, allow_empty=True)
    assert_agree(name, edges, seed=seed)
    out = attention_and_grads(get_backend(name), edges)[0]
    assert (out[edges.in_degree() == 0] == 0).all()


@pytest.mark.parametrize("name", BACKEND_NAMES)
@pytest.mark.parametrize("spec", ["full", "local:w=2", "bigbird:b=2,r=1"])
def test_backend_agrees_on_batched_pattern_graphs(name, spec):
    g = build_graph(parse_pattern(spec), [7, 1, 12], [5, 9, 1])
    for edges in g.edges.values():
        assert_agree(name, edges, heads=4, dim=8, dim_v=8)


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_backend_agrees_in_float64(name):
    """Partly filled blocks (a mask) in double precision: a kernel that read its mask as another
    dtype than the queries' would differ by whole units here."""
    edges = build_graph(parse_pattern("local:w=3"), None, [11, 6]).edges["dd"]
    ref = attention_and_grads(get_backend("dense"), edges, heads=2, dim=8, dim_v=8, dtype=torch.float64)
    got = attention_and_grads(get_backend(name), edges, heads=2, dim=8, dim_v=8, dtype=torch.float64)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"{name} {what}")


def test_large_scores_are_stable():
    """Scores of 1e4 overflow a naive exp; the max-subtracted softmax does not."""
    edges = random_edges(0, 6, 6, 0.5)
    q = torch.full((6, 1, 2), 100.0)
    k = torch.full((6, 1, 2), 100.0)
    v = torch.randn(6, 1, 2)
    for name in ["dense", *BACKEND_NAMES]:
        out = propagate_attention(q, k, v, edges, get_backend(name))
        # dgl-seed keeps the DGL tutorial's unshifted exp (minus their clamp) as a speed baseline: it overflows
        assert torch.isfinite(out).all() != (name == "dgl-seed"), name


@pytest.mark.parametrize("block", [1, 4, 16, 64])
@settings(max_examples=10, deadline=None)
@graphs(70, [0.05, 0.5, 1.0])
def test_blocksparse_any_block_size(block, seed, n_q, n_k, density):
    from gtx.backends.blocksparse import BlockSparseBackend

    edges = random_edges(seed, n_q, n_k, density, allow_empty=True)
    dense_float64(edges, seed=seed).check(
        attention_and_grads(BlockSparseBackend(block), edges, seed=seed), "blocksparse"
    )


@pytest.mark.parametrize("spec", ["local:w=3", "bigbird:b=2,r=1", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocksparse_in_chunks_of_query_blocks_agrees_with_dense(monkeypatch, spec, dtype):
    """The CPU kernel path a chunk of query blocks at a time (here one block per call): each chunk's
    outputs and log-sum-exps, and the key gradients summed over chunks, equal one dense call's."""
    from gtx.backends import blocksparse

    monkeypatch.setattr(blocksparse, "CHUNK_KEYS", 1)
    monkeypatch.setattr(blocksparse, "BAND_CHUNK_KEYS", 1)
    edges = build_graph(parse_pattern(spec), None, [11, 30]).edges["dd"]
    assert len(blocksparse._chunks(blocksparse.plan(edges, 4))) == -(-41 // 4)
    got = attention_and_grads(blocksparse.BlockSparseBackend(4), edges, heads=2, dim=8, dim_v=8, dtype=dtype)
    if dtype == torch.float32:
        dense_float64(edges, heads=2, dim=8, dim_v=8).check(got, f"{spec} (out, dq, dk, dv)")
        return
    ref = attention_and_grads(get_backend("dense"), edges, heads=2, dim=8, dim_v=8, dtype=dtype)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, msg=f"{spec} {what}")


@pytest.mark.parametrize("name", ["blocksparse", "auto", "dgl", "torch"])
def test_act_subsets_reuse_the_full_plan_and_agree(name):
    edges = random_edges(7, 50, 50, 0.3)
    keep = torch.arange(50) % 3 != 0
    sub = edges.filter_dst(keep)
    assert sub.parent is edges and torch.equal(sub.keep, keep)
    assert torch.equal(sub.filter_dst(torch.arange(50) < 25).keep, keep & (torch.arange(50) < 25))
    got = attention_and_grads(get_backend(name), sub)
    dense_float64(sub).check(got, f"{name} (out, dq, dk, dv)")
    assert (got[0][~keep] == 0).all()


def test_auto_records_its_choice_per_stage():
    auto = get_backend("auto")
    auto.reset_choices()
    g = build_graph(parse_pattern("local:w=1"), [30, 20], [10, 5])
    for edges in g.edges.values():
        propagate_attention(*(torch.randn(n, 2, 4) for n in (edges.n_dst, edges.n_src, edges.n_src)), edges, auto)
    choices = auto.reset_choices()
    assert set(choices) == {"ee", "dd", "ed"} and all(sum(c.values()) == 1 for c in choices.values())
    assert auto.reset_choices() == {}


def test_flex_on_cpu_refuses_gradients_in_one_line():
    flex = get_backend("flex", "cpu")  # usable: without gradients
    edges = build_graph(parse_pattern("local:w=2"), [20]).edges["ee"]
    q, k, v = (torch.randn(20, 2, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(GtxError, match="backend 'flex' runs on the CPU without gradients only") as e:
        propagate_attention(q, k, v, edges, flex)
    assert "\n" not in str(e.value)


def dense_forward(edges, q, k, v):
    """The dense backend's output on q, k, v in float64, and the bound float32 holds to it."""
    return float64_reference(lambda q, k, v: get_backend("dense")(q, k, v, edges), q, k, v)


@pytest.mark.parametrize(
    "spec, lens",
    [
        ("local:w=3", [50, 70]),  # two samples: a block-diagonal graph; blocks cut by the end of each
        ("bigbird:b=8", [100]),
        ("local:w=2|strided:l=8", [120]),
        ("fixed:l=16,c=2", [90]),
        ("full", [128]),  # every block full: no per-element mask
    ],
)
def test_flex_compiled_forward_on_cpu_matches_dense(spec, lens):
    """The compiled CPU kernel (every size here pads to one block of 128: one compilation)."""
    edges = build_graph(parse_pattern(spec), lens).edges["ee"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(edges.n_dst, 2, 8, generator=gen) for _ in range(3))
    with torch.no_grad():
        got = get_backend("flex")(q, k, v, edges)
    dense_forward(edges, q, k, v).check(got, "flex")


def test_flex_compiled_forward_with_bit_tiles_on_cpu():
    """Past ADJACENCY_MAX the partial blocks' elements are bits of int32 words, read by the compiled
    kernel (a union of a window and a stride: partial blocks everywhere, bit 31 of a word included)."""
    from unittest import mock

    from gtx.backends import flex

    edges = build_graph(parse_pattern("local:w=2|strided:l=33"), [300]).edges["ee"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(edges.n_dst, 2, 8, generator=gen) for _ in range(3))
    with torch.no_grad(), mock.patch.object(flex, "ADJACENCY_MAX", 0):
        got = flex.flex_attention(q, k, v, flex.block_mask(edges))
    dense_forward(edges, q, k, v).check(got, "flex")


def test_flex_refuses_a_lookup_past_int32_offsets_in_one_line():
    from unittest import mock

    from gtx.backends import flex

    edges = build_graph(parse_pattern("local:w=2|strided:l=33"), [300]).edges["ee"]
    with mock.patch.object(flex, "ADJACENCY_MAX", 0), mock.patch.object(flex, "OFFSETS_MAX", 1024):
        with pytest.raises(GtxError, match=r"^backend 'flex': 9 partial blocks .* use --backend blocksparse or torch"):
            flex.block_mask(edges)


def test_flex_pads_to_a_ladder_of_few_sizes():
    from gtx.backends.flex import padded

    sizes = {padded(n) for n in range(1, 20000)}
    assert all(padded(n) >= n and padded(n) % 128 == 0 for n in (1, 127, 129, 4097, 16385))
    assert padded(1024) == 1024 and padded(16384) == 16384 and padded(4097) <= 1.2 * 4097 + 128
    assert len(sizes) < 30


@settings(max_examples=8, deadline=None)
@graphs(300, [0.01, 0.3, 1.0], tiles=st.booleans())
def test_flex_block_mask_matches_dense_forward_on_cpu(seed, n_q, n_k, density, tiles):
    """The BlockMask built from edges is checked with FlexAttention's eager forward (no grad) on CPU,
    its partial blocks' elements looked up in one adjacency or (past ADJACENCY_MAX) in tiles."""
    import warnings
    from unittest import mock

    from gtx.backends import flex
    from gtx.backends.flex import block_mask, flex_attention

    edges = random_edges(seed, n_q, n_k, density)
    q, k, v = (torch.randn(n, 2, 8) for n in (n_q, n_k, n_k))
    with torch.no_grad(), warnings.catch_warnings(), mock.patch.object(flex, "ADJACENCY_MAX", 0 if tiles else 1 << 28):
        warnings.simplefilter("ignore")
        got = flex_attention(q * 8**-0.5, k, v, block_mask(edges, 16), compile=False)
    dense = get_backend("dense")
    float64_reference(lambda q, k, v: propagate_attention(q, k, v, edges, dense), q, k, v).check(got, "flex")


def test_hook_register_backends():
    class Doubled(Backend):
        """Twice the dense answer (a test backend)."""

        def __call__(self, q, k, v, edges):
            return 2 * get_backend("dense")(q, k, v, edges)

    from gtx import hookimpl
    from gtx.plugins.registry import pm

    class Plugin:
        @hookimpl
        def register_backends(self, register):
            register("doubled", Doubled())

    pm.register(Plugin(), name="test-doubled")
    from gtx.plugins.registry import _state

    _state["generation"] += 1
    try:
        edges = random_edges(1, 4, 4, 0.5)
        q, k, v = (torch.randn(4, 1, 2) for _ in range(3))
        torch.testing.assert_close(
            propagate_attention(q, k, v, edges, get_backend("doubled")),
            2 * propagate_attention(q, k, v, edges, get_backend("dense")),
        )
    finally:
        pm.unregister(name="test-doubled")
        _state["generation"] += 1


def test_unavailable_backend_says_why():
    class Never(Backend):
        def available(self, device="cpu"):
            return "needs a device this machine lacks"

    from gtx.plugins.registry import Entry

    BACKENDS.entries()["never"] = Entry("never", Never(), "test")
    try:
        with pytest.raises(
            GtxError, match="backend 'never' is unavailable on cpu: needs a device this machine lacks; choose another"
        ):
            get_backend("never")
    finally:
        BACKENDS.entries().pop("never")


def test_dgl_compat_shims():
    dgl = import_dgl()
    import sys

    gb = sys.modules["dgl.graphbolt"]
    assert not hasattr(gb, "ItemSampler")
    with pytest.raises(GraphboltUnavailable, match="graphbolt is not loaded by gtx"):
        gb.ItemSampler  # noqa: B018 - the attribute access is what raises
    g = dgl.graph((torch.tensor([0, 1]), torch.tensor([1, 1])))
    assert g.num_edges() == 2


# --- plain attention (every sample complete or causal): the flash path ------------------------------


def reference_attention(q, k, v, edges):
    """Independent of every backend: masked softmax over the edges in float64 math (no SDPA)."""
    adj = torch.zeros(edges.n_dst, edges.n_src, dtype=torch.bool)
    adj[edges.dst, edges.src] = True
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~adj, float("-inf")), -1).nan_to_num(0.0)  # no edge: zeros
    return torch.einsum("hqk,khd->qhd", weights, v.double()).to(q.dtype)


def assert_matches_reference(backend, edges, heads=2, dim=4, dim_v=3, seed=0):
    """Outputs and q, k, v gradients of ``backend`` equal the reference's."""
    got = attention_and_grads(backend, edges, heads=heads, dim=dim, dim_v=dim_v, seed=seed)

    class Reference(Backend):
        def __call__(self, q, k, v, edges):
            return reference_attention(q * q.shape[-1] ** 0.5, k, v, edges)  # undo propagate_attention's scaling

    want = float64_reference(attention_of(Reference(), edges), *drawn(edges, heads, dim, dim_v, seed))
    want.check(got, f"{type(backend).__name__} (out, dq, dk, dv)")


def plain_attention_sets():
    """(id, edge set, structure): single sequences, cross attention, batches of equal and unequal lengths."""
    full, causal = parse_pattern("full"), parse_pattern("causal")
    one = build_graph(full, [9], [6]).edges
    equal = build_graph(causal, [5, 5, 5], [4, 4, 4]).edges
    unequal = build_graph(full, [7, 1, 12, 7, 3], [5, 9, 1, 5, 2]).edges
    return [
        ("complete", one["ee"], "complete"),
        ("causal", one["dd"], "causal"),
        ("cross", one["ed"], "complete"),  # 6 queries, 9 keys
        ("equal-causal", equal["ee"], "causal"),
        ("equal-cross", equal["ed"], "complete"),
        ("unequal-complete", unequal["ee"], "complete"),
        ("unequal-causal", unequal["dd"], "causal"),
        ("unequal-cross", unequal["ed"], "complete"),
        # one sample
        (
            "no-lens-complete",
            EdgeSet(*reversed(torch.ones(11, 7).nonzero(as_tuple=True)), 7, 11),
            "complete",
        ),
    ]


PLAIN = plain_attention_sets()


# SDPA's calls: a bucket per shape .. everything padded into one; None: unequal samples on the packed kernel
PLANS = [0, 2**10, 2**50, None]


def use_plan(monkeypatch, call_work):
    """``flash_attention`` on SDPA's calls at ``call_work`` (the packed kernel off), or with None on its
    default plans (unequal short samples packed)."""
    from gtx.backends import flash

    if call_work is not None:
        monkeypatch.setitem(flash.CALL_WORK, "cpu", call_work)
        monkeypatch.setattr(flash, "SHORT", 0)


@pytest.mark.parametrize("call_work", PLANS)
@pytest.mark.parametrize("name", ["dense", "auto"])
@pytest.mark.parametrize("case", PLAIN, ids=[c[0] for c in PLAIN])
def test_plain_attention_runs_flash_and_matches_the_reference(case, name, call_work, monkeypatch):
    from gtx.backends import flash

    _, edges, structure = case
    use_plan(monkeypatch, call_work)
    # no plans yet
    edges = EdgeSet(edges.src, edges.dst, edges.n_src, edges.n_dst, edges.stage, edges.q_lens, edges.k_lens)
    assert flash.flash_structure(edges) == structure
    assert_matches_reference(get_backend(name), edges)
    if name == "auto":
        for auto in ("auto", "auto-tuned"):
            assert get_backend(auto).choose(edges, 2, 4, torch.device("cpu")) == f"flash-{structure}"


@pytest.mark.parametrize("call_work", PLANS)
@pytest.mark.parametrize("name", ["dense", "auto"])
@pytest.mark.parametrize("case", PLAIN, ids=[c[0] for c in PLAIN])
def test_grouped_keys_and_values_give_what_repeated_ones_give(case, name, call_work, monkeypatch):
    """Grouped-query k and v (half q's heads) reach plain attention's SDPA as they are (enable_gqa),
    the packed kernel and the log-sum-exp kernel repeated: out and log-sum-exp equal the repeated heads'."""
    from gtx.backends import repeat_kv

    _, edges, _ = case
    use_plan(monkeypatch, call_work)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(edges.n_dst, 4, 8, generator=g)
    k, v = (torch.randn(edges.n_src, 2, 8, generator=g) for _ in range(2))
    backend = get_backend(name)
    torch.testing.assert_close(backend(q, k, v, edges), backend(q, repeat_kv(k, 4), repeat_kv(v, 4), edges))
    (out, sums), (out_r, sums_r) = (
        backend.with_lse(q, k, v, edges),
        backend.with_lse(q, *(repeat_kv(x, 4) for x in (k, v)), edges),
    )
    torch.testing.assert_close(out, out_r)
    assert (sums is None) == (sums_r is None) and (sums is None or torch.allclose(sums, sums_r))


@pytest.mark.parametrize("spec", ["full", "local:w=3", "topk(full):k=2"])
@pytest.mark.parametrize("name", ["auto", "dense", "blocksparse", "torch"])
def test_attention_repeats_grouped_heads_for_kernels_that_need_them(spec, name):
    from gtx.attention.module import Attention
    from gtx.backends import repeat_kv

    pattern = parse_pattern(spec)
    edges = build_graph(pattern, None, [7, 5]).edges["dd"]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(edges.n_dst, 4, 8, generator=g)
    k, v = (torch.randn(edges.n_src, 2, 8, generator=g) for _ in range(2))
    attention = Attention(get_backend(name), pattern, 4, 8)
    want = attention(q, repeat_kv(k, 4), repeat_kv(v, 4), edges)
    torch.testing.assert_close(attention(q, k, v, edges), want)
    assert torch.equal(repeat_kv(k, 4)[:, 1], k[:, 0]) and torch.equal(repeat_kv(k, 4)[:, 2], k[:, 1])
    with pytest.raises(ValueError, match="must divide"):
        repeat_kv(torch.zeros(3, 3, 2), 4)


@settings(max_examples=25, deadline=None)
@given(
    spec=st.sampled_from(["full", "causal"]),
    src_lens=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    tgt_lens=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    call_work=st.sampled_from([0, 2**10, 2**18, None]),
)
def test_flash_matches_the_reference_on_batches(spec, src_lens, tgt_lens, call_work):
    from gtx.backends import flash

    old = flash.CALL_WORK["cpu"], flash.SHORT
    if call_work is not None:  # else the packed kernel's plans
        flash.CALL_WORK["cpu"], flash.SHORT = call_work, 0
    try:
        g = build_graph(parse_pattern(spec), src_lens, tgt_lens[: len(src_lens)])
        for stage, edges in g.edges.items():
            causal = (stage == "dd" or spec == "causal" and stage == "ee") and max(
                edges.q_lens
            ) > 1  # n=1: both, complete
            assert flash.flash_structure(edges) == ("causal" if causal else "complete")
            assert_matches_reference(get_backend("dense"), edges, heads=2, dim=8, dim_v=8)
    finally:
        flash.CALL_WORK["cpu"], flash.SHORT = old


def _without(edges, drop, add=None):
    """The edge set less edge number ``drop``, plus edge ``add`` = (src, dst) if given; sorted, same lengths."""
    keep = torch.arange(edges.num_edges) != drop
    src, dst = edges.src[keep], edges.dst[keep]
    if add is not None:
        src, dst = torch.cat([src, torch.tensor([add[0]])]), torch.cat([dst, torch.tensor([add[1]])])
    order = torch.argsort(dst * edges.n_src + src)
    return EdgeSet(src[order], dst[order], edges.n_src, edges.n_dst, edges.stage, edges.q_lens, edges.k_lens)


def test_near_plain_attention_is_not_taken_for_it_and_stays_correct():
    from gtx.backends.flash import flash_structure

    g = build_graph(parse_pattern("full"), [6, 6], [5, 5])
    complete, causal = g.edges["ee"], g.edges["dd"]
    assert flash_structure(complete) == "complete" and flash_structure(causal) == "causal"
    near = [
        _without(complete, 7),  # one edge missing
        _without(complete, 7, add=(7, 0)),  # the count of a complete batch, one edge across samples
        _without(causal, 4, add=(4, 1)),  # the count of a causal batch, one key after its query
        _without(causal, 4, add=(7, 3)),  # ... and one key of the next sample
        # one sequence, one key after its query
        _without(build_graph(parse_pattern("causal"), [6]).edges["ee"], 4, add=(4, 1)),
    ]
    for edges in near:
        assert flash_structure(edges) is None
        for name in ("dense", "auto"):
            assert_matches_reference(get_backend(name), edges)
        assert not get_backend("auto").choose(edges, 2, 4, torch.device("cpu")).startswith("flash")
    duplicated = EdgeSet(
        complete.src.repeat_interleave(2)[:-2], complete.dst.repeat_interleave(2)[:-2], 12, 12, "ee", (12,), (12,)
    )
    assert duplicated.num_edges == 142 and flash_structure(duplicated) is None  # not unique: a count proves nothing


@pytest.mark.parametrize("name", ["dense", "auto"])
def test_act_subsets_of_plain_attention_match_the_reference(name):
    from gtx.backends.flash import flash_structure
    from gtx.backends.packed import available

    causal = build_graph(parse_pattern("causal"), [9, 4, 9]).edges["ee"]
    complete = build_graph(parse_pattern("full"), [9, 4, 9]).edges["ee"]
    for edges in (causal, complete):
        keep = torch.arange(edges.n_dst) % 3 != 1
        sub = edges.filter_dst(keep).filter_dst(torch.arange(edges.n_dst) < 17)  # a subset of a subset
        assert flash_structure(sub) is None and flash_structure(edges) is not None
        assert_matches_reference(get_backend(name), sub)
        out = attention_and_grads(get_backend(name), sub)[0]
        assert (out[~sub.keep] == 0).all()
        if name == "auto":
            auto = get_backend("auto")
            auto.reset_choices()
            attention_and_grads(auto, sub)
            # unequal short samples: flash runs them on its packed kernel, and the count says so
            kernel = "packed" if available(torch.zeros(1)) else "flash"
            assert auto.reset_choices() == {"ee": {f"{kernel}-{flash_structure(edges)}": 1}}


@pytest.mark.parametrize("causal", [False, True])
def test_buckets_cover_every_sample_once(causal):
    from gtx.backends.flash import buckets

    shapes = sorted([(n, n) for n in (3, 3, 5, 9, 9, 9, 40)], key=lambda s: (s[1], s[0]))
    for call_pairs, want in [(0, [2, 3, 6, 7]), (2**40, [7])]:
        assert buckets(shapes, causal, call_pairs) == want
    runs = buckets(shapes, causal, 100)
    assert runs == sorted(runs) and runs[-1] == len(shapes) and 6 in runs  # 40 is never padded with the 9s


@pytest.mark.parametrize("spec", ["full", "causal", "local:w=3", "local:w=2&causal"])
@pytest.mark.parametrize("heads,dim,dim_v", [(2, 32, 32), (1, 128, 128), (3, 12, 5)])  # unrolled, in registers, scalar
def test_the_packed_kernel_is_attention_over_each_querys_key_range(heads, dim, dim_v, spec):
    """``attend_ranges`` against softmax attention over each query's edges in float64, for every stage
    of a batch: outputs, log-sum-exps and q, k, v gradients, bitwise the same on 1 and 2 threads."""
    from gtx.backends.packed import attend_ranges, available, edge_ranges

    # the last samples long enough to run in tiles (packed_kernel.c's MIN_TILED), the others query by query
    graph = build_graph(parse_pattern(spec), [5, 9, 24, 1, 60], [1, 7, 24, 3, 50])
    gen = torch.Generator().manual_seed(heads * dim)
    for stage, edges in graph.edges.items():
        q, k, v = (
            torch.randn(n, heads, d, generator=gen, requires_grad=True)
            for n, d in ((edges.n_dst, dim), (edges.n_src, dim), (edges.n_src, dim_v))
        )
        if not available(q, k, v):
            pytest.skip("no C compiler")
        ranges = edge_ranges(edges)
        assert ranges is not None, f"{spec} {stage}: one run of keys per query"
        weights = torch.randn(edges.n_dst, heads, dim_v, generator=gen)
        outs, sums, grads = [], [], []
        for threads in (1, 2):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                out, lse = attend_ranges(q, k, v, ranges)
                grads.append(torch.autograd.grad((out * weights).sum(), (q, k, v)))
            finally:
                torch.set_num_threads(before)
            outs.append(out.detach()), sums.append(lse)
        assert all(torch.equal(a, b) for a, b in zip((outs[0], sums[0], *grads[0]), (outs[1], sums[1], *grads[1])))
        adj = torch.zeros(edges.n_dst, edges.n_src, dtype=torch.bool)
        adj[edges.dst, edges.src] = True
        want = float64_reference(over_keys(adj), q, k, v, weights)
        want.check((outs[0], sums[0], *grads[0]), f"{spec} {stage} (out, lse, dq, dk, dv)")


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    width=st.integers(1, 40),
    lag=st.integers(0, 3),
    moving=st.booleans(),
    shape=st.sampled_from([(2, 32, 32), (1, 16, 48), (3, 48, 16)]),
)
def test_the_packed_kernel_on_any_ranges_in_tiles_or_query_by_query(seed, lens, width, lag, moving, shape):
    """Ranges that move forward with the queries (a window of ``width`` keys ending ``lag`` before the
    query: the first queries read none) run 16 queries to a tile in samples of 48 queries or more,
    random ranges query by query: either agrees with float64 attention (output 0 and lse -inf where a
    query reads no key), bitwise the same on 1 and 2 threads."""
    from gtx.backends.packed import Ranges, attend_ranges, available, sample_spans

    heads, dim, dim_v = shape
    gen = torch.Generator().manual_seed(seed)
    spans, rows = sample_spans(lens, lens), []
    for _, nq, k0, nk in spans.tolist():
        if moving:
            ends = [max(0, i + 1 - lag) for i in range(nq)]
            rows += [(k0 + max(0, e - width), k0 + e) for e in ends]
        else:
            lo = torch.randint(0, nk, (nq,), generator=gen)
            hi = torch.minimum(lo + torch.randint(0, width, (nq,), generator=gen), torch.tensor(nk))
            rows += [(k0 + a, k0 + b) for a, b in zip(lo.tolist(), hi.tolist())]
    ranges = Ranges(spans, torch.tensor(rows))
    n = sum(lens)
    q, k, v = (torch.randn(n, heads, d, generator=gen, requires_grad=True) for d in (dim, dim, dim_v))
    if not available(q):
        pytest.skip("no C compiler")
    weights = torch.randn(n, heads, dim_v, generator=gen)
    runs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, lse = attend_ranges(q, k, v, ranges)
            runs.append((out.detach(), lse, *torch.autograd.grad((out * weights).sum(), (q, k, v))))
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    keys = torch.arange(n)
    adj = (keys >= ranges.ranges[:, :1]) & (keys < ranges.ranges[:, 1:])
    float64_reference(over_keys(adj), q, k, v, weights).check(runs[0], "packed (out, lse, dq, dk, dv)")


def over_keys(adj):
    """(q, k, v, weights) -> softmax attention of each query over its keys in ``adj`` (n_q, n_k) (output 0
    and log-sum-exp -inf where it has none), its log-sum-exps, and the gradients of q, k, v."""

    def run(q, k, v, weights):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        s = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~adj, float("-inf"))
        out = torch.einsum("hqk,khe->qhe", s.softmax(-1).nan_to_num(0.0), v)
        return out, s.logsumexp(-1).t(), *torch.autograd.grad((out * weights).sum(), (q, k, v))

    return run


def test_edge_ranges_are_found_only_where_each_query_reads_one_run_of_its_samples_keys():
    from gtx.backends.packed import edge_ranges

    local = build_graph(parse_pattern("local:w=1"), [3, 4]).edges["ee"]
    assert edge_ranges(local).ranges.tolist() == [[0, 2], [0, 3], [1, 3], [3, 5], [3, 6], [4, 7], [5, 7]]
    assert edge_ranges(local).spans.tolist() == [[0, 3, 0, 3], [3, 4, 3, 4]]
    gap = EdgeSet(torch.tensor([0, 2, 1]), torch.tensor([0, 0, 1]), 3, 2)  # query 0 reads keys 0 and 2
    assert edge_ranges(gap) is None
    across = EdgeSet(
        torch.tensor([2, 3]), torch.tensor([1, 1]), 4, 2, "ee", (1, 1), (2, 2)
    )  # query 1 reads sample 1's keys
    assert edge_ranges(across).ranges.tolist() == [[0, 0], [2, 4]]
    spill = EdgeSet(torch.tensor([1, 2]), torch.tensor([0, 0]), 4, 2, "ee", (1, 1), (2, 2))  # query 0 reads key 2
    assert edge_ranges(spill) is None
    assert edge_ranges(build_graph(parse_pattern("strided:l=2"), None, [9]).edges["dd"]) is None


def test_auto_runs_windows_packed_over_short_samples_and_long_ones():
    from gtx.backends.auto import AutoBackend
    from gtx.backends.packed import available

    if not available(torch.zeros(1)):
        pytest.skip("no C compiler")
    cpu, auto = torch.device("cpu"), AutoBackend()
    short = build_graph(parse_pattern("local:w=4"), [9 + i % 16 for i in range(64)]).edges["ee"]
    assert auto.choose(short, 4, 32, cpu) == "packed"
    inputs = tuple(torch.zeros(short.n_dst, 4, 32, dtype=torch.float64) for _ in range(3))
    assert auto.choose(short, 4, 32, cpu, inputs) != "packed"  # float32 only
    long = build_graph(parse_pattern("local:w=64"), None, [4096]).edges["dd"]
    assert auto.choose(long, 4, 32, cpu) == "packed"  # 16 queries a tile: fewer products than blocks of 32
    strided = build_graph(parse_pattern("strided:l=4"), [9 + i % 16 for i in range(64)]).edges["ee"]
    assert auto.choose(strided, 4, 32, cpu) != "packed"  # keys in more than one run per query
    # an ACT subset runs by its full set's ranges, dropped queries zeroed
    sub = short.filter_dst(torch.arange(short.n_dst) % 3 != 1)
    assert_matches_reference(auto, sub)
    auto.reset_choices()
    assert (attention_and_grads(auto, sub)[0][~sub.keep] == 0).all()
    assert auto.reset_choices() == {"ee": {"packed": 1}}


def test_unequal_short_samples_plan_packed_and_the_rest_on_sdpa():
    """The packed kernel takes unequal samples of at most ``SHORT`` keys per query on average, for
    inputs it serves; samples of one shape stay one SDPA call on views, longer ones padded buckets."""
    from gtx.backends import flash

    full = parse_pattern("full")
    short, equal, long = (build_graph(full, lens, lens).edges for lens in ([3, 9, 20], [8, 8], [300, 500]))
    plan = flash.make_plan(short["ee"], "complete", 8, served=True)
    assert plan.ranges.spans.tolist() == [[0, 3, 0, 3], [3, 9, 3, 9], [12, 20, 12, 20]] and not plan.buckets
    assert plan.ranges.ranges[:4].tolist() == [[0, 3]] * 3 + [[3, 12]]
    causal = flash.make_plan(short["dd"], "causal", 8, served=True)
    assert causal.ranges.ranges[:4].tolist() == [[0, 1], [0, 2], [0, 3], [3, 4]]
    assert flash.make_plan(short["ee"], "complete", 8).ranges is None  # inputs the kernel does not serve
    assert flash.make_plan(equal["ee"], "complete", 8, served=True).ranges is None
    assert flash.make_plan(long["ee"], "complete", 8, served=True).ranges is None  # 425 keys per query
    assert flash.make_plan(long["dd"], "causal", 8, served=True).ranges is None  # 213


def test_stages_over_the_same_samples_share_one_flash_plan(monkeypatch):
    """A batch's ee and ed (a copy task's sources and targets of one length each) plan once; a
    causal stage or another call cost plans afresh."""
    from gtx.backends import flash
    from gtx.graph.tokens import build_graph

    lens = [5, 1, 3, 5]
    graph = build_graph(parse_pattern("full"), lens, lens)
    ee, ed, dd = (graph.edges[s] for s in ("ee", "ed", "dd"))
    plan = flash.make_plan(ee, "complete", 8)
    assert flash.make_plan(ed, "complete", 8) is plan
    assert len(plan.buckets) > 1 or plan.buckets[0].q_idx is not None  # padded: the case worth sharing
    assert flash.make_plan(dd, "causal", 8) is not plan
    monkeypatch.setitem(flash.CALL_WORK, "cpu", 0)
    assert flash.make_plan(ed, "complete", 8) is not plan


@pytest.mark.parametrize(
    "spec,stage,lens,structure",
    [
        ("full", "ee", [5, 1, 3], "complete"),
        ("full", "dd", [4, 1, 6], "causal"),
        ("causal", "ee", [3, 3], "causal"),
        ("full", "dd", [1, 1], "complete"),
        ("local:w=1", "dd", [4, 2], None),
        ("local:w=1", "dd", [2, 1], "causal"),
    ],
)
def test_plain_attention_batches_know_their_structure_without_building_edges(spec, stage, lens, structure):
    from gtx.graph.tokens import batch_edges

    pattern = parse_pattern(spec)
    lazy = batch_edges(pattern, stage, lens, lens)
    assert lazy.structure == structure and lazy.num_edges == sum(pattern.edges(stage, n, n)[0].numel() for n in lens)
    if structure is not None:
        assert lazy._edges is None  # nothing built yet: flash runs from the lengths
    offsets = [sum(lens[:i]) for i in range(len(lens))]
    src = torch.cat([pattern.edges(stage, n, n)[0] + o for n, o in zip(lens, offsets)])
    dst = torch.cat([pattern.edges(stage, n, n)[1] + o for n, o in zip(lens, offsets)])
    assert torch.equal(lazy.src, src) and torch.equal(lazy.dst, dst)


# a bucket per shape (rows reordered) .. one padded call (masked), or packed
@pytest.mark.parametrize("call_work", [0, 2**50, None])
@pytest.mark.parametrize("name", ["dense", "auto"])
@pytest.mark.parametrize("case", PLAIN, ids=[c[0] for c in PLAIN])
def test_plain_attention_gives_each_querys_log_sum_exp_with_the_same_output(case, name, call_work, monkeypatch):
    """``with_lse`` on the flash path: the output and gradients of the plain call, and per query and
    head the log-sum-exp of its scores over its edges (what DSA's dense stage reads its attention from)."""
    _, edges, _ = case
    use_plan(monkeypatch, call_work)
    edges = EdgeSet(edges.src, edges.dst, edges.n_src, edges.n_dst, edges.stage, edges.q_lens, edges.k_lens)
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 2, 4, requires_grad=True) for n in (edges.n_dst, edges.n_src, edges.n_src))
    backend = get_backend(name)
    out, lse = backend.with_lse(q, k, v, edges)
    torch.testing.assert_close(out, backend(q, k, v, edges), atol=0, rtol=0)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    adj = torch.zeros(edges.n_dst, edges.n_src, dtype=torch.bool)
    adj[edges.dst, edges.src] = True
    assert lse.shape == (edges.n_dst, 2) and not lse.requires_grad
    want = float64_reference(over_keys(adj), q, k, v, weights)
    want.check((out, lse, *torch.autograd.grad((out * weights).sum(), (q, k, v))), "with_lse (out, lse, dq, dk, dv)")
    plain = backend(q, k, v, edges)
    want.check((plain, lse, *torch.autograd.grad((plain * weights).sum(), (q, k, v))), "the plain call")


def test_attention_that_is_not_plain_gives_no_log_sum_exp():
    edges = build_graph(parse_pattern("local:w=3"), None, [9]).edges["dd"]
    q, k, v = (torch.randn(9, 2, 4) for _ in range(3))
    want = dense_forward(edges, q, k, v)
    for name in ("auto", "dense", "dgl"):
        out, lse = get_backend(name).with_lse(q, k, v, edges)
        assert lse is None
        want.check(out, f"{name}.with_lse")


def test_batches_of_one_pattern_and_lengths_share_their_edges_on_an_accelerator():
    """Off the CPU a batch's edges are built and copied once per pattern, stage and lengths (a GPU
    step at 16384 tokens spent more on copying a window's edges than on attending over them); a
    batch of other lengths gets its own, and on the CPU each batch builds its own as before."""
    from gtx.graph.tokens import batch_edges

    pattern = parse_pattern("local:w=3")
    on = [batch_edges(pattern, "ee", lens, lens).to("meta") for lens in ([5, 7], [5, 7], [7, 5])]
    assert on[0].src is on[1].src and on[0].dst is on[1].dst and on[0].src.device.type == "meta"
    assert on[2].src is not on[0].src and on[2].num_edges == on[0].num_edges
    cpu = [batch_edges(pattern, "ee", [5, 7], [5, 7]) for _ in range(2)]
    assert cpu[0].src is not cpu[1].src and torch.equal(cpu[0].src, cpu[1].src)
    assert cpu[0].in_degree() is cpu[1].in_degree()  # planned once per lengths
