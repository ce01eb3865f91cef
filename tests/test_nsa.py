"""nsa computes Native Sparse Attention (arXiv 2502.11089), checked against its definition written out
here in float64, not against fetched code:

- the selected and sliding branches as fla-org/native-sparse-attention's ``naive_nsa`` computes them
  given block indices and gates: per query t, the keys of the listed blocks of s positions that are at
  or before t, one softmax over them; the window is the keys t - w + 1 .. t; o = g_slc o_slc + g_swa o_swa;
- the whole pattern: compressed keys phi(block) for blocks of l keys at stride d, seen by t when the
  block ends at or before t, zeros when none is; importance of a selection block = the compressed
  weights of the compressed blocks overlapping it, summed over a group's heads; the first block and the
  one before the own always chosen, the own block implicit, the best others up to n; gates
  sigmoid(linear(q)).
"""

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import batch_edges, build_graph
from gtx.selection import compressed
from gtx.selection.blocks import TokenBlockSelection, attend_token_blocks
from gtx.testing.float32 import float64_reference


def selected_and_window_by_definition(q, k, v, lens, block_indices, block, window, g_slc, g_swa):
    """naive_nsa's two branches: block_indices (n, H, S) per query, -1 for none; gates (n, H)."""
    out, start = torch.zeros_like(q), 0
    for n in lens:
        for t in range(n):
            for h in range(q.shape[1]):
                qt = q[start + t, h]
                chosen = sorted(
                    {
                        b * block + i
                        for b in block_indices[start + t, h].tolist()
                        if b >= 0
                        for i in range(block)
                        if b * block + i <= t
                    }
                )
                win = list(range(max(0, t - window + 1), t + 1))
                for keys, gate in ((chosen, g_slc), (win, g_swa)):
                    ks, vs = k[start + torch.tensor(keys), h], v[start + torch.tensor(keys), h]
                    out[start + t, h] = out[start + t, h] + gate[start + t, h] * torch.softmax(ks @ qt, 0) @ vs
        start += n
    return out


def random_blocks(lens, heads, block, count, g):
    """Per query and head: its own block and up to count - 1 distinct earlier ones, -1 padded."""
    rows = []
    for n in lens:
        for t in range(n):
            own = t // block
            per_head = []
            for _ in range(heads):
                earlier = torch.randperm(own, generator=g)[: count - 1].tolist() if own else []
                per_head.append([own, *earlier] + [-1] * (count - 1 - len(earlier)))
            rows.append(per_head)
    return torch.tensor(rows)


def grads_of(f):
    """(q, k, v, weights) -> f's output on q, k, v and its gradients under an uneven loss (weights)."""

    def run(q, k, v, weights):
        xs = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())]
        out = f(*xs)
        return out, *torch.autograd.grad((out * weights).sum(), xs)

    return run


@pytest.mark.parametrize(
    "lens, block, count, window, seed",
    [
        ([70], 16, 3, 8, 0),
        ([45, 30, 61], 8, 4, 16, 1),
        ([33], 64, 2, 5, 2),
        ([129, 17], 16, 8, 32, 3),
    ],
)
def test_selected_and_window_branches_equal_naive_nsa_given_blocks_and_gates(lens, block, count, window, seed):
    g = torch.Generator().manual_seed(seed)
    heads, n = 2, sum(lens)
    q, k, v = (torch.randn(n, heads, 16, generator=g) * 0.5 for _ in range(3))
    g_slc, g_swa = torch.rand(n, heads, generator=g), torch.rand(n, heads, generator=g)
    indices = random_blocks(lens, heads, block, count, g)
    own = torch.cat([torch.arange(m) // block for m in lens])
    earlier = indices[..., 1:]
    sel = TokenBlockSelection(block, lens, earlier.clamp_min(0), earlier >= 0)
    assert bool((indices[..., 0] == own[:, None]).all())
    dd = build_graph(parse_pattern("causal"), None, lens).edges["dd"]
    win = batch_edges(parse_pattern(f"local:w={window - 1}"), "dd", lens, lens)
    backend = get_backend("auto")

    def gtx_branches(q, k, v):
        return g_slc[..., None] * attend_token_blocks(q, k, v, dd, sel) + g_swa[..., None] * backend(q, k, v, win)

    def definition(q, k, v):
        return selected_and_window_by_definition(q, k, v, lens, indices, block, window, g_slc.double(), g_swa.double())

    weights = torch.linspace(-1, 1, v.numel()).view_as(v)
    want = float64_reference(grads_of(gtx_branches), q, k, v, weights)
    want.check(grads_of(gtx_branches)(q, k, v, weights), "the selected and window branches")
    want.check_float64(grads_of(definition)(*(x.double() for x in (q, k, v, weights))), "their definition")


def mlp_of_block(phi, block):
    """The paper's phi on one block (l, H, D): per head, the MLP of the block's l keys plus their
    position encodings, flattened -> (H, D)."""
    return phi.mlp((block + phi.pos[:, None, :]).transpose(0, 1).flatten(1))


def nsa_by_definition(module, q, k, v, lens):
    """The whole NSA of one layer, sample by sample, query by query, with ``module``'s parameters."""
    c, heads = module.config, q.shape[1]
    gates = torch.sigmoid(module.gate(q.flatten(1))).view(-1, heads, 3)
    phi = {"k": getattr(module, "phi_k", None), "v": getattr(module, "phi_v", None)}
    out, start = torch.zeros_like(q), 0
    for n in lens:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        m = (n - c.l) // c.d + 1 if n >= c.l else 0
        blocks = {name: [x[i * c.d : i * c.d + c.l] for i in range(m)] for name, x in (("k", ks), ("v", vs))}
        comp = {
            name: [b.mean(0) if phi[name] is None else mlp_of_block(phi[name], b) for b in bl]
            for name, bl in blocks.items()
        }
        for t in range(n):
            seen = [i for i in range(m) if i * c.d + c.l - 1 <= t]
            own = t // c.s
            for h in range(heads):
                qt = qs[t, h]
                o_cmp = torch.zeros_like(qt)
                importance = torch.zeros(own + 1, dtype=q.dtype)
                if seen:
                    p = torch.softmax(torch.stack([comp["k"][i][h] @ qt for i in seen]), 0)
                    o_cmp = sum(p[j] * comp["v"][i][h] for j, i in enumerate(seen))
                for hh in range(h - h % c.g, h - h % c.g + c.g) if seen else ():  # the heads of h's group
                    p = torch.softmax(torch.stack([comp["k"][i][hh] @ qs[t, hh] for i in seen]), 0).detach()
                    for j, i in enumerate(seen):
                        for b in range(own):
                            # compressed block i overlaps block b
                            if b * c.s <= i * c.d + c.l - 1 and i * c.d <= (b + 1) * c.s - 1:
                                importance[b] += p[j]
                forced = {b for b in (0, own - 1) if 0 <= b < own}
                rest = sorted(set(range(own)) - forced, key=lambda b: -float(importance[b]))
                chosen = sorted(forced | set(rest[: max(0, c.n - 1 - len(forced))])) + [own]
                keys = [s for b in chosen for s in range(b * c.s, (b + 1) * c.s) if s <= t]
                o_slc = torch.softmax(ks[keys, h] @ qt, 0) @ vs[keys, h]
                win = list(range(max(0, t - c.w + 1), t + 1))
                o_win = torch.softmax(ks[win, h] @ qt, 0) @ vs[win, h]
                out[start + t, h] = (
                    gates[start + t, h, 0] * o_cmp + gates[start + t, h, 1] * o_slc + gates[start + t, h, 2] * o_win
                )
        start += n
    return out


def test_blocks_of_rows_are_larger_on_an_accelerator_and_still_agree(monkeypatch):
    """Off the CPU the compressed branch's blocks of rows are ``chunk_scale`` times larger (a GPU pays
    its launches per block, whatever its size): here 3x blocks of 16 (choice: 8) rows, a shorter sample
    among them."""
    from gtx.selection import token_tiles as selection

    assert selection.chunk_scale("cpu") == 1 and selection.chunk_scale("meta") == selection.ACCELERATOR_CHUNKS > 1
    monkeypatch.setattr(compressed, "ROWS", 16)
    monkeypatch.setattr(compressed, "CHOICE_ROWS", 8)
    monkeypatch.setattr(compressed, "chunk_scale", lambda device: 3)
    test_nsa_equals_its_definition_on_values_and_every_gradient("nsa:l=6,d=3,s=8,n=5,w=12,g=2", [70, 23, 41], 4)


@pytest.mark.parametrize(
    "spec, lens, heads",
    [
        ("nsa:l=8,d=4,s=8,n=4,w=8,phi=mean", [70], 2),
        ("nsa:l=8,d=4,s=16,n=4,w=5", [50, 37], 2),
        ("nsa:l=6,d=3,s=8,n=5,w=12,g=2", [61, 20], 4),
        ("nsa:l=4,d=4,s=4,n=6,w=4", [40], 2),
        ("nsa:l=8,d=4,s=4,n=5,w=6", [45], 2),  # a compressed block spans 2 or 3 selection blocks
    ],
)
def test_nsa_equals_its_definition_on_values_and_every_gradient(spec, lens, heads):
    torch.manual_seed(0)
    pattern = parse_pattern(spec)
    attention = Attention(get_backend("auto"), pattern, heads, 8)
    for p in attention.parameters():  # away from the start: the position encodings begin at zero
        p.data = torch.randn(p.shape) * 0.3
    reference = Attention(get_backend("dense"), pattern, heads, 8).double()
    reference.load_state_dict(attention.state_dict())
    q, k, v = (torch.randn(sum(lens), heads, 8) for _ in range(3))
    edges = build_graph(pattern, None, lens).edges["dd"]
    weights = torch.linspace(-1, 1, v.numel()).view_as(v)

    def run(nsa, module):  # q, k, v, weights -> the output and the gradients of q, k, v and module's parameters
        def on(q, k, v, weights):
            xs = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())]
            out = nsa(*xs)
            return out, *torch.autograd.grad((out * weights).sum(), [*xs, *module.parameters()])

        return on

    got = run(lambda *xs: attention(*xs, edges), attention.trainable)(q, k, v, weights)
    names = ["q", "k", "v", *(n for n, _ in attention.trainable.named_parameters())]
    for name, a in zip(names, got[1:]):
        assert a.abs().sum() > 0, f"no gradient reaches {name}: phi, the gates and all three branches train"
    wide = copy.deepcopy(attention).double()
    want = float64_reference(run(lambda *xs: wide(*xs, edges), wide.trainable), q, k, v, weights)
    outputs = f"the attention, then the gradients of {', '.join(names)}"
    want.check(got, f"nsa ({outputs})")
    definition = run(lambda *ys: nsa_by_definition(reference.trainable, *ys, lens), reference.trainable)
    want.check_float64(definition(*(x.double() for x in (q, k, v, weights))), f"nsa's definition ({outputs})")


def test_a_group_of_heads_shares_one_row_of_the_selection():
    """``g`` heads share one choice: the selection holds a row per group (``group=g``), not a copy per head."""
    import sys

    lens, heads = [40, 17], 4
    attention = Attention(get_backend("auto"), parse_pattern("nsa:l=6,d=3,s=8,n=5,w=12,g=2"), heads, 8)
    module = attention.trainable
    nsa = sys.modules[type(module).__module__]
    q, k = (torch.randn(sum(lens), heads, 8, generator=torch.Generator().manual_seed(i)) for i in range(2))
    kc = module.compress(k, lens, module.phi_k).detach()
    sel = nsa.choose_blocks(q, kc, lens, compressed.block_ends(kc.shape[1], 6, 3, "cpu"), module.config)
    assert sel.group == 2 and sel.blocks.shape == sel.valid.shape == (sum(lens), heads // 2, 4)


@pytest.mark.parametrize("spec", ["nsa:l=8,d=4,s=16,n=4,w=5", "nsa:l=6,d=3,s=8,n=5,w=12,g=2"])
def test_the_compressor_runs_in_overlapping_spans_of_outputs_and_still_agrees(monkeypatch, spec):
    """phi's convolution 3 outputs at a time: spans of rows overlapping by l - d, their gradients added."""
    import sys

    monkeypatch.setattr(sys.modules[parse_pattern("nsa").trainable.__module__], "CONV_OUTPUTS", 3)
    test_nsa_equals_its_definition_on_values_and_every_gradient(spec, [50, 37], 4)


def test_the_compressor_backward_lays_out_one_span_of_rows_at_a_time(monkeypatch, peak_bytes):
    """phi's backward holds one span's channels-first copy of the rows and conv1d's unfolded input
    (l / d times the rows) at a time: 2.2 x-sized tensors here, where the whole sequence's held 3.7."""
    import sys

    nsa = sys.modules[parse_pattern("nsa").trainable.__module__]
    monkeypatch.setattr(nsa, "CONV_OUTPUTS", 16)
    n, heads, dim = 2048, 2, 16
    phi = nsa.Compressor(8, 4, dim)
    x = torch.randn(n, heads, dim, requires_grad=True)
    out = phi(x, [n])
    _, backward = peak_bytes(lambda: out.backward(torch.ones_like(out)))
    assert backward < 3 * x.numel() * x.element_size()


def test_the_compressor_keeps_its_hidden_rows_alone_for_the_backward():
    """Beyond its input and parameters, phi's forward keeps the convolution's output (m, H, 2D) for the
    backward and nothing else: the activation's output and the contiguous copy the linear map made of
    it, kept too, doubled that."""
    import sys

    nsa = sys.modules[parse_pattern("nsa").trainable.__module__]
    n, heads, dim = 1024, 2, 16
    phi = nsa.Compressor(8, 4, dim)
    x = torch.randn(n, heads, dim, requires_grad=True)
    mine = {t.untyped_storage().data_ptr() for t in (x, *phi.parameters())}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in mine:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = phi(x, [n])
    hidden = out.shape[1] * heads * 2 * dim * 4
    assert hidden <= sum(saved.values()) < 1.5 * hidden
    grads = torch.autograd.grad(out.sum(), [x, *phi.parameters()])
    assert all(g is not None for g in grads)


@pytest.mark.parametrize("spec", ["nsa:l=8,d=4,s=8,n=4,w=8,phi=mean", "nsa:l=6,d=3,s=8,n=5,w=12,g=2"])
def test_blocks_of_rows_past_a_shorter_sample_leave_it_out(monkeypatch, spec):
    """Rows in blocks of 16 (choice: 8): the later blocks hold rows of the longer samples only, and score only them."""
    monkeypatch.setattr(compressed, "ROWS", 16)
    monkeypatch.setattr(compressed, "CHOICE_ROWS", 8)
    test_nsa_equals_its_definition_on_values_and_every_gradient(spec, [70, 23, 41], 4)


def test_no_future_key_reaches_a_query_through_any_branch():
    torch.manual_seed(2)
    pattern = parse_pattern("nsa:l=8,d=4,s=8,n=4,w=6")
    attention = Attention(get_backend("auto"), pattern, 2, 8)
    n = 50
    q, k, v = (torch.randn(n, 2, 8, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, build_graph(pattern, None, [n]).edges["dd"])
    for t in (0, 7, 20, 33):
        dk, dv = torch.autograd.grad(out[t].sum(), [k, v], retain_graph=True)
        assert dk[t + 1 :].abs().max() == 0 and dv[t + 1 :].abs().max() == 0, t


def test_each_layer_has_its_own_nsa_and_the_results_record_each_branch(tmp_path):
    from gtx.records import results

    args = [
        "run",
        "--task",
        "recall",
        "--model",
        "lm",
        "--pattern",
        "nsa:l=8,d=4,s=16,n=4,w=16",
        "--set",
        "seq_len=96",
        "--set",
        "n_train=16",
        "--set",
        "n_valid=4",
        "--set",
        "n_test=4",
        "--set",
        "layers=2",
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
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = results.load(tmp_path)
    metrics = json.loads(rows[rows.split == "train"].metrics.iloc[0])
    assert {"kept_compressed", "kept_selected", "kept_window"} <= set(metrics)
    assert 0 < metrics["kept_window"] <= 16 and metrics["kept_selected"] <= 4 * 16
    ckpt = torch.load(next(tmp_path.glob("checkpoints/*/last.pt")), weights_only=False)["model"]
    assert {key.split(".trainable.")[0] for key in ckpt if ".trainable." in key} == {
        "layer_attention.0",
        "layer_attention.1",
    }
    drawn = CliRunner().invoke(
        cli, ["plot", "attention", rows.run_id.iloc[0], "--results", str(tmp_path), "-o", str(tmp_path / "a.png")]
    )
    assert drawn.exit_code == 2 and "cannot be recorded" in drawn.output and not (tmp_path / "a.png").exists()
    # other block sizes shape the compression otherwise: named, with the run's values, not torch's header line alone
    other = CliRunner().invoke(
        cli, ["eval", rows.run_id.iloc[0], "--results", str(tmp_path), "--pattern", "nsa:l=16,d=8,s=16,n=4,w=16"]
    )
    assert other.exit_code == 2 and len(other.output.strip().splitlines()) == 1, other.output
    assert "learned under 'nsa:l=8,d=4,s=16,n=4,w=16," in other.output
    assert "l=16 (the run's 8), d=8 (the run's 4) (layer_attention.0.trainable." in other.output
    assert len(results.load(tmp_path)) == len(rows)  # no eval rows


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nsa:l=8,d=16", "stride d=16 is larger than the compression block l=8"),
        ("nsa:n=3", "n=3: n counts the selected blocks including the first and the two local ones"),
        ("nsa:phi=max", "phi='max': choose mlp"),
        (
            "nsa:s=100000",
            "s=100000: blocks of that many positions on sequences of 63 tokens are padding; choose at most 126",
        ),
        ("nsa:l=5000,d=16", "l=5000: blocks of that many positions"),
    ],
)
def test_bad_nsa_settings_are_one_line_and_write_nothing(tmp_path, spec, message):
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
            "--pattern",
            spec,
            "--results",
            str(tmp_path / "r"),
        ],
    )
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "model, pattern",
    [("ut", "nsa:l=4,d=2,s=4,n=4,w=4"), ("transformer", "dsa:k=4,dense=1"), ("lm", "dsa:k=4,dense=0")],
)
def test_every_model_trains_and_decodes_with_a_trainable_pattern(tmp_path, model, pattern):
    task = ["--task", "recall", "--set", "seq_len=48"] if model == "lm" else ["--task", "copy"]
    result = CliRunner().invoke(
        cli,
        [
            "run",
            *task,
            "--model",
            model,
            "--pattern",
            pattern,
            "--set",
            "n_train=16",
            "--set",
            "n_valid=4",
            "--set",
            "n_test=4",
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
    ckpt = torch.load(next(tmp_path.glob("checkpoints/*/last.pt")), weights_only=False)["model"]
    assert any(".trainable." in key for key in ckpt)


def test_the_window_edges_are_shared_by_the_layers_and_kept_for_the_last_few_batches():
    """Both layers of a step read one window edge set, and the pattern keeps those of the last
    WINDOWS batches' lengths only: lengths that vary every batch (recall) must not pile up."""
    import sys

    windows = sys.modules[parse_pattern("nsa").trainable.__module__].WINDOWS
    pattern = parse_pattern("nsa:l=4,d=2,s=4,n=4,w=4")
    pattern._cache.clear()
    layers = [Attention(get_backend("auto"), pattern, 2, 8) for _ in range(2)]
    seen = []
    for n in range(20, 20 + 2 * windows):
        edges = build_graph(pattern, None, [n, 7]).edges["dd"]
        q, k, v = (torch.randn(n + 7, 2, 8) for _ in range(3))
        for layer in layers:
            layer(q, k, v, edges)
            seen.append(id(pattern._cache[("memo", "nsa windows")][("local:w=3", (n, 7), "cpu")][0]))
    assert seen[0::2] == seen[1::2], "each layer built its own window edges"
    assert [key[1] for key in pattern._cache[("memo", "nsa windows")]] == [
        (n, 7) for n in range(20 + windows, 20 + 2 * windows)
    ]


def test_one_layer_saves_for_backward_about_four_outputs_besides_q_k_v():
    """What one nsa layer's forward keeps for its backward, beyond q, k and v themselves, stays near
    its branches' outputs and the compressor's activations (4 q-sized tensors at 1024 tokens): a
    copy of q, k or v more (padded, or laid out for a kernel) would exceed the bound."""
    n, heads, dim = 1024, 4, 32
    pattern = parse_pattern("nsa")
    attention = Attention(get_backend("auto"), pattern, heads, dim).for_layer()
    q, k, v = (torch.randn(n, heads, dim, requires_grad=True) for _ in range(3))
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(q, k, v, build_graph(pattern, None, [n]).edges["dd"])
    assert sum(saved.values()) <= 4.5 * q.numel() * q.element_size()


def test_the_compressed_branch_backward_allocates_gradients_once_not_per_block_of_rows(monkeypatch):
    """Its rows attend a block at a time: the backward's allocations (each block's recomputed scores,
    the gradients) stay near the size of q, where a full-size zeroed gradient of q per block of rows
    (32 blocks here) made them 100 q-sized tensors."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(compressed, "ROWS", 16)
    n, heads, dim = 512, 2, 8
    ends = compressed.block_ends((n - 8) // 4 + 1, 8, 4, "cpu")
    q = torch.randn(n, heads, dim, requires_grad=True)
    kc, vc = (torch.randn(1, len(ends), heads, dim, requires_grad=True) for _ in range(2))
    out = compressed.attend_compressed(q, kc, vc, [n], ends, torch.rand(n, heads, requires_grad=True))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(torch.ones_like(out))
    allocated = sum(max(0, e.self_cpu_memory_usage) for e in prof.events())
    assert allocated < 80 * q.numel() * q.element_size()


def test_the_gated_selected_branch_and_the_window_hold_no_gated_or_contiguous_copy_of_the_gradient(
    monkeypatch, peak_bytes
):
    """Through their backward, the selected branch with its gate (the gate inside its per-part
    weights) holds no more than without one, and the window (blocksparse) reads a gradient in its
    output's layout as it is, where a gated copy of the gradient and a contiguous copy of it held one
    q-sized tensor more each."""
    from gtx.backends import blocksparse
    from gtx.selection import token_tiles as selection

    for module, name, value in ((selection, "BLOCK_ROWS", 4), (selection, "TILES", 4), (selection, "GATE_ROWS", 64)):
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(blocksparse, "CHUNK_KEYS", 256)
    monkeypatch.setattr(blocksparse, "BAND_CHUNK_KEYS", 256)
    n, heads, dim = 1024, 4, 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, heads, dim, requires_grad=True) for _ in range(3))
    size = q.numel() * q.element_size()
    dd = build_graph(parse_pattern("causal"), None, [n]).edges["dd"]
    blocks = torch.stack([torch.arange(n) // 64 - 1, torch.zeros(n, dtype=torch.long)], -1)
    sel = TokenBlockSelection(64, [n], blocks[:, None].expand(-1, heads, -1).clamp_min(0), blocks[:, None] >= 0)
    sel.valid = sel.valid.expand(-1, heads, -1) & (torch.arange(n) >= 128)[:, None, None]
    gate = torch.rand(n, heads, 1, requires_grad=True)
    held = {}
    for gated in (False, True):
        out = attend_token_blocks(q, k, v, dd, sel, gate=gate if gated else None)
        grad = torch.randn_like(out)
        _, held[gated] = peak_bytes(lambda out=out, grad=grad: out.backward(grad))
    assert held[True] < held[False] + 0.25 * size
    window = parse_pattern("local:w=127")
    out = get_backend("blocksparse")(q, k, v, build_graph(window, None, [n]).edges["dd"])
    grad = torch.randn_like(out)
    _, backward = peak_bytes(lambda: out.backward(grad))
    # 6.4 here (dq, dk, dv and the band's k and v padded again); 7.4 with the contiguous copy
    assert backward < 6.9 * size


def test_blocks_of_rows_and_chunks_of_tiles_read_no_value_back_per_block(monkeypatch, value_reads):
    """A value read from a tensor (``int``, ``bool``, ``.item()``) waits for a GPU's queue: the compressed
    branch's blocks of rows and the chosen tiles' chunks are laid out from host lists, not a read each
    (a read per block would be 438 of them in an NSA step of 2 layers at 16384 tokens)."""
    from gtx.selection import token_tiles as selection

    monkeypatch.setattr(selection, "TILES", 2)
    n, heads = 512, 2
    q, k = (torch.randn(n, heads, 8, generator=torch.Generator().manual_seed(0)) for _ in range(2))
    pattern = parse_pattern("moba:b=16,k=3")
    plan = selection.TokenBlockPlan(pattern.select(q, k, build_graph(pattern, None, [n]).edges["dd"]), heads, "cpu")
    ends = compressed.block_ends((n - 8) // 4 + 1, 8, 4, "cpu")
    (chunks, blocks), reads = value_reads(
        lambda: (list(plan.chunks()), list(compressed._row_blocks([n, 300], ends, 16)))
    )
    assert len(chunks) > 30 and len(blocks) == 32
    assert reads == 0
    # the same layout as counting per block
    assert [seen for *_, seen in blocks] == [int((ends <= r1 - 1).sum()) for _, r1, *_ in blocks]
    tile_of_pair = plan.place // plan.block
    assert [(p.start, p.stop) for _, p, _ in chunks] == [
        (int(torch.searchsorted(tile_of_pair, t)), int(torch.searchsorted(tile_of_pair, min(t + 2, plan.n_tiles))))
        for t in range(0, plan.n_tiles, 2)
    ]
