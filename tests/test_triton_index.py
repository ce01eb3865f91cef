"""The lightning indexer's Triton kernels (gtx/triton_kernels/index.py) under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where no GPU is): the choice keeps the torch
path's keys, best first, equal scores preferring the later key, over samples of different lengths
with causal or complete candidates; the sparse KL's value and gradients equal the torch path's in
float64; and DSA on the Triton kernels equals DSA written out in float64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kit import on_torch

from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.selection import kernels
from gtx.selection.indexer import index_kl, index_scores, top_indexed
from tests.test_dsa import test_dsa_equals_its_definition_indexer_choice_values_gradients_and_kl as dsa_as_defined

pytestmark = pytest.mark.skipif(kernels.triton_error() is not None, reason=f"{kernels.triton_error()}")


@pytest.fixture(autouse=True)
def on_triton(monkeypatch):
    monkeypatch.setenv("GTX_KERNELS", "triton")
    kernels.take_ran()


def indexer_inputs(n, heads, dim, seed, dtype=torch.float32):
    """Small integers: every score is exact in float32, so both paths see the same ties (many)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-1, 2, (n, heads, dim), generator=g).to(dtype),
        torch.randint(-2, 3, (n, heads), generator=g).to(dtype),
        torch.randint(-1, 2, (n, dim), generator=g).to(dtype),
    )


def candidates(lens, stage):
    return build_graph(parse_pattern("full" if stage == "ee" else "causal"), lens, lens).edges[stage]


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    count=st.integers(1, 40),
    heads=st.sampled_from([1, 3]),
    stage=st.sampled_from(["ee", "dd"]),
    seed=st.integers(0, 100),
)
def test_the_choice_keeps_the_torch_paths_keys_best_first_ties_to_the_later_one(lens, count, heads, stage, seed):
    iq, w, ik = indexer_inputs(sum(lens), heads, 5, seed)
    edges = candidates(lens, stage)
    kernels.take_ran()  # each example's own
    keys, valid = top_indexed(iq, w, ik, edges, count)
    assert kernels.take_ran() == {stage: {"triton:index": 1}} and keys.dtype == torch.int32
    want_keys, want_valid = on_torch(lambda: top_indexed(iq, w, ik, edges, count))
    assert torch.equal(valid, want_valid)  # valid slots first, as many
    assert torch.equal(
        keys.long().masked_fill(~valid, -1).sort(-1).values, want_keys.masked_fill(~valid, -1).sort(-1).values
    )
    assert not keys.masked_fill(valid, 0).any()  # invalid slots hold key 0
    score = index_scores(iq, w, ik)  # (n, n): small here
    kept = score.gather(1, keys.long()).masked_fill(~valid, float("-inf"))
    assert (kept[:, :-1] >= kept[:, 1:]).all()  # best first


def test_a_choice_past_the_kernels_sizes_runs_on_the_other_paths():
    """512 kept of 64 dims is a tile of keys past ``KEY_TILE``: the C kernel (here) chooses."""
    iq, w, ik = indexer_inputs(40, 2, 64, 0)
    top_indexed(iq, w, ik, candidates([40], "dd"), 300)
    assert kernels.take_ran() == {"dd": {"c:index": 1}}


@pytest.mark.parametrize("lens, count", [([70], 8), ([13, 40, 1], 5)])
def test_the_sparse_kl_equals_the_torch_path_in_float64_values_and_gradients(lens, count):
    g = torch.Generator().manual_seed(0)
    n = sum(lens)
    iq, w, ik = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((n, 3, 6), (n, 3), (n, 6)))
    keys, valid = on_torch(lambda: top_indexed(iq, w, ik, candidates(lens, "dd"), count))
    p = torch.softmax(torch.randn(n, count, generator=g, dtype=torch.float64), -1).masked_fill(~valid, 0.0)
    p[3] = 0.0  # a query whose weights are all 0: no loss, no gradient

    def kl():
        xs = [x.clone().requires_grad_() for x in (iq, w, ik)]
        loss = index_kl(p, *xs, keys, valid)
        return [loss, *torch.autograd.grad(loss * 0.5, xs)]

    got, want = kl(), on_torch(kl)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("lens, top, seed", [([33, 50, 9], 5, 1)])
def test_dsa_on_the_triton_kernels_equals_its_definition(lens, top, seed):
    """``tests/test_dsa.py``'s check against DSA written out in float64, on the Triton kernels: the
    choice, the output and q, k, v gradients, the sparse KL and its indexer gradients."""
    dsa_as_defined(lens, top, seed)
    # the float32 run on the Triton kernels; the float64 reference's runs are torch's
    ran = kernels.take_ran()["dd"]
    assert {k: n for k, n in ran.items() if not k.startswith("torch:")} == {"triton:index": 1, "triton:keys": 1}
