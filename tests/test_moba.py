"""moba computes MoBA as its reference code defines it (MoonshotAI/MoBA, moba/moba_naive.py), written
out here from the definition, not copied: per query token t in block i, gate scores q_t . mean(keys of
block j) for the blocks j that end before block i; block i itself always; the k - 1 best others; a
causal mask over the union; softmax over the kept keys. Checked on values and gradients."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.selection.blocks import TokenBlockSelection, attend_token_blocks
from gtx.testing.float32 import float64_reference


def moba_by_definition(q, k, v, lens, block, top):
    """Dense MoBA, sample by sample: q, k, v (n, H, D), q already scaled; returns (n, H, D)."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        n_blocks = -(-n // block)
        # (blocks, H, D)
        means = torch.stack([ks[j * block : (j + 1) * block].float().mean(0) for j in range(n_blocks)])
        # in float32 as gtx's gate, also when the attention runs in float64
        gate = torch.einsum("thd,jhd->htj", qs.float(), means)
        own = torch.arange(n) // block
        # only blocks before the own one compete
        gate = gate.masked_fill(torch.arange(n_blocks)[None, :] >= own[:, None], float("-inf"))
        keep = torch.zeros(gate.shape, dtype=torch.bool)
        if top > 1 and n_blocks > 1:
            best = gate.topk(min(top - 1, n_blocks), dim=-1)
            keep.scatter_(-1, best.indices, best.values > float("-inf"))
        keep |= torch.arange(n_blocks)[None, None, :] == own[None, :, None]  # the own block, always
        mask = keep.repeat_interleave(block, dim=-1)[..., :n] & torch.ones(n, n, dtype=torch.bool).tril()
        scores = torch.einsum("thd,shd->hts", qs, ks).masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out)


def gtx_moba(q, k, v, lens, block, top, backend="dense"):
    pattern = parse_pattern(f"moba:b={block},k={top}")
    edges = build_graph(pattern, None, lens).edges["dd"]
    return Attention(get_backend(backend), pattern, q.shape[1])(q, k, v, edges)


def values_and_grads(f):
    """(q, k, v, weights) -> f(q, k, v) and the gradients of q, k and v under an uneven loss (weights)."""

    def run(q, k, v, weights):
        xs = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())]
        out = f(*xs)
        return out, *torch.autograd.grad((out * weights).sum(), xs)

    return run


def assert_agrees_with_definition(lens, block, top, seed):
    """gtx's moba on seeded random q, k, v (2 heads of 8) equals the definition: its values and gradients
    in float32 within what float32 holds of the definition's in float64 (``gtx.testing.float32``)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lens), 2, 8, generator=g) for _ in range(3))
    weights = torch.linspace(-1, 1, v.numel()).view_as(v)
    want = float64_reference(values_and_grads(lambda *x: moba_by_definition(*x, lens, block, top)), q, k, v, weights)
    want.check(values_and_grads(lambda *x: gtx_moba(*x, lens, block, top))(q, k, v, weights), "moba")


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    block=st.integers(1, 16),
    top=st.integers(1, 6),
    seed=st.integers(0, 100),
)
def test_moba_equals_its_definition_on_values_and_gradients(lens, block, top, seed):
    assert_agrees_with_definition(lens, block, top, seed)


def test_long_ragged_samples_agree_on_every_backend():
    lens, block, top = [300, 131, 257], 32, 4  # ragged last blocks, early tokens with fewer earlier blocks than k - 1
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 2, 16, generator=g) * 0.5 for _ in range(3))
    want = float64_reference(lambda *x: moba_by_definition(*x, lens, block, top), q, k, v)
    for backend in ("dense", "auto", "torch"):
        want.check(gtx_moba(q, k, v, lens, block, top, backend), f"moba on {backend}")


def test_the_choice_is_per_token_not_per_block():
    # one sample, blocks of 4: a key block each query token prefers differently from its block's mean query
    lens = [12]
    q = torch.zeros(12, 1, 2)
    k = torch.zeros(12, 1, 2)
    k[0:4, 0, 0] = 1.0  # block 0 points along x
    k[4:8, 0, 1] = 1.0  # block 1 along y
    q[8, 0, 0], q[9, 0, 1] = 1.0, 1.0  # in block 2: token 8 likes block 0, token 9 block 1
    pattern = parse_pattern("moba:b=4,k=2")
    edges = build_graph(pattern, None, lens).edges["dd"]
    sel = pattern.select(q, k, edges)
    assert isinstance(sel, TokenBlockSelection)
    assert sel.blocks[8, 0, 0] == 0 and sel.blocks[9, 0, 0] == 1
    assert not sel.valid[:4].any() and sel.valid[4:].all()  # block 0 has no earlier block to choose


def test_edges_per_query_count_what_each_token_reads():
    pattern = parse_pattern("moba:b=4,k=2")
    edges = build_graph(pattern, None, [12]).edges["dd"]
    q, k = torch.randn(12, 2, 4), torch.randn(12, 2, 4)
    sel = pattern.select(q, k, edges)
    mask = sel.as_mask(edges)
    assert sel.edges_per_head() == pytest.approx(mask.sum().item() / 2)  # the listed edges are the ones attended


@pytest.mark.parametrize(
    "spec, message",
    [
        ("moba:b=0", "need b >= 1 and k >= 1"),
        ("moba:k=0", "need b >= 1 and k >= 1"),
        ("moba:gate=row", "gate='row': choose token"),
    ],
)
def test_bad_settings_are_one_line(spec, message):
    with pytest.raises(GtxError, match=message):
        parse_pattern(spec)


def test_block_gating_is_the_cheaper_variant_with_the_same_budget():
    token, block = parse_pattern("moba:b=8,k=3"), parse_pattern("moba:b=8,k=3,gate=block")
    assert token.budget == block.budget == 24 and token.spec == "moba:b=8,k=3,gate=token"


def test_listing_the_chosen_edges_gives_the_same_attention():
    # gtx plot attention lists a selection's edges (Attention.list_edges) to record their weights
    pattern = parse_pattern("moba:b=4,k=2")
    edges = build_graph(pattern, None, [13, 6]).edges["dd"]
    q, k, v = (torch.randn(19, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    fast, listed = Attention(get_backend("torch"), pattern, 2), Attention(get_backend("torch"), pattern, 2)
    listed.list_edges = True
    want = float64_reference(lambda *x: fast(*x, edges), q, k, v)
    want.check(fast(q, k, v, edges), "moba")
    want.check(listed(q, k, v, edges), "moba, its edges listed")


def test_many_tiles_run_in_chunks_and_still_agree():
    lens, block, top = [1200, 77], 8, 3  # about 900 tiles of chosen blocks: several chunks of 256
    assert_agrees_with_definition(lens, block, top, 1)


def test_the_plain_torch_tiles_used_off_the_cpu_agree(monkeypatch):
    # SDPA's fused kernel that returns the log-sum-exp exists on the CPU only; other devices run the tiles in torch ops
    monkeypatch.setattr("gtx.selection.token_tiles.FUSED_DEVICES", ())
    lens, block, top = [150, 61], 16, 3
    assert_agrees_with_definition(lens, block, top, 2)


@pytest.mark.parametrize(
    "blocks, valid, lens, message",
    [
        # token 0 names block 1
        (
            [[[1]], [[0]], [[0]]] + [[[0]]] * 3,
            [[[True]]] + [[[False]]] * 5,
            [6],
            "not before the query's own block",
        ),
        # tokens 4, 5 name their own block
        (
            [[[0]]] * 4 + [[[1]]] * 2,
            [[[False]]] * 4 + [[[True]]] * 2,
            [6],
            "not before the query's own block",
        ),
        ([[[0]]] * 6, [[[False]]] * 6, [3, 3], "samples of \\[3, 3\\] tokens"),
        ([[0]] * 6, [[False]] * 6, [6], "expected \\(6, 1, K\\)"),
    ],
)
def test_a_bad_token_block_selection_is_one_line_naming_the_pattern(blocks, valid, lens, message):
    from gtx.attention.checks import check_selection
    from gtx.errors import PluginError

    edges = build_graph(parse_pattern("moba:b=4,k=2"), None, [6]).edges["dd"]
    sel = TokenBlockSelection(4, lens, torch.tensor(blocks), torch.tensor(valid))
    with pytest.raises(PluginError, match=f"pattern 'mine' selected .*{message}") as err:
        check_selection("mine", sel, edges, 1)
    assert "\n" not in str(err.value)
    good = torch.tensor([False] * 4 + [True] * 2)[:, None, None]  # tokens 4, 5 read block 0
    check_selection("mine", TokenBlockSelection(4, [6], torch.zeros(6, 1, 1, dtype=torch.long), good), edges, 1)


@pytest.mark.parametrize("gate", ["token", "block"])
def test_a_budget_of_every_candidate_is_refused(gate):
    from gtx.attention.module import check_budget

    with pytest.raises(GtxError, match="keeps up to 64 keys per query, but its candidates have at most 64"):
        check_budget(parse_pattern(f"moba:b=16,k=4,gate={gate}"), ["dd"], 64)
    check_budget(parse_pattern(f"moba:b=16,k=3,gate={gate}"), ["dd"], 64)


def block_gated_by_definition(q, k, v, lens, block, top):
    """Dense ``gate=block``, sample by sample: query block i chooses once, by its mean query, the top - 1
    earlier blocks by mean key; every query of block i reads them and block i causally. (n, H, D) in and out."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        n_blocks = -(-n // block)
        mean_q, mean_k = (
            torch.stack([x[j * block : (j + 1) * block].float().mean(0) for j in range(n_blocks)]) for x in (qs, ks)
        )
        gate = torch.einsum("ihd,jhd->hij", mean_q, mean_k)  # (H, query block, key block)
        gate = gate.masked_fill(torch.ones(n_blocks, n_blocks, dtype=torch.bool).tril(-1).logical_not(), float("-inf"))
        keep = torch.zeros(gate.shape, dtype=torch.bool)
        if top > 1 and n_blocks > 1:
            best = gate.topk(min(top - 1, n_blocks), dim=-1)
            keep.scatter_(-1, best.indices, best.values > float("-inf"))
        keep |= torch.eye(n_blocks, dtype=torch.bool)  # the own block, always
        mask = (
            keep.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :n, :n]
            & torch.ones(n, n, dtype=torch.bool).tril()
        )
        scores = torch.einsum("thd,shd->hts", qs, ks).masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    block=st.integers(1, 12),
    top=st.integers(1, 5),
    seed=st.integers(0, 100),
)
def test_block_gating_equals_its_definition_on_values_and_gradients(lens, block, top, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lens), 2, 8, generator=g) for _ in range(3))
    pattern = parse_pattern(f"moba:b={block},k={top},gate=block")
    edges = build_graph(pattern, None, lens).edges["dd"]
    weights = torch.linspace(-1, 1, v.numel()).view_as(v)
    got = values_and_grads(lambda *x: Attention(get_backend("auto"), pattern, 2)(*x, edges))(q, k, v, weights)
    definition = values_and_grads(lambda *x: block_gated_by_definition(*x, lens, block, top))
    float64_reference(definition, q, k, v, weights).check(got, "moba, gated per block")


@pytest.mark.parametrize("headroom", [16.0, 0.0])
def test_small_chunks_of_blocks_and_tiles_still_agree(monkeypatch, headroom):
    # the backward runs the own blocks' chunks last first and adds the chosen tiles of each chunk's keys
    # to it: several chunks of each, over samples and heads, check the order; headroom 0 rescales the
    # merged rows at every new maximum, where the default rarely does
    monkeypatch.setattr("gtx.selection.token_tiles._HEADROOM", headroom)
    monkeypatch.setattr("gtx.selection.token_tiles.BLOCK_ROWS", 5)
    monkeypatch.setattr("gtx.selection.token_tiles.TILES", 7)
    assert_agrees_with_definition([130, 45, 61], 8, 3, 3)


def test_the_chosen_blocks_merge_a_chunk_at_a_time(monkeypatch, peak_bytes):
    """Forward and backward hold one chunk's tiles at a time besides the output and the gradients: each
    chunk's partial outputs merge into the output as they come and the gradients go straight to their
    rows, where a buffer of every chosen block's output (4 q-sized here) and block-layout copies of
    the gradients held 6.5 and 7.3 q-sized tensors."""
    monkeypatch.setattr("gtx.selection.token_tiles.BLOCK_ROWS", 16)
    monkeypatch.setattr("gtx.selection.token_tiles.TILES", 16)
    n, heads, dim = 2048, 2, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, dim, generator=g, requires_grad=True) for _ in range(3))
    pattern = parse_pattern("moba:b=16,k=5")
    edges = build_graph(pattern, None, [n]).edges["dd"]
    sel = pattern.select(q.detach(), k.detach(), edges)
    out, forward = peak_bytes(lambda: attend_token_blocks(q, k, v, edges, sel))
    _, backward = peak_bytes(lambda: out.backward(torch.ones_like(out)))
    size = q.numel() * q.element_size()
    assert forward < 4.5 * size and backward < 6.5 * size


def test_chunks_are_larger_on_an_accelerator(monkeypatch):
    """Off the CPU both the own blocks' and the chosen tiles' chunks are ``ACCELERATOR_CHUNKS`` times
    larger (a GPU pays ~20 launches a chunk whatever its size); on the CPU they keep their sizes."""
    from gtx.selection import token_tiles as selection

    monkeypatch.setattr(selection, "BLOCK_ROWS", 2)
    monkeypatch.setattr(selection, "TILES", 2)
    n, heads = 512, 2
    q, k = (torch.randn(n, heads, 8, generator=torch.Generator().manual_seed(0)) for _ in range(2))
    pattern = parse_pattern("moba:b=16,k=3")
    edges = build_graph(pattern, None, [n]).edges["dd"]
    plan = selection.TokenBlockPlan(pattern.select(q, k, edges), heads, "cpu")
    cpu_rows, cpu_chunks = len(plan.block_rows()), len(list(plan.chunks()))
    plan.scale = 4  # what a plan on an accelerator holds (ACCELERATOR_CHUNKS there)
    assert plan.n_rows == 64 and cpu_rows == 32 and len(plan.block_rows()) == 8
    assert len(list(plan.chunks())) == -(-plan.n_tiles // 8) < cpu_chunks == -(-plan.n_tiles // 2)
    assert selection.ACCELERATOR_CHUNKS > 1


def grouped(sel, group):
    """``sel`` with one choice per ``group`` heads: the first head's of each group, shared."""
    from dataclasses import replace

    if isinstance(sel, TokenBlockSelection):
        return replace(sel, blocks=sel.blocks[:, ::group].clone(), valid=sel.valid[:, ::group].clone(), group=group)
    return replace(sel, key_blocks=sel.key_blocks[:, ::group].clone(), valid=sel.valid[:, ::group].clone(), group=group)


@pytest.mark.parametrize("gate", ["token", "block"])
@pytest.mark.parametrize("group", [2, 4])
def test_a_choice_shared_by_a_head_group_is_its_copy_per_head(gate, group):
    """A selection with a row per group of heads (``group``) attends, counts and lists edges as the
    same choice copied to every head of the group: values and gradients equal, bit for bit."""
    from gtx.attention.checks import check_selection
    from gtx.selection.blocks import attend_blocks

    lens, heads = [29, 14], 4
    g = torch.Generator().manual_seed(group)
    q, k, v = (torch.randn(sum(lens), heads, 8, generator=g) for _ in range(3))
    pattern = parse_pattern(f"moba:b=4,k=3,gate={gate}")
    edges = build_graph(pattern, None, lens).edges["dd"]
    shared = grouped(pattern.select(q, k, edges), group)
    copied = shared.per_head()
    assert copied.group == 1 and (copied.valid.shape[1], shared.valid.shape[1]) == (heads, heads // group)
    check_selection("mine", shared, edges, heads)
    attend = attend_token_blocks if gate == "token" else attend_blocks
    weights = torch.linspace(-1, 1, v.numel()).view_as(v)
    got = values_and_grads(lambda *x: attend(*x, edges, shared))(q, k, v, weights)
    want = values_and_grads(lambda *x: attend(*x, edges, copied))(q, k, v, weights)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the output, then each gradient
    assert torch.equal(shared.per_query(), copied.per_query())
    if gate == "token":
        assert torch.equal(shared.as_mask(edges), copied.as_mask(edges))


@pytest.mark.parametrize("gate", ["token", "block"])
def test_a_head_group_that_does_not_fit_the_heads_is_one_line(gate):
    from dataclasses import replace

    from gtx.attention.checks import check_selection
    from gtx.errors import PluginError

    lens = [12]
    q, k = (torch.randn(12, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2))
    pattern = parse_pattern(f"moba:b=4,k=2,gate={gate}")
    edges = build_graph(pattern, None, lens).edges["dd"]
    sel = pattern.select(q, k, edges)
    for bad, message in (
        (replace(grouped(sel, 2), group=3), "groups of 3 heads, which does not divide the 4 heads"),
        (replace(grouped(sel, 2), group=4), "expected \\((12|1), 1,"),
    ):
        with pytest.raises(PluginError, match=f"pattern 'mine' selected .*{message}") as err:
            check_selection("mine", bad, edges, 4)
        assert "\n" not in str(err.value)


def test_the_kernels_that_ran_are_recorded_per_stage(monkeypatch):
    """Each call records the kernel that ran under its stage (a run's backend_plan reports them)."""
    from gtx.selection.blocks import attend_blocks
    from gtx.selection.kernels import take_ran

    monkeypatch.setenv("GTX_KERNELS", "torch")
    q, k, v = (torch.randn(12, 2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    token, block = parse_pattern("moba:b=4,k=2"), parse_pattern("moba:b=4,k=2,gate=block")
    edges = build_graph(token, None, [12]).edges["dd"]
    take_ran()
    attend_token_blocks(q, k, v, edges, token.select(q, k, edges))
    attend_blocks(q, k, v, edges, block.select(q, k, edges))
    monkeypatch.setattr("gtx.selection.token_tiles.FUSED_DEVICES", ())  # as on a GPU without triton
    attend_token_blocks(q, k, v, edges, token.select(q, k, edges))
    assert take_ran() == {"dd": {"cpu-flash:token-blocks": 1, "sdpa:blocks": 1, "torch:token-blocks": 1}}
