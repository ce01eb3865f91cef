"""The fused Triton kernels for block selections (gtx/attention/selection/triton_blocks.py and
triton_tiles.py) compute what their definition computes, written out here densely in float64: per
query token and head, a softmax over the keys of its sample at or before it whose block is its own
or one its selection names (a valid slot of its head's group row); NSA's compressed branch, a
softmax over the compressed keys whose blocks end at or before the query. Values and every gradient
(q, k, v, gate), against the definition and against the CPU path, on Triton's interpreter where no
GPU is (tests/conftest.py sets TRITON_INTERPRET=1 there): sizes are small, the interpreter is slow."""

import json

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("triton", reason="the fused selection kernels need triton (pip install triton)")

from gtx.attention.selection import compressed  # noqa: E402
from gtx.attention.selection.blocks import (  # noqa: E402
    BlockSelection,
    TokenBlockSelection,
    attend_blocks,
    attend_token_blocks,
)
from gtx.attention.selection.kernels import take_ran  # noqa: E402
from gtx.graph.spec import parse_pattern  # noqa: E402
from gtx.graph.tokens import build_graph  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton's interpreter


def positions(lens):
    """(sample, position) of each token of samples ``lens`` in a row."""
    sample = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return sample, torch.cat([torch.arange(n) for n in lens])


def definition(q, k, v, mask, gate=None):
    """Softmax attention over ``mask`` (n, H, n keys), float64: (out, weights (n, H, n keys))."""
    q, k, v = (x.double() for x in (q, k, v))
    sees = mask.any(-1, keepdim=True)  # a query that sees no key: zeros (and no NaN in the backward)
    score = torch.einsum("thd,shd->ths", q, k).masked_fill(~(mask | ~sees), float("-inf"))
    weights = score.softmax(-1) * sees
    out = torch.einsum("ths,shd->thd", weights, v)
    return (out if gate is None else out * gate.double()), weights


def token_block_mask(lens, block, blocks, valid, group):
    """(n, H, n): query t of head h sees key s of its sample at or before it, in its own block or in
    a block its group row names in a valid slot."""
    sample, pos = positions(lens)
    rows, ok = (x.cpu().repeat_interleave(group, 1) for x in (blocks, valid))  # (n, H, K)
    kb = pos // block
    earlier = (sample[:, None] == sample[None, :]) & (pos[None, :] <= pos[:, None])
    named = ((rows[..., None] == kb[None, None, None, :]) & ok[..., None]).any(2)  # (n, H, n)
    return earlier[:, None, :] & (named | (kb[None, :] == kb[:, None])[:, None, :])


def random_token_blocks(lens, heads, group, block, slots, seed):
    """Per token and group row up to ``slots`` distinct earlier blocks, about a third of the slots
    empty; an empty slot names a block far past the samples (the kernels must not read it)."""
    g = torch.Generator().manual_seed(seed)
    n, rows = sum(lens), heads // group
    blocks = torch.full((n, rows, slots), 10**6, dtype=torch.long)
    valid = torch.zeros(n, rows, slots, dtype=torch.bool)
    _, pos = positions(lens)
    for t, p in enumerate(pos.tolist()):
        for r in range(rows):
            chosen = torch.randperm(p // block, generator=g)[:slots]
            keep = torch.rand(slots, generator=g) > 0.3
            for j, b in enumerate(chosen.tolist()):
                blocks[t, r, j], valid[t, r, j] = (b, True) if keep[j] else (10**6, False)
    return TokenBlockSelection(block, list(lens), blocks, valid, group)


def run(f, xs, weights):
    """f(*xs) and the gradients of (f(*xs) * weights).sum() for every x, on DEVICE, back on the CPU."""
    xs = [x.to(DEVICE).requires_grad_() for x in xs]
    out = f(*xs)
    extra = ()
    if isinstance(out, tuple):
        out, *extra = out
    grads = torch.autograd.grad((out * weights.to(DEVICE, out.dtype)).sum(), xs)
    return out.detach().cpu(), [g.cpu() for g in grads], [e.cpu() for e in extra]


def inputs(n, heads, dim, seed, dtype=torch.float32, gated=False):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, heads, dim, generator=g).to(dtype) for _ in range(3)]
    if gated:
        xs.append(torch.rand(n, heads, 1, generator=g).to(dtype))
    return xs, torch.randn(n, heads, dim, generator=g).to(dtype)  # in the dtype: the definition weighs the same


def close(got, want, atol, rtol, what):
    for name, a, b in zip(what, got, want):
        torch.testing.assert_close(
            a.double(), b.double(), atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )


def ran(stage="dd"):
    return take_ran().get(stage, {})


@pytest.mark.parametrize(
    "lens, heads, group, block, slots, dim, gated",
    [
        ([29, 18, 9], 2, 1, 4, 3, 16, False),
        ([40, 13], 4, 2, 8, 2, 12, True),  # a head dim padded to 16
        ([37], 4, 4, 4, 3, 5, True),  # one choice for every head (dsa:b)
    ],
)
def test_token_blocks_equal_their_definition_and_the_cpu_path(
    lens, heads, group, block, slots, dim, gated, monkeypatch
):
    sel = random_token_blocks(lens, heads, group, block, slots, seed=dim)
    sel_device = TokenBlockSelection(block, lens, sel.blocks.to(DEVICE), sel.valid.to(DEVICE), group)
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"].to(DEVICE)
    xs, weights = inputs(sum(lens), heads, dim, seed=group, gated=gated)

    def attend(q, k, v, gate=None):
        return attend_token_blocks(q, k, v, edges, sel_device, masses=True, gate=gate)

    ran()
    monkeypatch.setenv("GTX_KERNELS", "triton")
    out, grads, (mass,) = run(attend, xs, weights)
    assert ran() == {"triton:token-blocks": 1}
    mask = token_block_mask(lens, block, sel.blocks, sel.valid, group)
    want, want_grads, _ = run(lambda *x: definition(*x[:3], mask, *x[3:])[0], [x.double() for x in xs], weights)
    names = ["out", "dq", "dk", "dv", "dgate"]
    close([out, *grads], [want, *want_grads], 1e-5, 1e-5, names)
    # each block's share of the softmax, averaged over heads: the own block first, then the slots
    p = definition(*xs[:3], mask)[1]
    sample, pos = positions(lens)
    kb, rows = pos // block, sel.blocks.repeat_interleave(group, 1)
    own = (p * (kb[None, None, :] == kb[:, None, None])).sum(-1)
    slot = (p[:, :, None, :] * (rows[..., None] == kb)).sum(-1) * sel.valid.repeat_interleave(group, 1)
    torch.testing.assert_close(mass.double(), torch.cat([own[..., None], slot], -1).mean(1), atol=1e-6, rtol=1e-5)
    monkeypatch.setenv("GTX_KERNELS", "torch")
    cpu, cpu_grads, (cpu_mass,) = run(attend, xs, weights)
    assert ran() == {f"{'cpu-flash' if DEVICE == 'cpu' else 'torch'}:token-blocks": 1}
    close([out, *grads, mass], [cpu, *cpu_grads, cpu_mass], 1e-5, 1e-5, [*names, "masses"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_blocks_in_half_precision_stay_near_the_definition(dtype, monkeypatch):
    """Inputs in 16 bits, out in their dtype with float32 accumulation: within a few roundings of the
    float64 definition on the same inputs, relative to each tensor's largest value."""
    monkeypatch.setenv("GTX_KERNELS", "triton")
    lens, heads, group = [33, 20], 4, 2
    sel = random_token_blocks(lens, heads, group, 4, 3, seed=7)
    sel_device = TokenBlockSelection(4, lens, sel.blocks.to(DEVICE), sel.valid.to(DEVICE), group)
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"].to(DEVICE)
    xs, weights = inputs(sum(lens), heads, 16, seed=3, dtype=dtype, gated=True)
    xs[0] = (xs[0] * 0.25).to(dtype)  # scaled as a model's queries are (1 / sqrt(16)): scores of order 1
    out, grads, _ = run(lambda *x: attend_token_blocks(*x[:3], edges, sel_device, gate=x[3]), xs, weights)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    mask = token_block_mask(lens, 4, sel.blocks, sel.valid, group)
    want, want_grads, _ = run(lambda *x: definition(*x[:3], mask, x[3])[0], [x.double() for x in xs], weights)
    # of each tensor's largest value: twice the worst seen (bfloat16 7.6e-3 on dk, float16 3.4e-4; their
    # rounding alone is 3.9e-3 and 4.9e-4 of a value)
    bound = 1.5e-2 if dtype == torch.bfloat16 else 1e-3
    for name, a, b in zip(["out", "dq", "dk", "dv", "dgate"], [out, *grads], [want, *want_grads]):
        torch.testing.assert_close(
            a.double(), b, atol=bound * float(b.abs().max()), rtol=0, msg=lambda m, name=name: f"{name}: {m}"
        )


def random_blocks(lens, heads, group, block, slots, seed):
    """A BlockSelection: per sample, group row and query block, its own block in slot 0 and up to
    ``slots - 1`` distinct earlier ones, some slots empty; a short sample's padding blocks choose none."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-max(lens) // block)
    key_blocks = torch.zeros(len(lens), heads // group, n_blocks, slots, dtype=torch.long)
    valid = torch.zeros(key_blocks.shape, dtype=torch.bool)
    key_blocks[..., 0], valid[..., 0] = torch.arange(n_blocks), True
    for b, n in enumerate(lens):
        for r in range(heads // group):
            for i in range(-(-n // block)):
                for j, kb in enumerate(torch.randperm(i, generator=g)[: slots - 1].tolist()):
                    if torch.rand(1, generator=g) > 0.3:
                        key_blocks[b, r, i, 1 + j], valid[b, r, i, 1 + j] = kb, True
    return BlockSelection(block, list(lens), key_blocks, valid, group)


def block_mask(sel: BlockSelection, heads: int):
    """(n, H, n): query t of head h sees key s of its sample at or before it whose block is its own or
    one its query block's row names in a valid slot."""
    sample, pos = positions(sel.lens)
    kb = pos // sel.block
    rows, ok = (x.repeat_interleave(sel.group, 1) for x in (sel.key_blocks, sel.valid))  # (B, H, n_blocks, K)
    named = rows[sample, :, kb]  # (n, H, K): the query's row
    hit = ((named[..., None] == kb) & ok[sample, :, kb][..., None]).any(2)  # (n, H, n)
    earlier = (sample[:, None] == sample[None, :]) & (pos[None, :] <= pos[:, None])
    assert heads == rows.shape[1]
    return earlier[:, None, :] & hit


@pytest.mark.parametrize(
    "lens, heads, group, block, slots", [([23, 9], 2, 1, 4, 3), ([21], 4, 2, 8, 2), ([17, 12], 2, 2, 4, 3)]
)
def test_block_selections_equal_their_definition_and_sdpa(lens, heads, group, block, slots, monkeypatch):
    sel = random_blocks(lens, heads, group, block, slots, seed=block)
    on_device = BlockSelection(block, lens, sel.key_blocks.to(DEVICE), sel.valid.to(DEVICE), group)
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"].to(DEVICE)
    xs, weights = inputs(sum(lens), heads, 12, seed=heads)
    ran()
    monkeypatch.setenv("GTX_KERNELS", "triton")
    out, grads, _ = run(lambda *x: attend_blocks(*x, edges, on_device), xs, weights)
    assert ran() == {"triton:blocks": 1}
    want, want_grads, _ = run(lambda *x: definition(*x, block_mask(sel, heads))[0], [x.double() for x in xs], weights)
    close([out, *grads], [want, *want_grads], 1e-5, 1e-5, ["out", "dq", "dk", "dv"])
    monkeypatch.setenv("GTX_KERNELS", "torch")
    sdpa, sdpa_grads, _ = run(lambda *x: attend_blocks(*x, edges, on_device), xs, weights)
    assert ran() == {"sdpa:blocks": 1}
    close([out, *grads], [sdpa, *sdpa_grads], 1e-5, 1e-5, ["out", "dq", "dk", "dv"])


@pytest.mark.parametrize("weighted", [False, True])
def test_the_compressed_branch_equals_its_definition_and_the_cpu_path(weighted, monkeypatch):
    """A sample shorter than a compressed block (its queries see none: zeros), ragged lengths."""
    lens, heads, size, stride = [30, 5, 19], 2, 6, 3
    m = (max(lens) - size) // stride + 1
    ends = compressed.block_ends(m, size, stride, DEVICE)
    g = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(sum(lens), heads, 8, generator=g),
        *(torch.randn(len(lens), m, heads, 8, generator=g) for _ in "kv"),
    ]
    if weighted:
        xs.append(torch.rand(sum(lens), heads, generator=g))
    weights = torch.randn(sum(lens), heads, 8, generator=g)
    ran()
    monkeypatch.setenv("GTX_KERNELS", "triton")
    out, grads, _ = run(lambda *x: compressed.attend_compressed(*x[:3], lens, ends, *x[3:]), xs, weights)
    assert ran() == {"triton:compressed": 1}
    sample, pos = positions(lens)
    # keys: (B * m) rows of compressed keys; query t sees its sample's blocks that end at or before it
    key_sample = torch.arange(len(lens)).repeat_interleave(m)
    sees = (key_sample[None, :] == sample[:, None]) & (ends.cpu().repeat(len(lens))[None, :] <= pos[:, None])

    def dense(q, kc, vc, w=None):
        keys, values = (x.reshape(-1, heads, x.shape[-1]) for x in (kc, vc))
        return definition(q, keys, values, sees[:, None, :].expand(-1, heads, -1), None if w is None else w[..., None])[
            0
        ]

    want, want_grads, _ = run(dense, [x.double() for x in xs], weights)
    names = ["out", "dq", "dkc", "dvc", "dweight"]
    close([out, *grads], [want, *want_grads], 1e-5, 1e-5, names)
    assert out[sum(lens[:1]) : sum(lens[:2])].abs().max() == 0  # the short sample sees no compressed key
    monkeypatch.setenv("GTX_KERNELS", "torch")
    cpu, cpu_grads, _ = run(lambda *x: compressed.attend_compressed(*x[:3], lens, ends, *x[3:]), xs, weights)
    assert ran() == {"sdpa:compressed": 1}
    close([out, *grads], [cpu, *cpu_grads], 1e-5, 1e-5, names)


def run_cli(tmp_path, name, pattern, monkeypatch, kernels, extra=()):
    from gtx.cli import cli
    from gtx.records import results

    monkeypatch.setenv("GTX_KERNELS", kernels)
    args = ["run", "--task", "recall", "--model", "lm", "--set", "seq_len=64", "--epochs", "1", "--dim", "32"]
    args += ["--heads", "2", "--dim-ff", "64", "--pattern", pattern, "--quiet", *(extra or ("--set", "n_train=64"))]
    result = CliRunner().invoke(cli, [*args, "--results", str(tmp_path / name)])
    assert result.exit_code == 0, result.output
    rows = results.load(tmp_path / name)
    test = rows[rows.split == "test"].iloc[0]
    return test.loss, json.loads(test.backend_plan)["dd"]


def assert_same_run(tmp_path, pattern, monkeypatch, kernels, extra=()):
    """The run on the Triton kernels reaches the torch path's test loss (relative 1e-4), its
    backend_plan naming the kernels that ran."""
    loss, plan = run_cli(tmp_path, "torch", pattern, monkeypatch, "torch", extra)
    triton_loss, triton_plan = run_cli(tmp_path, "triton", pattern, monkeypatch, "triton", extra)
    assert triton_loss == pytest.approx(loss, rel=1e-4)
    assert kernels <= set(triton_plan) and not {k for k in plan if k.startswith("triton:")}


def test_nsa_trains_on_the_triton_kernels_as_on_the_torch_path(tmp_path, monkeypatch):
    """NSA's selected and compressed branches both on Triton; smaller splits than the slow runs below."""
    extra = ("--set", "n_train=16", "--set", "n_valid=4", "--set", "n_test=4")
    kernels = {"triton:token-blocks", "triton:compressed"}
    assert_same_run(tmp_path, "nsa:l=8,d=4,s=8,n=4,w=8", monkeypatch, kernels, extra)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pattern, kernels, extra",
    [
        ("moba:b=8,k=2", {"triton:token-blocks"}, ()),
        # a program per query block and head: small splits (the full ones took 37 minutes on 2 busy cores)
        (
            "moba:b=8,k=2,gate=block",
            {"triton:blocks"},
            ("--set", "n_train=16", "--set", "n_valid=8", "--set", "n_test=8"),
        ),
        ("nsa:l=8,d=4,s=8,n=4,w=8", {"triton:token-blocks", "triton:compressed"}, ()),
        ("nsa:l=8,d=4,s=8,n=4,w=8,g=2", {"triton:token-blocks", "triton:compressed"}, ()),
    ],
)
def test_runs_on_the_triton_kernels_reach_the_torch_paths_test_loss(pattern, kernels, extra, tmp_path, monkeypatch):
    assert_same_run(tmp_path, pattern, monkeypatch, kernels, extra)
