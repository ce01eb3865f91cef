"""The Triton kernels of a ``KeySelection`` (gtx/triton_kernels/keys.py), on the CPU under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where no GPU is): values, every
gradient and the heads' mean weights against the masked softmax written out in float64 and against
the C kernel, for head groups of 1, 2 and all heads, invalid slots, a query with nothing to read,
samples of different lengths, and tiles that split the queries and the slots; and a run whose test
loss is the C kernel's, its backend_plan naming the Triton kernel."""

import json

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx.attention.checks import check_selection
from gtx.cli import cli
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.records import results
from gtx.selection import kernels
from gtx.selection.keys import KeySelection, attend_keys
from gtx.testing.float32 import float64_reference
from tests.test_native import (
    test_attention_over_no_keys_reads_nothing_and_ids_out_of_range_are_an_error as on_no_keys,
)

pytestmark = pytest.mark.skipif(kernels.triton_error() is not None, reason=f"{kernels.triton_error()}")

HEADS = 4


@pytest.fixture(autouse=True)
def on_triton(monkeypatch):
    monkeypatch.setenv("GTX_KERNELS", "triton")
    kernels.take_ran()


def causal_selection(lens, group, count, g):
    """Per query and group, ``count`` slots of keys at or before the query in its own sample (repeats
    allowed), about a third invalid, and query 2 with none valid."""
    starts = torch.repeat_interleave(torch.cumsum(torch.tensor([0, *lens[:-1]]), 0), torch.tensor(lens))
    n = sum(lens)
    before = (torch.arange(n) - starts + 1)[:, None, None]  # keys a query may read
    keys = starts[:, None, None] + (torch.rand(n, HEADS // group, count, generator=g) * before).long()
    valid = torch.rand(n, HEADS // group, count, generator=g) > 0.3
    valid[2] = False
    return KeySelection(keys, valid, group)


def inputs(n, dims, dtype, g):
    """q (scaled, as attention's: scores of order 1), k, v; rounded to ``dtype`` and back, so that the
    float64 reference sees the values the kernel reads."""
    d, e = dims
    return [(torch.randn(n, HEADS, x, generator=g) * s).to(dtype) for x, s in ((d, d**-0.5), (d, 1.0), (e, 1.0))]


def reference(q, k, v, sel):
    """In float64: per query and head the softmax of q . k over the valid slots of its group's row (a
    query with none: output 0), times v; and the weights averaged over the heads, (n, K)."""
    q, k, v = (x.double() for x in (q, k, v))
    ids, ok = (x.repeat_interleave(sel.group, 1) for x in (sel.keys.long(), sel.valid))  # (n, H, K)
    heads = torch.arange(q.shape[1])[None, :, None]
    s = torch.einsum("nhd,nhkd->nhk", q, k[ids, heads])
    has = ok.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~ok, float("-inf")).masked_fill(~has, 0.0), -1).masked_fill(~ok, 0.0)
    return torch.einsum("nhk,nhke->nhe", p, v[ids, heads]), p.mean(1)


def values_and_grads(attend, q, k, v, weights):
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, mean_p = attend(*xs)
    return [out.detach(), mean_p.detach(), *torch.autograd.grad((out * weights.to(out.dtype)).sum(), xs)]


def check(lens, group, count, dims, dtype, seed, tolerance):
    """The Triton path's output, mean weights and gradients against the float64 reference: within
    ``tolerance`` (atol and rtol), or where it is a number, within that share of each one's largest
    value."""
    g = torch.Generator().manual_seed(seed)
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"]
    sel = causal_selection(lens, group, count, g)
    check_selection("triton", sel, edges, HEADS)
    q, k, v = inputs(sum(lens), dims, dtype, g)
    weights = torch.randn(sum(lens), HEADS, dims[1], generator=g)
    got = values_and_grads(lambda *x: attend_keys(*x, edges, sel, probs=True), q, k, v, weights)
    want = values_and_grads(lambda *x: reference(*x, sel), *(x.double() for x in (q, k, v)), weights.double())
    assert kernels.take_ran() == {"dd": {"triton:keys": 1}}
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert [x.dtype for x in got[2:]] == [dtype] * 3
    for name, a, b in zip(("out", "mean_p", "dq", "dk", "dv"), got, want):
        bound = tolerance if isinstance(tolerance, dict) else {"atol": tolerance * float(b.abs().max()), "rtol": 0.0}
        torch.testing.assert_close(a.double(), b.double(), **bound, msg=lambda m, name=name: f"{name}: {m}")
    assert not got[0][2].any() and not got[2][2].any()  # query 2 read nothing: no output, no gradient
    return got


@settings(max_examples=8, deadline=None)
@given(
    lens=st.lists(st.integers(1, 24), min_size=1, max_size=3).filter(lambda lens: sum(lens) > 2),
    group=st.sampled_from([1, 2, HEADS]),
    count=st.integers(1, 8),
    dims=st.sampled_from([(16, 16), (12, 5), (3, 8)]),
    seed=st.integers(0, 100),
)
def test_values_and_gradients_equal_the_masked_softmax_in_float64(lens, group, count, dims, seed):
    check(lens, group, count, dims, torch.float32, seed, {"atol": 2e-5, "rtol": 1e-5})


@pytest.mark.parametrize("dtype, share", [(torch.bfloat16, 2**-6), (torch.float16, 2**-9)])
@pytest.mark.parametrize("group", [1, 2, HEADS])
def test_half_precision_inputs_sum_in_float32(dtype, share, group):
    """Inputs in bfloat16 or float16: outputs and gradients in the inputs' dtype, each within a few of
    its roundings (2^-9 and 2^-12 relative) of the largest value of the float64 reference over the
    same (rounded) inputs (measured: at most 0.7% in bfloat16, 0.05% in float16, a half to a quarter
    of the torch path's errors in the same dtype); the heads' mean weights within float32's."""
    check([20, 7, 30], group, 7, (16, 12), dtype, 0, share)


@pytest.mark.parametrize("sizes", [(16, 1024), (1, 256)])
def test_tiles_that_split_queries_and_slots_give_the_same_results(sizes, monkeypatch):
    """(queries a program, tile elements): 16 queries and tiles of 2 slots (the online softmax across
    tiles; the last program's queries partly past n); one query a program, as compiled for a GPU."""
    from gtx.triton_kernels import keys as triton_keys

    monkeypatch.setitem(triton_keys.SIZES, "interpreted", sizes)
    lens = [20, 7, 30] if sizes[0] > 1 else [9, 4]
    check(lens, 2, 7, (16, 12), torch.float32, 1, {"atol": 2e-5, "rtol": 1e-5})


@pytest.mark.parametrize("group", [1, 2, HEADS])
def test_the_triton_kernels_and_the_c_kernel_each_hold_the_float64_softmax(group, monkeypatch):
    """Each against the masked softmax in float64, within what float32 holds on these inputs, not
    against each other: the order of their float32 sums (the interpreter's, the C kernel's vectors)
    decides their last bits, and it differs between CPUs."""
    g = torch.Generator().manual_seed(2)
    lens = [33, 31]
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"]
    sel = causal_selection(lens, group, 8, g)
    q, k, v = inputs(sum(lens), (16, 16), torch.float32, g)
    weights = torch.randn(sum(lens), HEADS, 16, generator=g)

    def attend(*x):
        return attend_keys(*x, edges, sel, probs=True)

    got = values_and_grads(attend, q, k, v, weights)
    monkeypatch.setenv("GTX_KERNELS", "torch")
    c_kernel = values_and_grads(attend, q, k, v, weights)
    assert kernels.take_ran() == {"dd": {"triton:keys": 1, "c:keys": 1}}
    want = float64_reference(lambda *x: values_and_grads(lambda *y: reference(*y, sel), *x), q, k, v, weights)
    want.check(got, "the Triton kernels")
    want.check(c_kernel, "the C kernel")


def test_no_keys_read_nothing_and_ids_out_of_range_are_an_error(monkeypatch):
    """test_native's case on the Triton kernels (queries over no keys read nothing, ids past the keys
    are an error), and a head group of 2 with no slot valid."""
    on_no_keys(True, monkeypatch)
    assert set(kernels.take_ran()["ed"]) == {"triton:keys"}
    edges = build_graph(parse_pattern("full"), [0], [5]).edges["ed"]
    q, k, v = (torch.randn(n, 2, 8, requires_grad=True) for n in (5, 0, 0))
    none = torch.zeros(5, 1, 4, dtype=torch.bool)  # one row for both heads
    out = attend_keys(q, k, v, edges, KeySelection(none.long(), none, 2))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.shape == (5, 2, 8) and not out.any() and not grads[0].any()
    assert [g.shape for g in grads] == [x.shape for x in (q, k, v)]


RUN = ["run", "--task", "recall", "--model", "lm", "--set", "seq_len=64", "--set", "n_train=64", "--epochs", "1"]
RUN += ["--dim", "32", "--heads", "2", "--dim-ff", "64", "--quiet"]


def run_losses(pattern, tmp_path, monkeypatch, *more):
    """(test loss, backend_plan) of the run with GTX_KERNELS=triton, then with auto (the C kernel here)."""
    out = []
    for kind in ("triton", "auto"):
        monkeypatch.setenv("GTX_KERNELS", kind)
        folder = tmp_path / kind
        result = CliRunner().invoke(cli, [*RUN, *more, "--pattern", pattern, "--results", str(folder)])
        assert result.exit_code == 0, result.output
        rows = results.load(folder)
        test = rows[rows.split == "test"].iloc[0]
        out.append((test.loss, json.loads(test.backend_plan)))
    return out


SHORT = ["--set", "n_valid=16", "--set", "n_test=16"]


def test_a_dsa_run_on_the_triton_kernels_has_the_c_kernels_test_loss(tmp_path, monkeypatch):
    """Short validation and test splits (the interpreter runs every batch's attention): DSA's one
    choice for all heads (a group of them all) and its KL's target, the heads' mean weights."""
    (loss, plan), (want, want_plan) = run_losses("dsa:k=8,dense=0", tmp_path, monkeypatch, *SHORT)
    assert loss == pytest.approx(want, rel=1e-4)
    assert plan["dd"] == {"triton:keys": 2, "triton:index": 2} and want_plan["dd"] == {
        "c:keys": 2,
        "c:index": 2,
    }  # 2 layers, one batch


@pytest.mark.slow
@pytest.mark.parametrize("pattern, more", [("topk:k=4", SHORT), ("topk:k=4", []), ("dsa:k=8,dense=0", [])])
def test_runs_on_the_triton_kernels_have_the_c_kernels_test_loss(pattern, more, tmp_path, monkeypatch):
    """Whole splits too (n_valid and n_test as the task sets them)."""
    (loss, plan), (want, want_plan) = run_losses(pattern, tmp_path, monkeypatch, *more)
    assert loss == pytest.approx(want, rel=1e-4)
    assert "triton:keys" in plan["dd"] and all(name.startswith("triton:") for name in plan["dd"])
    assert "c:keys" in want_plan["dd"] and all(name.startswith("c:") for name in want_plan["dd"])
