"""dsa's indexer at low precision (``index_precision=int8``): index queries and keys quantised per
token to int8 with a float scale (symmetric), the choice ranked by the dequantised scores. It agrees
with float32's choice on nearly every slot; the C kernel (VNNI, or its portable loop) chooses what the
torch path's definition chooses, ties to the later key; the KL stays in float32."""

import pytest
import torch

from gtx import native
from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.errors import PatternError
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.selection import choice, indexer
from gtx.selection.choice import int8_scores, quantised
from gtx.selection.indexer import index_scores, top_indexed
from gtx.testing.float32 import float64_reference

on_kernel = pytest.mark.skipif(native.load("index_kernel") is None, reason="no C compiler: the torch path only")


def causal(lens):
    return build_graph(parse_pattern("causal"), None, lens).edges["dd"]


def torch_path(fn):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "kernel", lambda *_: None)
        return fn()


def sets(keys, valid):
    return keys.long().masked_fill(~valid, -1).sort(-1).values


def test_quantised_rows_are_symmetric_int8_within_half_a_step():
    x = torch.randn(50, 3, 20) * torch.rand(50, 3, 1) * 10
    x[0, 0] = 0.0  # a zero row: scale 0, values 0
    q, scale = quantised(x, 24)
    assert q.dtype == torch.int8 and q.shape == (50, 3, 24) and not q[..., 20:].any()
    assert q.abs().amax(-1)[1:].eq(127).all() and scale[0, 0] == 0 and not q[0, 0].any()
    assert ((q[..., :20].float() * scale[..., None] - x).abs() <= scale[..., None] / 2 * (1 + 1e-5)).all()


def test_int8_scores_are_the_float_formula_on_dequantised_queries_and_keys():
    g = torch.Generator().manual_seed(0)
    iq, w, ik = torch.randn(30, 2, 16, generator=g), torch.randn(30, 2, generator=g), torch.randn(40, 16, generator=g)
    (q8, sq), (k8, sk) = quantised(iq), quantised(ik)

    def formula(q8, sq, w, k8, sk):  # the products of integers and scales exact in float64
        return index_scores(q8 * sq[..., None], w, k8 * sk[:, None])

    float64_reference(formula, q8.float(), sq, w, k8.float(), sk).check(int8_scores(iq, w, ik), "int8 scores")


@pytest.mark.parametrize("n, count, seed", [(1024, 64, 0), (1500, 100, 1)])
def test_the_int8_choice_keeps_float32s_keys_in_at_least_99_percent_of_slots(n, count, seed):
    g = torch.Generator().manual_seed(seed)
    iq, w, ik = torch.randn(n, 2, 32, generator=g), torch.randn(n, 2, generator=g), torch.randn(n, 32, generator=g)
    edges = causal([n])
    (k32, v32), (k8, v8) = (top_indexed(iq, w, ik, edges, count, p) for p in ("float32", "int8"))
    assert torch.equal(v32, v8)
    a, b = sets(k32, v32), sets(k8, v8)
    # shared keys per row: the sorted sets' matches by membership
    shared = sum(len(set(x.tolist()) & set(y.tolist()) - {-1}) for x, y in zip(a, b))
    assert shared / int(v32.sum()) >= 0.99
    assert torch.equal(v8.sum(1), (torch.arange(n) + 1).clamp(max=count))  # first rows keep all they see


def exact_inputs(n, heads, dim, seed):
    """Values in {-127, 0, 127} with a 127 in every row: each scale is 1, each score an exact integer,
    and equal scores are common (the choice's ties to the later key are seen)."""
    g = torch.Generator().manual_seed(seed)
    iq = torch.randint(-1, 2, (n, heads, dim), generator=g).float() * 127
    ik = torch.randint(-1, 2, (n, dim), generator=g).float() * 127
    iq[..., 0], ik[:, 0] = 127.0, 127.0
    return iq, torch.randint(-2, 3, (n, heads), generator=g).float(), ik


@on_kernel
@pytest.mark.parametrize(
    "lens, count, dim, seed",
    [([300], 40, 8, 0), ([3, 200, 57], 16, 6, 1), ([20, 9], 40, 32, 2), ([129, 1], 128, 4, 3)],
)
def test_the_int8_kernel_chooses_what_its_definition_chooses_ties_to_the_later_key(lens, count, dim, seed):
    """Several samples, a dimension that is no multiple of 4 (padded), fewer candidates than k, one-token
    samples and a tile boundary."""
    iq, w, ik = exact_inputs(sum(lens), 2, dim, seed)
    edges = causal(lens)
    keys, valid = top_indexed(iq, w, ik, edges, count, "int8")
    want_keys, want_valid = torch_path(lambda: top_indexed(iq, w, ik, edges, count, "int8"))
    assert keys.dtype == torch.int32 and torch.equal(sets(keys, valid), sets(want_keys, want_valid))
    start = 0
    for n in lens:
        t = torch.arange(n)
        assert torch.equal(valid[start : start + n].sum(1), (t + 1).clamp(max=count))
        start += n


def test_an_unknown_index_precision_is_one_line():
    with pytest.raises(PatternError, match="index_precision=int4: one of float32, int8"):
        parse_pattern("dsa:index_precision=int4")
    iq, w, ik = exact_inputs(4, 1, 4, 0)
    with pytest.raises(ValueError, match="one of float32, int8"):
        top_indexed(iq, w, ik, causal([4]), 2, "fp8")


@pytest.mark.parametrize("spec", ["dsa:k=8,index_heads=2,index_dim=8,dense=0", "dsa:k=16,b=4,index_dim=8,dense=0"])
def test_dsa_chooses_in_int8_and_fits_its_indexer_by_a_float32_kl(spec, monkeypatch):
    """Tokens (the C kernel's choice) and blocks (torch ops): the choice scores in int8, the indexer's
    float32 parameters get the KL's gradients."""
    torch.manual_seed(0)
    pattern = parse_pattern(f"{spec},index_precision=int8")
    attention = Attention(get_backend("auto"), pattern, 2, 8)
    seen = []  # dsa reaches both through the public toolkit, gtx.selection
    for module, name, score in ((indexer, "top_indexed", top_indexed), (choice, "int8_scores", int8_scores)):
        monkeypatch.setattr(module, name, lambda *a, _f=score, _n=name, **k: seen.append((_n, a[5:])) or _f(*a, **k))
    lens = [40, 25]
    q, k, v = (torch.randn(sum(lens), 2, 8) for _ in range(3))
    attention.begin_step(0)
    attention(q, k, v, build_graph(pattern, None, lens).edges["dd"], inputs=torch.randn(sum(lens), 16))
    (kl,) = attention.pending
    assert seen and all(x == ("top_indexed", ("int8",)) or x[0] == "int8_scores" for x in seen)
    grads = torch.autograd.grad(kl, list(attention.trainable.indexer.parameters()))
    assert all(g.dtype == torch.float32 and g.isfinite().all() for g in grads) and any(g.any() for g in grads)
