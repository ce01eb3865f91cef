"""dsa computes DeepSeek Sparse Attention, checked against its definition written out here (not the
fetched code): DeepSeek-V3.2-Exp's ``Indexer`` (inference/model.py) scores
I(t, s) = sum_j w(t, j) relu(q(t, j) . k(s)) with q = wq_b(qr_t) in J heads of d from the query
latent qr, k = LayerNorm(wk(x_s)) one per token and w = weights_proj(x_t) J^-1/2 d^-1/2 from the
layer's input x; the first r dimensions of q and k (64 of 128) are turned by the token's position,
as complex numbers of adjacent pairs times exp(i t theta_p), theta_p its YaRN-stretched rotary
frequencies; then q and k pass a Hadamard rotation (orthonormal: dot products unchanged) and FP8
(left out here). gtx's models have no query latent: the attention's queries stand in for it. The
top k earlier tokens (itself included) are kept, equal scores preferring the later token (a relu
makes zeros common); the main attention is a softmax over them. Training
(the V3.2 report): a dense stage in which the indexer fits KL(mean over heads of the dense attention
|| softmax(I)), the model frozen when asked (or by default when the run starts trained), then sparse attention and the KL over the kept tokens."""

import copy
import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner
from kit import on_torch
from paths import both_hold

from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.selection.indexer import index_scores
from gtx.testing.float32 import float64_reference


def published_frequencies(r):
    """DeepSeek-V3.2-Exp's rotary frequencies for r rotated dimensions (its ModelArgs: base 10000,
    and since max_seq_len 16384 > original_seq_len 4096, YaRN with factor 40, beta_fast 32, beta_slow 1)."""
    base, factor, original = 10000.0, 40.0, 4096
    freqs = [base ** (-2 * p / r) for p in range(r // 2)]
    dim_at = [r * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base)) for turns in (32, 1)]
    lo, hi = max(math.floor(dim_at[0]), 0), min(math.ceil(dim_at[1]), r - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = [min(max((p - lo) / (hi - lo), 0.0), 1.0) for p in range(r // 2)]
    return torch.tensor([f * (1 - a) + f / factor * a for f, a in zip(freqs, ramp)], dtype=torch.float64)


def turned(x, r):
    """The reference's rotary: x's first r dimensions as r/2 complex numbers (adjacent pairs), the
    token at position t (x's first axis) times exp(i t theta); the rest untouched."""
    t = torch.arange(len(x), dtype=torch.float64)
    z = torch.polar(torch.ones(len(x), r // 2, dtype=torch.float64), t[:, None] * published_frequencies(r))
    z = z.view(len(x), *[1] * (x.dim() - 2), r // 2)
    pairs = torch.view_as_complex(x[..., :r].double().reshape(*x.shape[:-1], r // 2, 2).contiguous())
    return torch.cat([torch.view_as_real(pairs * z).flatten(-2).to(x.dtype), x[..., r:]], -1)


def hadamard(d):
    """The orthonormal Hadamard matrix of size d (a power of two), as DeepSeek rotates q and k with."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while len(h) < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / d**0.5


def indexer_by_definition(indexer, qr, x):
    """(n, n) index scores of one sample from the formula: index queries from ``qr`` (gtx: the
    attention's queries), keys and weights from the layer's input ``x``."""
    J, d, r = indexer.heads, indexer.dim, indexer.rope
    q = turned(indexer.wq(qr).view(len(qr), J, d), r)
    k = turned(torch.nn.functional.layer_norm(indexer.wk(x), (d,), indexer.k_norm.weight, indexer.k_norm.bias, 1e-6), r)
    if d & (d - 1) == 0:
        q, k = q @ hadamard(d).to(q.dtype).T, k @ hadamard(d).to(k.dtype).T
    w = indexer.weights(x) * J**-0.5 * d**-0.5
    return sum(w[:, j, None] * torch.relu(q[:, j] @ k.T) for j in range(J))


@pytest.mark.parametrize(
    "n, heads, dim, share, seed",
    [(64, 64, 128, 0.5, 0), (300, 4, 32, 0.5, 1), (50, 3, 12, 1 / 3, 2), (20, 2, 8, 0.0, 3)],
)
def test_the_indexer_scores_equal_deepseeks_indexer_with_its_rotary_angles(n, heads, dim, share, seed):
    """DeepSeek's sizes (64 heads of 128, 64 turned), a long sample whose slow pairs turn (YaRN's
    stretch), a share that is not a half, and none turned; float32 against the float64 formula."""
    torch.manual_seed(seed)
    pattern = parse_pattern(f"dsa:k=4,index_heads={heads},index_dim={dim},rope={share:.6f}")
    module = pattern.trainable(2, 24)
    assert module.indexer.rope == round(share * dim)
    with torch.no_grad():
        for p in module.indexer.parameters():
            p.normal_(0.5 if p.dim() == 1 else 0.0, p.shape[-1] ** -0.5)
    qr, x = torch.randn(n, 48), torch.randn(n, 48)
    got = index_scores(*module.indexer(qr, x, torch.arange(n)))
    unturned = index_scores(*module.indexer(qr, x, torch.zeros(n, dtype=torch.long)))
    module.indexer.double()
    definition = float64_reference(lambda qr, x: indexer_by_definition(module.indexer, qr, x), qr, x)
    definition.check(got, "the indexer's scores")
    if share:  # the positions matter: without them the scores are another function
        want = definition.values[0]
        assert (unturned.double() - want).abs().max() > 0.05 * want.abs().max()


def dsa_by_definition(attention, q, k, v, x, lens, top):
    """Per sample: the indexer's top ``top`` earlier tokens per query (from the queries and the
    layer's input ``x``), softmax attention over them, and the sparse KL (mean over queries); the
    kept key sets returned to compare."""
    indexer = attention.trainable.indexer
    out, kls, kept, start = torch.zeros_like(q), [], [], 0
    for n in lens:
        rows = slice(start, start + n)
        score = indexer_by_definition(indexer, q[rows].flatten(1).detach(), x[rows])
        score = score.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        for t in range(n):
            # equal scores: the later key first
            best = sorted(range(t + 1), key=lambda s: (score[t, s].item(), s), reverse=True)[:top]
            keys = torch.tensor(sorted(best))
            kept.append(set(keys.tolist()))
            s = torch.einsum("hd,khd->hk", q[start + t], k[start + keys])
            p = torch.softmax(s, -1)
            out[start + t] = torch.einsum("hk,khd->hd", p, v[start + keys])
            target = p.detach().mean(0)
            kls.append((target * (target.log() - torch.log_softmax(score[t, keys], 0))).sum())
        start += n
    return out, torch.stack(kls).mean(), kept


def twins(spec, lens, seed, heads=2, dim=8):
    """The pattern's attention, a float64 copy with the same parameters on the dense backend, random
    q, k, v and the layer's input they stand for."""
    torch.manual_seed(seed)
    pattern = parse_pattern(spec)
    attention = Attention(get_backend("auto"), pattern, heads, dim)
    reference = Attention(get_backend("dense"), pattern, heads, dim).double()
    reference.load_state_dict(attention.state_dict())
    return (
        pattern,
        attention,
        reference,
        *(torch.randn(sum(lens), heads, dim) for _ in range(3)),
        torch.randn(sum(lens), heads * dim),
    )


@pytest.mark.parametrize("lens, top, seed", [([40], 8, 0), ([33, 50, 9], 5, 1), ([64], 1, 2)])
def test_dsa_equals_its_definition_indexer_choice_values_gradients_and_kl(lens, top, seed):
    pattern, attention, reference, q, k, v, inputs = twins(f"dsa:k={top},index_heads=3,index_dim=4,dense=0", lens, seed)
    edges = build_graph(pattern, None, lens).edges["dd"]
    weights = torch.linspace(-1, 1, v.numel()).view_as(v)
    wide, stats = copy.deepcopy(attention).double(), []

    def run(q, k, v, x, weights):  # gtx's dsa; on the float64 copy where the inputs are float64
        module = wide if q.dtype == torch.float64 else attention
        xs = [y.requires_grad_() for y in (q.clone(), k.clone(), v.clone())]
        module.begin_step(0)
        # the float64 copy is the reference: torch's ops, whatever kernels the float32 run is on
        out = on_torch(lambda: module(*xs, edges, inputs=x)) if module is wide else module(*xs, edges, inputs=x)
        kl, _ = module.take_losses()  # the step's auxiliary loss, as the trainer takes it
        stats.append(module.reset_stats()["kept_selected"])
        # the KL trains the indexer, and only it: its inputs are detached
        return out, *torch.autograd.grad((out * weights).sum(), xs), kl, *grads_of(kl, module.trainable.indexer)

    want = float64_reference(run, q, k, v, inputs, weights)
    want.check(run(q, k, v, inputs, weights), "dsa")
    ys = [x.double().requires_grad_() for x in (q, k, v)]
    out, kl, kept = dsa_by_definition(reference, *ys, inputs.double(), lens, top)
    grads = torch.autograd.grad((out * weights.double()).sum(), ys)
    want.check_float64((out, *grads, kl, *grads_of(kl, reference.trainable.indexer)), "dsa's definition")
    assert sum(len(s) for s in kept) == stats[-1] * sum(lens)


def grads_of(loss, module):
    """The gradients of ``loss`` for ``module``'s parameters."""
    return torch.autograd.grad(loss, list(module.parameters()))


def test_the_dense_stage_is_dense_fits_the_indexer_to_the_dense_attention_and_freezes_the_model():
    torch.manual_seed(3)
    lens, heads, dim = [30, 21], 2, 8
    pattern = parse_pattern("dsa:k=4,index_heads=2,index_dim=4,dense=2,freeze=true")
    attention = Attention(get_backend("auto"), pattern, heads, dim)
    edges = build_graph(pattern, None, lens).edges["dd"]
    q, k, v = (torch.randn(sum(lens), heads, dim) for _ in range(3))
    x = torch.randn(sum(lens), heads * dim)
    attention.begin_step(1)  # the second step: still the dense stage
    out = attention(q, k, v, edges, inputs=x)
    kl, frozen = attention.take_losses()
    assert frozen  # the trainer leaves the model's loss out of this step
    causal = build_graph(parse_pattern("causal"), None, lens).edges["dd"]
    indexer = copy.deepcopy(attention.trainable.indexer).double()

    def definition(q, k, v, x):  # dense attention, and the KL of the indexer's scores to its head mean
        want, start = [], 0
        for n in lens:
            rows = slice(start, start + n)
            score = indexer_by_definition(indexer, q[rows].flatten(1), x[rows])
            later = torch.ones(n, n, dtype=torch.bool).triu(1)
            p = torch.softmax(torch.einsum("thd,shd->hts", q[rows], k[rows]).masked_fill(later, -math.inf), -1).mean(0)
            logq = torch.log_softmax(score.masked_fill(later, -math.inf), -1)
            want.append((p * (p.clamp_min(1e-30).log() - logq.masked_fill(later, 0))).sum(-1))
            start += n
        return get_backend("dense")(q, k, v, causal), torch.cat(want).mean()

    float64_reference(definition, q, k, v, x).check((out, kl), "dsa's dense stage")
    attention.begin_step(2)  # the dense stage over: sparse, and the model trains
    attention(q, k, v, edges, inputs=x)
    assert not attention.take_losses()[1] and "kept_selected" in attention.reset_stats()


@pytest.mark.parametrize(
    "freeze, from_trained, frozen, said",
    [
        ("", False, False, "freeze=false (from scratch)"),  # a frozen random model would learn nothing
        ("", True, True, "freeze=true (a trained start)"),  # DeepSeek's recipe: adapting a trained model
        (",freeze=auto", True, True, "freeze=true (a trained start)"),
        (",freeze=true", False, True, "freeze=true (given)"),  # a value given wins either way
        (",freeze=false", True, False, "freeze=false (given)"),
    ],
)
def test_freeze_follows_the_runs_start_unless_given_and_the_stage_says_which(freeze, from_trained, frozen, said):
    lens, heads, dim = [12], 2, 8
    pattern = parse_pattern(f"dsa:k=4,index_heads=2,index_dim=4,dense=2{freeze}")
    attention = Attention(get_backend("auto"), pattern, heads, dim, from_trained=from_trained)
    edges = build_graph(pattern, None, lens).edges["dd"]
    q, k, v = (torch.randn(sum(lens), heads, dim) for _ in range(3))
    attention.begin_step(0)  # the dense stage
    attention(q, k, v, edges, inputs=torch.randn(sum(lens), heads * dim))
    assert attention.take_losses()[1] is frozen
    assert attention.trainable.describe() == f"dense stage, indexer trained 1 steps, {said}"
    attention.begin_step(2)  # sparse: the model trains whatever freeze says
    attention(q, k, v, edges, inputs=torch.randn(sum(lens), heads * dim))
    assert not attention.take_losses()[1]
    assert attention.trainable.describe() == f"sparse stage, indexer trained 3 steps, {said}"


@pytest.mark.parametrize("freeze, frozen", [(",freeze=true", True), ("", False)])
def test_training_freezes_the_model_during_the_dense_stage_and_a_checkpoint_knows_its_stage(tmp_path, freeze, frozen):
    """Asked to, the dense stage trains the indexer alone; by default a run from scratch trains the model too."""
    from gtx.data.batch import batches
    from gtx.run.build import build_attention, build_model
    from gtx.run.runner import RunConfig, resolve
    from gtx.run.train import Trainer

    config = RunConfig(
        task="recall",
        model="lm",
        pattern=f"dsa:k=8,index_heads=2,index_dim=4,dense=2{freeze}",
        settings={
            "seq_len": "64",
            "n_train": "8",
            "n_valid": "4",
            "n_test": "4",
            "dim": "16",
            "heads": "2",
            "dim_ff": "16",
            "batch_size": "2",
            "max_steps": "2",
        },
        results_dir=str(tmp_path),
    )
    r = resolve(config)
    model = build_model(r, build_attention(r))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = Trainer(model, r.train, 16, r.device, r.task)
    trainer.train_epoch(batches(r.task, "train", r.pattern_run, 2))
    after = model.state_dict()
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    own = {key for key in changed if ".indexer." in key or key.endswith((".steps", ".sparse"))}
    assert own and (changed == own) is frozen, sorted(changed - own)[:5]
    assert int(model.layer_attention[0].trainable.steps) == 2  # two steps trained: the dense stage is over
    model.eval()
    with torch.no_grad():
        model(next(iter(batches(r.task, "valid", r.pattern_run, 2))))
    assert "kept_selected" in model.attention.reset_stats()  # evaluation after the dense stage is sparse


def test_the_results_hold_both_losses_and_a_checkpoint_without_the_indexer_is_refused(tmp_path):
    base = [
        "--task",
        "recall",
        "--model",
        "lm",
        "--set",
        "seq_len=64",
        "--set",
        "n_train=8",
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
        "2",
        "--set",
        "batch_size=4",
        "--quiet",
        "--results",
        str(tmp_path),
    ]
    result = CliRunner().invoke(
        cli, ["run", *base, "--pattern", "dsa:k=8,index_heads=2,index_dim=4,dense=2,freeze=false"]
    )
    assert result.exit_code == 0, result.output
    from gtx.records import results

    rows = results.load(tmp_path)
    train = [json.loads(m) for m in rows[rows.split == "train"].metrics]
    assert "indexer_kl_dense" in train[0] and "indexer_kl_sparse" in train[1]
    wider = CliRunner().invoke(
        cli,
        ["eval", rows.run_id.iloc[0], "--results", str(tmp_path), "--pattern", "dsa:k=8,index_heads=3,index_dim=4"],
    )
    assert wider.exit_code == 2 and len(wider.output.strip().splitlines()) == 1, wider.output
    assert "index_heads=3 (the run's 2)," in wider.output and "(layer_attention.0.trainable.indexer." in wider.output
    local = CliRunner().invoke(cli, ["run", *base, "--pattern", "local:w=8"])
    assert local.exit_code == 0, local.output
    run_id = results.load(tmp_path).query("pattern == 'local:w=8'").run_id.iloc[0]
    refused = CliRunner().invoke(cli, ["eval", run_id, "--results", str(tmp_path), "--pattern", "dsa:k=8"])
    assert refused.exit_code == 2 and "attends with learned parameters that checkpoint" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_results_name_the_rotary_share_and_an_indexer_of_another_definition_is_refused_in_one_line(tmp_path):
    """Rows and checkpoints of the indexer that read the attention's keys and turned nothing had no
    ``rope`` in their pattern and no ``indexer.rotated`` in their state: neither passes for this one."""
    base = [
        "--task",
        "recall",
        "--model",
        "lm",
        "--set",
        "seq_len=48",
        "--set",
        "n_train=4",
        "--set",
        "n_valid=2",
        "--set",
        "n_test=2",
        "--dim",
        "16",
        "--heads",
        "2",
        "--dim-ff",
        "16",
        "--epochs",
        "1",
        "--set",
        "batch_size=4",
        "--quiet",
        "--results",
        str(tmp_path),
    ]
    result = CliRunner().invoke(cli, ["run", *base, "--pattern", "dsa:k=8,index_heads=2,index_dim=4,dense=0"])
    assert result.exit_code == 0, result.output
    from gtx.records import results

    rows = results.load(tmp_path)
    assert set(rows.pattern) == {
        "dsa:k=8,index_heads=2,index_dim=4,rope=0.5,dense=0,freeze=auto,b=1,index_precision=float32"
    }
    assert set(rows.definitions) == {'{"dsa": 2}'}  # the definition the refusals below name, recorded in every row
    run_id = rows.run_id.iloc[0]
    path = next(tmp_path.glob("checkpoints/*/best.pt"))  # what gtx eval reads
    state = torch.load(path, weights_only=False)
    good = dict(state["model"])
    for edit, why in [
        ({}, "under definition 1 (index keys from the attention's keys, nothing turned"),
        ({"rotated": 4}, "turning 4 index"),
    ]:
        model = {key: value for key, value in good.items() if not key.endswith(".indexer.rotated")}
        model.update({key: torch.tensor(v) for key in good if key.endswith(".indexer.rotated") for v in edit.values()})
        torch.save({**state, "model": model}, path)
        refused = CliRunner().invoke(cli, ["eval", run_id, "--results", str(tmp_path)])
        assert refused.exit_code == 2 and why in refused.output and len(refused.output.strip().splitlines()) == 1, (
            refused.output
        )
        assert len(results.load(tmp_path)) == len(rows)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dsa:k=0", "dsa keeps k >= 1 tokens per query"),
        ("dsa:k=2000", "keeps up to 2000 keys per query"),
        ("dsa:k=24,b=16", "k (keys read) must be a multiple of b"),
        ("dsa:k=16,b=16", "at least 2b"),
        # the dense stage's old name, the learning rate warm-up's (--set warmup): refused with the new spelling
        ("dsa:k=8,warmup=5", "pattern 'dsa' has no parameter 'warmup': it is named 'dense' now; write dsa:dense=5"),
        ("dsa:freeze=1", "write freeze=auto (frozen in the dense stage when the run starts from a trained model)"),
    ],
)
def test_bad_dsa_settings_are_one_line_and_write_nothing(tmp_path, spec, message):
    result = CliRunner().invoke(
        cli, ["run", "--task", "recall", "--model", "lm", "--pattern", spec, "--results", str(tmp_path / "r")]
    )
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def blocks_by_definition(attention, q, k, v, x, lens, top, size, chosen_by):
    """``dsa:b=size``, per sample from the formula: a block's index key is the mean of its tokens', a
    token reads its own block (up to itself) and the ``top / size - 1`` earlier blocks it scores
    highest; softmax attention over those keys; the sparse KL over block masses (mean over queries),
    and the dense stage's KL over every block up to the token's own. Scores tie often (a relu of a
    negative dot is 0), so the blocks are ``chosen_by(token)``, checked here to be a top set."""
    indexer = attention.trainable.indexer
    out, sparse, dense, start = torch.zeros_like(q), [], [], 0
    for n in lens:
        rows = slice(start, start + n)
        J, d, r = indexer.heads, indexer.dim, indexer.rope
        iq, w = (
            turned(indexer.wq(q[rows].flatten(1).detach()).view(n, J, d), r),
            indexer.weights(x[rows]) * J**-0.5 * d**-0.5,
        )
        ik = turned(
            torch.nn.functional.layer_norm(indexer.wk(x[rows]), (d,), indexer.k_norm.weight, indexer.k_norm.bias, 1e-6),
            r,
        )
        means = torch.stack([ik[j : j + size].mean(0) for j in range(0, n, size)])
        score = sum(w[:, j, None] * torch.relu(iq[:, j] @ means.T) for j in range(J))  # (n, blocks)
        for t in range(n):
            own = t // size
            chosen = chosen_by(start + t)
            assert (
                len(chosen) == min(top // size - 1, own)
                and len(set(chosen)) == len(chosen)
                and all(b < own for b in chosen)
            )
            left = [b for b in range(own) if b not in chosen]
            assert not left or score[t, chosen].min() >= score[t, left].max() - 1e-9  # no block left out scores higher
            keys = list(range(own * size, t + 1)) + [p for b in chosen for p in range(b * size, (b + 1) * size)]
            p = torch.softmax(torch.einsum("hd,khd->hk", q[start + t], k[start + torch.tensor(keys)]), -1)
            out[start + t] = torch.einsum("hk,khd->hd", p, v[start + torch.tensor(keys)])
            target = torch.stack(
                [p.detach().mean(0)[: t + 1 - own * size].sum()]
                + [p.detach().mean(0)[t + 1 - own * size + i * size :][:size].sum() for i in range(len(chosen))]
            )
            logq = torch.log_softmax(score[t, [own, *chosen]], 0)
            sparse.append((target * (target.log() - logq)).sum())
            causal = (
                torch.softmax(torch.einsum("hd,khd->hk", q[start + t], k[start : start + t + 1]), -1).detach().mean(0)
            )
            mass = torch.stack([causal[b * size : (b + 1) * size].sum() for b in range(own + 1)])
            dense.append((mass * (mass.clamp_min(1e-30).log() - torch.log_softmax(score[t, : own + 1], 0))).sum())
        start += n
    return out, torch.stack(sparse).mean(), torch.stack(dense).mean()


@pytest.mark.parametrize("lens, top, size, seed", [([40], 12, 4, 0), ([33, 50, 9], 16, 8, 1), ([64], 10, 5, 2)])
def test_blocks_chosen_by_the_indexer_equal_their_definition(lens, top, size, seed):
    """The MSA corner: DSA's indexer and losses at block granularity, read on MoBA's per-token kernel."""
    pattern, attention, reference, q, k, v, inputs = twins(
        f"dsa:k={top},b={size},index_heads=3,index_dim=4,dense=1", lens, seed
    )
    edges = build_graph(pattern, None, lens).edges["dd"]
    dsa = sys.modules[type(attention.trainable).__module__]
    iq, w, ik = attention.trainable.indexer(q.flatten(1), inputs, dsa.positions_of(lens, q.device))
    sel = dsa.BlockIndex(ik, lens, size).top(iq, w, top // size - 1, q.shape[1])
    assert sel.group == q.shape[1] and sel.blocks.shape[1] == 1  # one choice for every head, not a copy per head

    def chosen_by(t):
        return sel.blocks[t, 0][sel.valid[t, 0]].tolist()

    weights = torch.linspace(-1, 1, v.numel()).view_as(v)
    wide = copy.deepcopy(attention).double()

    def run(q, k, v, x, weights):  # gtx's dsa over blocks; on the float64 copy where the inputs are float64
        module = wide if q.dtype == torch.float64 else attention
        module.begin_step(0)  # the dense stage: dense, the KL over block masses
        module(q, k, v, edges, inputs=x)
        dense, _ = module.take_losses()
        module.begin_step(1)
        xs = [y.requires_grad_() for y in (q.clone(), k.clone(), v.clone())]
        out = module(*xs, edges, inputs=x)
        sparse, _ = module.take_losses()
        grads = torch.autograd.grad((out * weights).sum(), xs)
        return dense, out, *grads, sparse, *grads_of(sparse, module.trainable.indexer)

    want = float64_reference(run, q, k, v, inputs, weights)
    want.check(run(q, k, v, inputs, weights), "dsa over blocks")
    ys = [x.double().requires_grad_() for x in (q, k, v)]
    out, sparse, dense = blocks_by_definition(reference, *ys, inputs.double(), lens, top, size, chosen_by)
    grads = torch.autograd.grad((out * weights.double()).sum(), ys)
    want.check_float64((dense, out, *grads, sparse, *grads_of(sparse, reference.trainable.indexer)), "the definition")


@pytest.mark.parametrize("model", ["lm", "transformer", "hf", "ut"])
def test_the_indexer_reads_each_layers_input(model, monkeypatch):
    """Index keys and weights read the states the attention's q, k and v are projected from: the
    layer's normalised input (gtx's layers' norm before self-attention; the hidden states
    transformers hands its attention module; ut: every decoder node's, as its keys are)."""
    from gtx.data.batch import batches
    from gtx.run.build import build_attention, build_model
    from gtx.run.runner import RunConfig, resolve

    if model == "hf":
        pytest.importorskip("transformers")
    task = "copy" if model in ("transformer", "ut") else "recall"
    settings = {
        "n_train": "4",
        "n_valid": "4",
        "n_test": "4",
        "dim": "16",
        "heads": "2",
        "dim_ff": "16",
        **({"seq_len": "48"} if task == "recall" else {}),
        **({"layers": "2", "max_len": "64"} if model == "hf" else {}),
    }
    r = resolve(
        RunConfig(task=task, model=model, pattern="dsa:k=4,index_heads=2,index_dim=4,dense=0", settings=settings)
    )
    net = build_model(r, build_attention(r)).eval()
    own = {"transformer": lambda: net.dec_attention[0], "ut": lambda: net.dec_attention}.get(
        model, lambda: net.layer_attention[0]
    )()
    dsa = sys.modules[type(own.trainable).__module__]
    seen, want, forward = [], [], dsa.SparseIndexed.forward
    monkeypatch.setattr(
        dsa.SparseIndexed,
        "forward",
        lambda self, q, k, v, edges, run: seen.append(run.inputs) or forward(self, q, k, v, edges, run),
    )
    if model == "hf":
        for module in (m for m in net.hf.modules() if type(m).__name__.endswith("Attention")):
            module.register_forward_pre_hook(
                lambda m, args, kwargs: want.append(kwargs["hidden_states"][0]), with_kwargs=True
            )
    elif model != "ut":
        for norm in (
            (layer.norm_attn for layer in net.layers) if model == "lm" else (layer.norm_self for layer in net.decoder)
        ):
            norm.register_forward_hook(lambda m, args, out: want.append(out))
    batch = next(iter(batches(r.task, "valid", r.pattern_run, 2)))
    with torch.no_grad():
        net(batch)
    if model == "ut":  # a step's active nodes are a subset: the others keep their latest input, as their keys
        assert seen and all(x.shape == (len(batch.tgt_in), 16) for x in seen)
    else:
        assert len(seen) == len(want) == 2 and all(torch.equal(a, b) for a, b in zip(seen, want))


@pytest.mark.parametrize("lens, top, seed", [([70, 33], 9, 0), ([150], 20, 1)])
def test_the_c_kernels_and_the_torch_path_agree_on_the_turned_indexer(lens, top, seed, monkeypatch):
    """On the CPU in float32 the C kernels choose and fit the indexer; on rotated index queries and
    keys they give the torch path's choice, output, KL and gradients."""
    from gtx import native

    if native.load("index_kernel") is None:
        pytest.skip("no C compiler: the torch path is all there is")
    pattern, attention, _, q, k, v, inputs = twins(f"dsa:k={top},index_heads=2,index_dim=8,dense=0", lens, seed)
    edges = build_graph(pattern, None, lens).edges["dd"]
    wide, kept = copy.deepcopy(attention).double(), []

    def run(q, k, v, inputs, weights):  # on the float64 copy where the inputs are float64
        module = wide if q.dtype == torch.float64 else attention
        xs = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())]
        module.begin_step(0)
        out = module(*xs, edges, inputs=inputs)
        kl, _ = module.take_losses()
        kept.append(module.reset_stats()["kept_selected"])
        return out, kl, *torch.autograd.grad((out * weights).sum(), xs), *grads_of(kl, module.trainable.indexer)

    both_hold(run, q, k, v, inputs, torch.linspace(-1, 1, v.numel()).view_as(v))
    assert kept[-2] == kept[-1]  # the C kernels' choice and the torch path's


def dense_kl_by_softmax(q, k, iq, w, ik, lens, size):
    """The dense stage's KL (summed over queries) written out in float64 with softmaxes: the mean over
    heads of the causal attention against softmax(I) over the query's own and earlier tokens, or with
    ``size`` > 1 both as masses per block over the query's own block and those before (ik: block keys)."""
    total, start = 0.0, 0
    for sample, n in enumerate(lens):
        rows = slice(start, start + n)
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        p = torch.softmax(torch.einsum("thd,shd->hts", q[rows], k[rows]).masked_fill(later, float("-inf")), -1).mean(0)
        keys = ik[rows] if size == 1 else ik[sample, : -(-n // size)]
        if size > 1:
            p = torch.nn.functional.pad(p, (0, -n % size)).unflatten(-1, (-1, size)).sum(-1)
            later = torch.arange(len(keys))[None, :] > (torch.arange(n) // size)[:, None]
        logq = torch.log_softmax(index_scores(iq[rows], w[rows], keys).masked_fill(later, float("-inf")), -1)
        total = total + (p * (p.clamp_min(1e-30).log() - logq.masked_fill(later, 0))).sum()
        start += n
    return total


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("lens, rows", [([37], 64), ([30, 21, 5], 8), ([70, 1, 33], 16)])
def test_the_dense_kl_from_the_fused_attentions_log_sum_exp_equals_the_softmax_kl_values_and_gradients(
    lens, rows, size, kernel, monkeypatch
):
    """``dense_index_kl``: its loss and the indexer's gradients (computed in its one pass), given the
    log-sum-exp of the fused causal attention (unequal samples: bucketed, rows reordered) or
    computing it itself, against the KL of softmaxes in float64, in blocks of rows of every size; on
    the C kernel (where it builds) and on torch ops."""
    from gtx import native
    from gtx.selection.blocks import block_means
    from gtx.selection.indexer import dense_index_kl

    if kernel and native.load("dense_kernel") is None:
        pytest.skip("no C compiler: the torch path is all there is")
    if not kernel:
        monkeypatch.setattr(native, "kernel", lambda *_: None)

    torch.manual_seed(sum(lens) + size)
    n, heads = sum(lens), 3
    q, k, v = (torch.randn(n, heads, 8) for _ in range(3))
    iq, w, ik = torch.randn(n, 2, 4), torch.randn(n, 2), torch.randn(n, 4)
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"]
    _, lse = get_backend("auto").with_lse(q, k, v, edges)
    assert lse is not None  # the CPU's flash kernel gave it

    def keys_of(ik):
        return ik if size == 1 else block_means(ik[:, None], lens, size)[:, 0]

    def definition(q, k, *inputs):  # the backward scales the gradients
        ys = [y.clone().requires_grad_() for y in inputs]
        want = dense_kl_by_softmax(q, k, ys[0], ys[1], keys_of(ys[2]), lens, size)
        return want, *torch.autograd.grad(want * 0.5, ys)

    want = float64_reference(definition, q, k, iq, w, ik)
    threads = torch.get_num_threads()
    for given, workers in ((lse, 2), (None, 1)):  # row blocks side by side on two threads, or on one
        torch.set_num_threads(workers)
        xs = [x.clone().requires_grad_() for x in (iq, w, ik)]
        try:
            got = dense_index_kl(q, k, given, xs[0], xs[1], keys_of(xs[2]), lens, rows, size)
            assert torch.get_num_threads() == workers  # as it was: the workers' own count undone
        finally:
            torch.set_num_threads(threads)
        want.check((got, *torch.autograd.grad(got * 0.5, xs)), f"the dense KL on {workers} threads")


@pytest.mark.parametrize("size", [1, 3])
def test_the_dense_kls_kernel_and_its_torch_path_hold_float64s_over_long_rows(size):
    """Rows of 1100 keys, past the kernel's chunks of 512 columns and its vectors' tails, with scores so
    spread that some of p underflows to 0 and the index scores span hundreds: the C kernel's loss and
    gradients and the torch path's, each within what float32 holds of the float64 ones."""
    from gtx import native
    from gtx.selection.indexer import dense_index_kl

    if native.load("dense_kernel") is None:
        pytest.skip("no C compiler: the torch path is all there is")
    g = torch.Generator().manual_seed(5)
    n, heads = 1100, 2
    q, k = torch.randn(n, heads, 8, generator=g) * 12, torch.randn(n, heads, 8, generator=g)
    iq, w = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, generator=g) * 20
    keys = torch.randn(n, 8, generator=g) if size == 1 else torch.randn(1, -(-n // size), 8, generator=g)
    low, high = (q[:, 0] @ k[:, 0].T).aminmax()
    assert high - low > 200  # exp(q . k - lse) underflows for some keys

    def run(q, k, *inputs):
        xs = [x.clone().requires_grad_() for x in inputs]
        loss = dense_index_kl(q, k, None, *xs, [n], 64, size)
        return loss, *torch.autograd.grad(loss, xs)

    both_hold(run, q, k, iq, w, keys)
