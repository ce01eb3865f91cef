"""The C kernels (gtx/attention/keys_kernel.c) compute what their torch paths compute: attention over
selected keys, the top-k choice (the indexer's and topk's) and the indexer's KL loss, values and
gradients; a machine that cannot build them falls back with one logged line."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx.attention import native
from gtx.attention.choice import top_keys
from gtx.attention.indexer import index_kl, top_indexed
from gtx.attention.keys import RANGE_SHIFT, KeySelection, attend_keys
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph

pytestmark = pytest.mark.skipif(native.load("keys_kernel") is None, reason="no C compiler: the torch paths are all there is")


def both_paths(fn):
    """fn() on the C kernels, then on the torch path (the kernels hidden)."""
    got = fn()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "kernel", lambda *_: None)
        return got, fn()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), heads=st.sampled_from([1, 2, 4]), count=st.integers(1, 20), shared=st.booleans(),
       dims=st.sampled_from([(8, 8), (16, 5), (32, 32)]), seed=st.integers(0, 100))  # 32: the kernels' unrolled copy
def test_attention_over_selected_keys_agrees_with_the_torch_path(n, heads, count, shared, dims, seed):
    check_selected_keys(n, n + 3, heads, count, shared, dims, seed)


@pytest.mark.parametrize("shared", [True, False])
def test_attention_over_keys_in_several_ranges_agrees_with_the_torch_path(shared, monkeypatch):
    """The backward's threads own ranges of 2^RANGE_SHIFT keys: 700 keys make three, on two threads."""
    assert 700 > 2 << RANGE_SHIFT
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    check_selected_keys(120, 700, 2, 40, shared, (16, 8), 1)


def check_selected_keys(n, n_keys, heads, count, shared, dims, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, heads, dims[0], generator=g) * dims[0] ** -0.5).requires_grad_()  # scaled, as attention's: scores of order 1
    k = torch.randn(n_keys, heads, dims[0], generator=g, requires_grad=True)
    v = torch.randn(n_keys, heads, dims[1], generator=g, requires_grad=True)
    keys = torch.randint(0, n_keys, (n, 1 if shared else heads, count), generator=g)  # count > 8: runs of 8 slots and a rest
    valid = torch.rand(n, 1 if shared else heads, count, generator=g) > 0.3
    valid[0] = False  # a query with nothing to read: zero output, no gradient
    sel = KeySelection(keys.expand(-1, heads, -1), valid.expand(-1, heads, -1))  # shared: a view with head stride 0
    weights = torch.randn(n, heads, dims[1], generator=g)
    edges = build_graph(parse_pattern("full"), [n], None).edges["ee"]

    def run():
        out, mean_p = attend_keys(q, k, v, edges, sel, probs=True)
        return out, mean_p, *torch.autograd.grad((out * weights).sum(), (q, k, v))

    got, want = both_paths(run)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert (got[0][0] == 0).all()


def indexer_inputs(n, heads, dim, seed):
    """Small integers: every score is exact in float32, so the two paths see the same ties (many)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-1, 2, (n, heads, dim), generator=g).float(), torch.randint(-2, 3, (n, heads), generator=g).float(),
            torch.randint(-1, 2, (n, dim), generator=g).float())


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=3), count=st.integers(1, 40), seed=st.integers(0, 100))
def test_the_indexer_chooses_the_same_keys_ties_to_the_later_one(lens, count, seed):
    iq, w, ik = indexer_inputs(sum(lens), 2, 4, seed)
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"]
    (keys, valid), (want_keys, want_valid) = both_paths(lambda: top_indexed(iq, w, ik, edges, count))
    assert same_sets(keys, valid, want_keys, want_valid)
    start = 0
    for n in lens:  # each query kept min(count, t + 1) of its own sample's earlier keys
        t = torch.arange(n)
        assert torch.equal(valid[start:start + n].sum(1), (t + 1).clamp(max=count))
        chosen = keys[start:start + n]
        assert ((chosen >= start) & (chosen <= start + t[:, None]) | ~valid[start:start + n]).all()
        start += n


def same_sets(keys, valid, want_keys, want_valid) -> bool:
    """The same valid key ids per query (and head), in any order."""
    return torch.equal(keys.long().masked_fill(~valid, -1).sort(-1).values, want_keys.masked_fill(~want_valid, -1).sort(-1).values)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=3), count=st.integers(1, 40), heads=st.sampled_from([1, 3]),
       stage=st.sampled_from(["ee", "dd"]), seed=st.integers(0, 100))
def test_topk_chooses_the_same_keys_per_head_on_the_kernel(lens, count, heads, stage, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(sum(lens), heads, 8, generator=g) for _ in range(2))  # random scores: no ties
    pattern = parse_pattern("full" if stage == "ee" else "causal")
    edges = build_graph(pattern, lens if stage == "ee" else None, lens if stage == "dd" else None).edges[stage]
    (keys, valid), (want_keys, want_valid) = both_paths(lambda: top_keys(q, k, edges, count))
    assert keys.dtype == torch.int32 and keys.shape == want_keys.shape == (sum(lens), heads, count)
    assert same_sets(keys, valid, want_keys, want_valid)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 60), count=st.integers(1, 12), dim=st.sampled_from([5, 8, 32]), seed=st.integers(0, 100))
def test_the_indexer_kl_over_kept_keys_agrees_with_the_torch_path(n, count, dim, seed):
    g = torch.Generator().manual_seed(seed)
    iq, w, ik = (x.requires_grad_() for x in (torch.randn(n, 2, dim, generator=g), torch.randn(n, 2, generator=g),
                                              torch.randn(n + 5, dim, generator=g)))
    keys = torch.randint(0, n + 5, (n, count), generator=g)
    valid = torch.rand(n, count, generator=g) > 0.25
    p = torch.softmax(torch.randn(n, count, generator=g).masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)
    p[:, 0] = p[:, 0] * valid[:, 0]  # a zero target weight: p log p is 0

    def run():
        loss = index_kl(p, iq, w, ik, keys, valid)
        return loss, *torch.autograd.grad(loss * 1.5, (iq, w, ik))

    got, want = both_paths(run)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_a_machine_without_a_compiler_runs_the_torch_path_and_says_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GTX_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger="gtx.attention.native"):
        assert native.load.__wrapped__("keys_kernel") is None
    assert "building keys_kernel failed" in caplog.text and not list(tmp_path.glob("*.so"))
    monkeypatch.setenv("GTX_NATIVE", "0")
    assert native.load.__wrapped__("keys_kernel") is None


def test_a_compiler_without_openmp_builds_the_kernels_whose_parts_then_run_in_turn(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GTX_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "OPENMP", ["-fno-such-openmp-flag"])  # the OpenMP build fails
    with caplog.at_level(logging.WARNING, logger="gtx.attention.native"):
        lib = native.load.__wrapped__("keys_kernel")
    assert lib is not None and "with OpenMP failed" in caplog.text
    monkeypatch.setattr(native, "load", lambda name: lib)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    check_selected_keys(120, 700, 2, 40, True, (32, 32), 3)
