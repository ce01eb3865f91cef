"""Beyond fixed masks: head groups, score biases and content-selected edges agree with the dense
reference on values and gradients, stay within their candidates, and fail one line at a time."""

import copy

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx import native
from gtx.attention.checks import check_selection
from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.errors import PluginError
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import EdgeSet, build_graph
from gtx.selection.blocks import BlockSelection, attend_blocks
from gtx.selection.keys import KeySelection, attend_keys
from gtx.testing.float32 import float64_reference

SPECS = [
    "heads(local:w=1,strided:l=3)",
    "local:w=2+alibi",
    "full+relbias:buckets=8,max_distance=16",
    "topk:k=2",
    "lsh:buckets=4",
    "topk(local:w=3):k=2+alibi",
    "heads(topk:k=2,local:w=1)+relbias:buckets=8,max_distance=16",
    "moba:b=4,k=2",
    "moba:b=4,k=2,gate=block",
    "sinks:s=1,w=2",
    "vslash:v=2,sl=2,last=4,sink=1,local=1",
    "blocktopk:b=2,k=3",
    "quest:p=2,k=1",
]
BACKENDS = ["torch", "dgl", "auto", "blocksparse"]


def inputs(n_q, n_k, heads, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, heads, dim, generator=g, requires_grad=True) for n in (n_q, n_k, n_k)]


def run(attention, q, k, v, edges):
    out = attention(q, k, v, edges)
    params = list(attention.parameters())
    grads = torch.autograd.grad(
        (out * torch.linspace(-1, 1, out.numel()).to(out.dtype).view_as(out)).sum(),
        [q, k, v, *params],
        materialize_grads=True,
    )
    return out, grads


def flat(attention, edges):
    """(q, k, v) -> attention's output and the gradients of q, k, v and its parameters (``run``)."""

    def on(q, k, v):
        out, grads = run(attention, *(x.detach().requires_grad_() for x in (q, k, v)), edges)
        return out, *grads

    return on


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    lens=st.lists(st.integers(1, 11), min_size=1, max_size=3),
    stage=st.sampled_from(["ee", "dd"]),
    heads=st.sampled_from([2, 4]),
    seed=st.integers(0, 10),
)
def test_every_backend_agrees_with_dense_on_values_and_gradients(spec, lens, stage, heads, seed):
    pattern = parse_pattern(spec)
    graph = build_graph(pattern, lens if stage == "ee" else None, lens if stage == "dd" else None)
    edges = graph.edges[stage]
    q, k, v = inputs(edges.n_dst, edges.n_src, heads, seed=seed)
    reference = Attention(get_backend("dense"), pattern, heads)
    for table in reference.parameters():  # learned biases: away from zero, so that their gradients are tested
        table.data = torch.randn(table.shape, generator=torch.Generator().manual_seed(seed))
    want = float64_reference(flat(copy.deepcopy(reference).double(), edges), q, k, v)
    from gtx.backends.blocksparse import BlockSparseBackend

    for backend in [*map(get_backend, ["dense", *BACKENDS]), BlockSparseBackend(4)]:  # blocks of 4: several a sample
        attention = Attention(backend, pattern, heads)
        attention.load_state_dict(reference.state_dict())
        want.check(flat(attention, edges)(q, k, v), f"{spec} on {type(backend).__name__}")


def one_head(edges: EdgeSet, h: int, q, k, v):
    """Dense attention of head h over ``edges``, in float64 (``gtx.testing.float32``)."""
    return float64_reference(
        lambda q, k, v: get_backend("dense")(q, k, v, edges), *(x[:, h : h + 1] for x in (q, k, v))
    )


def explicit_edges(sel: BlockSelection, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The edges a block selection means for one head, listed one by one."""
    src, dst, offset = [], [], 0
    for b, n in enumerate(sel.lens):
        for qi in range(n):
            qb = qi // sel.block
            for slot, kb in enumerate(sel.key_blocks[b, head, qb].tolist()):
                if not sel.valid[b, head, qb, slot]:
                    continue
                for ki in range(kb * sel.block, min((kb + 1) * sel.block, n)):
                    if ki <= qi and (slot == 0 or ki < qb * sel.block):
                        src.append(offset + ki)
                        dst.append(offset + qi)
        offset += n
    order = sorted(range(len(src)), key=lambda i: (dst[i], src[i]))
    return torch.tensor([src[i] for i in order]), torch.tensor([dst[i] for i in order])


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    b=st.integers(1, 6),
    k=st.integers(1, 4),
    seed=st.integers(0, 10),
)
def test_block_gated_moba_is_causal_attention_over_the_blocks_it_names(lens, b, k, seed):
    pattern = parse_pattern(f"moba:b={b},k={k},gate=block")
    edges = build_graph(pattern, None, lens).edges["dd"]
    q, keys, v = inputs(edges.n_dst, edges.n_src, 2, seed=seed)
    sel = pattern.select(q.detach(), keys.detach(), edges)
    assert sel.valid[..., 0].all() and (sel.valid.sum(-1) <= k).all()  # k blocks in all, the own one included
    out = attend_blocks(q, keys, v, edges, sel)
    for h in range(2):
        src, dst = explicit_edges(sel, h)
        assert (src <= dst).all()  # never a future key
        sub = EdgeSet(src, dst, edges.n_src, edges.n_dst, "dd", edges.q_lens, edges.k_lens)
        one_head(sub, h, q, keys, v).check(out[:, h : h + 1], f"head {h}")
    (gq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(gq).all()
    listed = sum(len(explicit_edges(sel, h)[0]) for h in range(2)) / 2
    # the results' edges per query count what was attended, padding left out
    assert sel.edges_per_head() == pytest.approx(listed)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    count=st.integers(1, 6),
    stage=st.sampled_from(["ee", "dd"]),
    seed=st.integers(0, 10),
)
def test_topk_without_edges_is_dense_attention_over_the_keys_it_names(lens, count, stage, seed):
    pattern = parse_pattern(f"topk:k={count}")
    edges = build_graph(pattern, lens if stage == "ee" else None, lens if stage == "dd" else None).edges[stage]
    q, keys, v = inputs(edges.n_dst, edges.n_src, 2, seed=seed)
    sel = pattern.select(q.detach(), keys.detach(), edges)
    assert isinstance(sel, KeySelection) and edges._edges is None  # no edge was listed to choose
    out = attend_keys(q, keys, v, edges, sel)
    keep = sel.as_mask(edges)
    for h in range(2):
        sub = EdgeSet(
            edges.src[keep[:, h]], edges.dst[keep[:, h]], edges.n_src, edges.n_dst, stage, edges.q_lens, edges.k_lens
        )
        one_head(sub, h, q, keys, v).check(out[:, h : h + 1], f"head {h}")
    assert torch.isfinite(torch.autograd.grad(out.sum(), q)[0]).all()


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("on_kernel", [True, False])
def test_a_head_group_reads_as_its_heads_each_given_the_groups_keys(group, on_kernel, monkeypatch):
    """``KeySelection(group=g)``: head h reads row h // g. On the C kernel and on torch ops it equals
    the same choice written out per head (group 1), values, weights and gradients bit for bit, and
    so do its keep mask and keys per query."""
    if not on_kernel:
        monkeypatch.setattr(native, "kernel", lambda *_: None)
    heads, n = 4, 12
    edges = build_graph(parse_pattern("causal"), None, [n]).edges["dd"]
    q, k, v = inputs(n, n, heads)
    g = torch.Generator().manual_seed(1)
    keys = (torch.rand(n, heads // group, 3, generator=g) * torch.arange(1, n + 1)[:, None, None]).long()  # causal
    valid = torch.rand(n, heads // group, 3, generator=g) > 0.3
    grouped = KeySelection(keys, valid, group)
    each = KeySelection(keys.repeat_interleave(group, 1), valid.repeat_interleave(group, 1))
    check_selection("mine", grouped, edges, heads)
    assert torch.equal(grouped.per_query(), each.per_query())
    assert torch.equal(grouped.as_mask(edges), each.as_mask(edges))

    def attend(sel):
        out, mean_p = attend_keys(q, k, v, edges, sel, probs=True)
        return (
            out,
            mean_p,
            *torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v)),
        )

    for a, b in zip(attend(grouped), attend(each)):
        assert torch.equal(a, b)


@settings(max_examples=25, deadline=None)
@given(
    spec=st.sampled_from(["topk:k=1", "topk:k=3", "lsh:buckets=2", "lsh:buckets=6", "topk(local:w=2):k=1"]),
    lens=st.lists(st.integers(2, 12), min_size=1, max_size=3),
    stage=st.sampled_from(["ee", "dd"]),
    seed=st.integers(0, 20),
)
def test_selections_keep_a_subset_of_candidates_and_every_query(spec, lens, stage, seed):
    pattern = parse_pattern(spec)
    edges = build_graph(pattern, lens if stage == "ee" else None, lens if stage == "dd" else None).edges[stage]
    q, k, _ = inputs(edges.n_dst, edges.n_src, 3, seed=seed)
    keep = pattern.select(q.detach(), k.detach(), edges)
    if isinstance(keep, KeySelection):  # complete or causal candidates: chosen without listing edges
        keep = keep.as_mask(edges)
    # a mask over the candidates: a subset by construction
    assert keep.dtype == torch.bool and keep.shape == (
        edges.num_edges,
        3,
    )
    per_query = torch.zeros(edges.n_dst, 3, dtype=torch.long).index_add_(0, edges.dst, keep.long())
    assert (per_query >= 1).all()
    if spec.startswith("topk"):
        k_ = int(spec.split("k=")[1])
        assert (per_query <= k_).all()
        score = (q[edges.dst] * k[edges.src]).sum(-1).detach()
        for qi in range(edges.n_dst):  # the kept edges are each query's best
            mine = edges.dst == qi
            for h in range(3):
                kept, dropped = score[mine & keep[:, h], h], score[mine & ~keep[:, h], h]
                assert not len(dropped) or kept.min() >= dropped.max()


def test_t5_buckets_match_the_reference_formula():
    from importlib import util
    from pathlib import Path

    spec = util.spec_from_file_location("biases", Path(__file__).parent.parent / "patterns" / "biases.py")
    biases = util.module_from_spec(spec)
    spec.loader.exec_module(biases)
    rel = torch.tensor([-200, -20, -9, -1, 0, 1, 5, 8, 100])
    # T5 (bidirectional, 32 buckets, max distance 128): 8 exact buckets per direction, then log-spaced
    assert biases.t5_bucket(rel, True, 32, 128).tolist() == [15, 10, 8, 1, 0, 17, 21, 24, 31]
    assert biases.t5_bucket(rel, False, 32, 128).tolist() == [31, 17, 9, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--pattern", "heads(local:w=8,topk:k=8)", "--heads", "3", "--dim", "33"],
            "splits the heads into 2 groups but the model has 3 heads",
        ),
        (["--pattern", "local+alibi", "--backend", "dgl-seed"], "backend 'dgl-seed' cannot apply score biases"),
        (["--pattern", "local+nope"], "unknown bias 'nope'; known biases: alibi, relbias"),
        (["--pattern", "local|topk:k=2"], "cannot be combined with '|'"),
        (["--pattern", "topk:k=64"], "keeps up to 64 keys per query, but its candidates have at most 63"),
        (["--pattern", "local+alibi+relbias"], "already has the bias 'alibi'"),
    ],
)
def test_bad_patterns_are_one_line(tmp_path, args, message):
    result = CliRunner().invoke(
        cli,
        [
            "run",
            "--task",
            "recall",
            "--model",
            "lm",
            "--set",
            "seq_len=64",
            "--set",
            "n_train=16",
            "--set",
            "n_valid=4",
            "--set",
            "n_test=4",
            "--epochs",
            "1",
            "--quiet",
            "--results",
            str(tmp_path),
            *args,
        ],
    )
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1, (
        result.output
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda e: torch.ones(e.num_edges, 2), "selected torch.float32"),
        (lambda e: torch.ones(e.num_edges, 3, dtype=torch.bool), "expected a bool mask"),
        (lambda e: torch.zeros(e.num_edges, 2, dtype=torch.bool), "left query 0 without an edge in head 0"),
        (lambda e: [True] * e.num_edges, "selected list"),
    ],
)
def test_a_selection_of_the_wrong_kind_names_the_pattern(bad, message):
    from dataclasses import replace

    pattern = replace(parse_pattern("causal"), select=lambda q, k, e: bad(e), spec="mine")
    edges = build_graph(pattern, None, [5]).edges["dd"]
    q, k, v = inputs(5, 5, 2)
    with pytest.raises(PluginError, match=message) as info:
        Attention(get_backend("dense"))(q, k, v, edges)
    assert "pattern 'mine'" in str(info.value)


def test_specs_round_trip_and_list_their_groups():
    for spec in SPECS:
        canonical = parse_pattern(spec).spec
        assert parse_pattern(canonical).spec == canonical
    p = parse_pattern("heads(bigbird:b=2,r=1,local:w=1)+alibi")
    assert [g.spec for g in p.heads] == ["bigbird:b=2,r=1,seed=0", "local:w=1"] and p.bias == ("alibi", ())
    shown = CliRunner().invoke(
        cli, ["show-pattern", "heads(local:w=1,strided:l=3)", "--src-len", "6", "--tgt-len", "4"]
    )
    assert shown.exit_code == 0 and "head group 2 of 2: strided:l=3" in shown.output


def test_lm_trains_with_groups_biases_and_selection_and_checkpoints_the_learned_bias(tmp_path):
    from gtx.records import checkpoint
    from gtx.records.results import load

    spec = "heads(local:w=4,topk:k=4)+relbias:buckets=8,max_distance=32"
    result = CliRunner().invoke(
        cli,
        [
            "run",
            "--task",
            "recall",
            "--model",
            "lm",
            "--pattern",
            spec,
            "--set",
            "seq_len=64",
            "--set",
            "n_train=32",
            "--set",
            "n_valid=8",
            "--set",
            "n_test=8",
            "--dim",
            "16",
            "--heads",
            "2",
            "--dim-ff",
            "16",
            "--epochs",
            "1",
            "--quiet",
            "--results",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    df = load(tmp_path)
    state = checkpoint.load(checkpoint.checkpoint_dir(tmp_path, df.run_id.iloc[0]) / checkpoint.LAST)
    tables = [k for k in state["model"] if "biases" in k]
    assert tables and any(state["model"][k].abs().sum() > 0 for k in tables)  # trained, saved
    valid = df[df.split == "valid"].iloc[0]
    assert 2 < valid.edges_per_query_dd < 5  # the mean over groups of at most 4+1 and 4 selected keys


def test_hook_register_biases(plugin_dir, tmp_path):
    folder = plugin_dir(
        sinks='''
        import torch
        from gtx import hookimpl

        class Sinks(torch.nn.Module):
            """Sinks: a learned extra score for attending to the first n positions."""

            def __init__(self, heads: int, n: int = 4):
                super().__init__()
                self.n, self.score = n, torch.nn.Parameter(torch.ones(heads))

            def forward(self, q_pos, k_pos, stage, heads):
                return (k_pos < self.n).float()[:, None] * self.score[heads]

        @hookimpl
        def register_biases(register):
            register("sinks", Sinks)
    '''
    )
    listed = CliRunner().invoke(cli, ["patterns", "--plugins-dir", str(folder)])
    assert "sinks" in listed.output and "n: int = 4" in listed.output
    pattern = parse_pattern("local:w=2+sinks:n=2")
    edges = build_graph(pattern, [9], None).edges["ee"]
    q, k, v = inputs(9, 9, 2)
    got = flat(Attention(get_backend("torch"), pattern, 2), edges)(q, k, v)
    assert got[4].abs().sum() > 0  # the learned score trains
    float64_reference(flat(Attention(get_backend("dense"), pattern, 2).double(), edges), q, k, v).check(got, "sinks")


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            lambda e: KeySelection(torch.full((e.n_dst, 2, 1), 4), torch.ones(e.n_dst, 2, 1, dtype=torch.bool)),
            "key 4 for query 0 in head 0",
        ),
        (
            lambda e: KeySelection(torch.zeros(e.n_dst, 2, 1), torch.ones(e.n_dst, 2, 1, dtype=torch.bool)),
            "expected (5, 2, K) int64 or int32 / bool",
        ),
        (
            lambda e: KeySelection(
                torch.zeros(e.n_dst, 2, 1, dtype=torch.long), torch.ones(e.n_dst, 2, 1, dtype=torch.bool), 2
            ),
            "expected (5, 1, K) int64 or int32 / bool (2 heads in groups of 2)",
        ),
        (
            lambda e: KeySelection(
                torch.zeros(e.n_dst, 1, 1, dtype=torch.long), torch.ones(e.n_dst, 1, 1, dtype=torch.bool), 3
            ),
            "a head group of 3",
        ),
        (
            lambda e: KeySelection(torch.full((e.n_dst, 1, 1), 4), torch.ones(e.n_dst, 1, 1, dtype=torch.bool), 2),
            "key 4 for query 0 in heads 0..1",
        ),
        (
            lambda e: BlockSelection(
                2, [5], torch.tensor([[[[0, 1], [1, 2], [2, 0]]] * 2]), torch.ones(1, 2, 3, 2, dtype=torch.bool)
            ),
            "a later block",
        ),
    ],
)
def test_a_selection_outside_its_causal_candidates_is_named(bad, message):
    from dataclasses import replace

    pattern = replace(parse_pattern("causal"), select=lambda q, k, e: bad(e), spec="mine")
    edges = build_graph(pattern, None, [5]).edges["dd"]
    q, k, v = inputs(5, 5, 2)
    with pytest.raises(PluginError, match="pattern 'mine' selected") as info:
        Attention(get_backend("dense"))(q, k, v, edges)
    assert message in str(info.value)


def test_ties_rank_the_later_index_first_on_every_device():
    """Block choices (nsa, dsa:b) break equal scores alike on every device: topk's order for ties
    differs between the CPU and CUDA, and zero scores (unscored blocks, ReLU'd index scores) are common."""
    from gtx.selection.choice import top_later_first

    score = torch.tensor([[0.0, 2.0, 0.0, 0.0, float("-inf")], [1.0, 1.0, 1.0, 3.0, 1.0]])
    values, indices = top_later_first(score, 3)
    assert indices.tolist() == [[1, 3, 2], [3, 4, 2]]
    assert values.tolist() == [[2.0, 0.0, 0.0], [3.0, 1.0, 1.0]]
    assert top_later_first(score, 9)[1].shape == (2, 5)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e-30, -1e-30, float("inf"), float("-inf")]),
        min_size=1,
        max_size=24,
    ),
    rows=st.integers(1, 3),
    count=st.integers(1, 30),
    bf16=st.booleans(),
    every_row=st.booleans(),
)
def test_top_later_first_is_a_stable_sort_of_the_reversed_scores(values, rows, count, bf16, every_row):
    """The definition, tie-heavy: equal scores (-0 equal to +0, infinities) rank the later index first;
    alike where tied rows are picked out (the CPU's default) or every row is decided (elsewhere)."""
    from gtx.selection.choice import top_later_first

    score = torch.stack([torch.tensor(values).roll(r) for r in range(rows)])  # rows of the same values, shifted
    score = score.bfloat16() if bf16 else score
    sorted_values, order = score.flip(-1).sort(dim=-1, descending=True, stable=True)
    width = min(count, score.shape[-1])
    values_got, indices = top_later_first(score, count, every_row)
    assert torch.equal(indices, score.shape[-1] - 1 - order[:, :width])
    assert torch.equal(values_got, sorted_values[:, :width])


def test_top_later_first_deciding_every_row_reads_no_value_back(value_reads):
    """Off the CPU every row is decided by its keys: tied rows are not picked out by a mask, which reads
    the mask back (bfloat16 scores tie often on a GPU)."""
    from gtx.selection.choice import top_later_first

    score = torch.tensor(
        [[0.0, 1.0, 1.0, 1.0, 0.5], [3.0, 2.0, 1.0, 0.0, -1.0]]
    ).bfloat16()  # row 0 tied at its last place
    (every, reads), (picked, picked_reads) = (
        value_reads(lambda f=f: top_later_first(score, 2, f)) for f in (True, False)
    )
    assert reads == 0 and picked_reads > 0
    assert all(torch.equal(a, b) for a, b in zip(every, picked)) and every[1].tolist() == [[3, 2], [0, 1]]


def test_the_key_attention_blocks_are_larger_off_the_cpu_and_any_block_agrees(monkeypatch):
    """The torch path runs blocks of query rows of ``_CHUNK`` gathered elements on the CPU and 8x that
    elsewhere (a GPU pays its launches per block); one row a block or all rows in one give the same
    output, log-sum-exp and gradients."""
    from gtx.selection import keys

    blocks = [len(list(keys._blocks(4096, 4, 64, 32, torch.device(d)))) for d in ("cpu", "meta")]
    assert blocks == [16, 2]  # 256 rows a block on the CPU, 2048 elsewhere
    g = torch.Generator().manual_seed(0)
    n, heads, dim, count = 40, 2, 8, 5
    q, k, v, grad = (torch.randn(n, heads, dim, generator=g) for _ in range(4))
    ids = torch.randint(0, n, (n, heads, count), generator=g)
    valid = torch.rand(n, heads, count, generator=g) > 0.2

    def run(q, k, v, grad):
        out, lse, mean_p = keys._forward_torch(q, k, v, ids, valid)
        return out, lse, mean_p, *keys._backward_torch(q, k, v, ids, valid, grad, out, lse)

    want = float64_reference(run, q, k, v, grad)
    want.check(run(q, k, v, grad), "blocks of 256 rows")
    monkeypatch.setattr(keys, "_CHUNK", 1)  # one row a block
    want.check(run(q, k, v, grad), "one row a block")


def test_the_key_attention_backward_takes_inputs_of_any_strides():
    """The plain-torch backward of attention over kept keys adds into flat views of its gradients:
    keys laid out (H, n, D) and transposed (as a bfloat16 autocast cast leaves them) give the same gradients."""
    from gtx.selection.keys import _backward_torch

    g = torch.Generator().manual_seed(0)
    n, heads, dim, count = 12, 2, 8, 3
    q, v, grad, out = (torch.randn(n, heads, dim, generator=g) for _ in range(4))
    k = torch.randn(heads, n, dim, generator=g).transpose(0, 1)
    keys = torch.randint(0, n, (n, heads, count), generator=g)
    valid = torch.rand(n, heads, count, generator=g) > 0.2
    lse = torch.randn(n, heads, generator=g)

    def backward(q, k, v, grad, out, lse):
        return _backward_torch(q, k, v, keys, valid, grad, out, lse)

    want = float64_reference(backward, q, k.contiguous(), v, grad, out, lse)
    want.check(backward(q, k, v, grad, out, lse), "keys transposed")
    want.check(backward(q, k.contiguous(), v, grad, out, lse), "keys contiguous")
