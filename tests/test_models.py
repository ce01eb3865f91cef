"""Both models on every backend: forward, backward, agreement; ACT; decoding reads no future."""

import pytest
import torch

from gtx import native
from gtx.backends import get_backend
from gtx.data.batch import batches
from gtx.data.vocab import Vocab
from gtx.graph.spec import parse_pattern
from gtx.model.decode import decode
from gtx.model.layers import KERNEL
from gtx.plugins.registry import BACKENDS, MODELS

BACKEND_NAMES = [
    n for n in BACKENDS.names() if BACKENDS.get(n).obj.available("cpu") is None and BACKENDS.get(n).obj.trains_on("cpu")
]
TINY = {"transformer": dict(layers=2, heads=2, dim=16, dim_ff=16), "ut": dict(heads=2, dim=16, dim_ff=16, max_depth=4)}


def build(name, task, backend="dense", seed=0, **overrides):
    entry = MODELS.get(name)
    torch.manual_seed(seed)
    backend = get_backend(backend) if isinstance(backend, str) else backend
    return entry.obj(entry.config(**{**TINY[name], **overrides}), task.src_vocab, task.tgt_vocab, backend)


def pattern_for(name, spec):
    wrap = MODELS.get(name).obj.dynamic_pattern
    return parse_pattern(f"{wrap}({spec})" if wrap else spec)


@pytest.mark.parametrize("model", ["transformer", "ut"])
@pytest.mark.parametrize("spec", ["full", "local:w=1"])
def test_forward_backward_agree_across_backends(tiny_task, model, spec):
    batch = next(batches(tiny_task, "train", pattern_for(model, spec), 8))
    results = {}
    for backend in BACKEND_NAMES:
        m = build(model, tiny_task, backend)
        m.eval()  # no dropout: outputs comparable across backends
        out = m(batch)
        loss = torch.nn.functional.cross_entropy(out.logits, batch.targets) + (
            out.aux_loss if out.aux_loss is not None else 0
        )
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        assert out.logits.shape == (batch.targets.numel(), len(tiny_task.tgt_vocab))
        assert torch.isfinite(loss) and torch.isfinite(grads).all()
        results[backend] = (out.logits.detach(), grads)
    ref_logits, ref_grads = results["dense"]
    for backend, (logits, grads) in results.items():
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4, msg=backend)
        torch.testing.assert_close(grads, ref_grads, atol=1e-4, rtol=1e-3, msg=backend)


class Recording:
    """Wraps a backend and records the number of edges and of queries with edges per call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def available(self, device="cpu"):
        return None

    def __call__(self, q, k, v, edges):
        self.calls.append((edges.num_edges, int((edges.in_degree() > 0).sum())))
        return self.inner(q, k, v, edges)


def test_act_halts_nodes_and_shrinks_edge_sets(tiny_task):
    rec = Recording(get_backend("dense"))
    m = build("ut", tiny_task, backend=rec)
    for halting in (m.halt_enc, m.halt_dec):  # make halting probabilities ~0.4 so nodes halt at step 3
        torch.nn.init.zeros_(halting.proj.weight)
        torch.nn.init.constant_(halting.proj.bias, -0.4)
    batch = next(batches(tiny_task, "train", pattern_for("ut", "full"), 8))
    out = m(batch)
    enc_steps, dec_steps = out.steps
    assert (enc_steps == 3).all() and (dec_steps == 3).all()  # 0.4 + 0.4 < 0.99 <= 0.4 * 3
    assert torch.isfinite(out.aux_loss) and out.aux_loss > 0
    # ee runs 3 times over all nodes; no step after the last one
    assert len(rec.calls) == 3 + 2 * 3


class HaltEvenNodesFirst(torch.nn.Module):
    """Halting probability 1 for even nodes at the first step (called on all n nodes), else 0.3."""

    def __init__(self, n):
        super().__init__()
        self.even = (torch.arange(n) % 2 == 0)[:, None]

    def forward(self, x):
        if x.shape[0] == self.even.shape[0]:
            return torch.where(self.even, 1.0, 0.3)
        return torch.full((x.shape[0], 1), 0.3)


def test_act_filtered_edges_shrink_when_some_nodes_halt(tiny_task):
    rec = Recording(get_backend("dense"))
    m = build("ut", tiny_task, backend=rec)
    batch = next(batches(tiny_task, "train", pattern_for("ut", "full"), 8))
    m.halt_enc = HaltEvenNodesFirst(batch.src.numel())
    even = m.halt_enc.even.squeeze(1)
    enc = m.encode(batch.src, batch.src_pos, batch.graph)
    sizes = [e for e, _ in rec.calls]
    assert sizes[0] == batch.graph.edges["ee"].num_edges and sizes[1] < sizes[0]
    assert rec.calls[1][1] == int((~even).sum())  # only still-active queries have edges
    assert int(enc.steps[even].max()) == 1 and int(enc.steps[~even].min()) == 4  # 0.3 * 3 < 0.99: to max_depth


def test_ut_without_act_runs_every_step(tiny_task):
    m = build("ut", tiny_task, act=False)
    out = m(next(batches(tiny_task, "train", pattern_for("ut", "full"), 8)))
    assert out.aux_loss is None and all((s == 4).all() for s in out.steps)


@pytest.mark.parametrize("model", ["transformer", "ut"])
@pytest.mark.parametrize("spec", ["full", "local:w=2", "strided:l=2", "bigbird:b=2,r=1"])
def test_decoder_reads_no_future_position(tiny_task, model, spec):
    """Changing target tokens after position t must not change the outputs at positions <= t."""
    m = build(model, tiny_task)
    m.eval()
    batch = next(batches(tiny_task, "train", pattern_for(model, spec), 4))
    base = m(batch).logits
    t = 2
    changed = batch.tgt_in.clone()
    after = batch.tgt_pos > t
    changed[after] = (changed[after] + 1) % len(tiny_task.tgt_vocab)
    batch.tgt_in = changed
    out = m(batch).logits
    torch.testing.assert_close(out[~after], base[~after])
    assert not torch.allclose(out[after], base[after])


def test_a_leaking_decoder_pattern_would_be_caught(tiny_task):
    """The test above is not vacuous: with a dd edge from the future, outputs change."""
    from gtx.graph.tokens import EdgeSet

    m = build("transformer", tiny_task)
    m.eval()
    batch = next(batches(tiny_task, "train", parse_pattern("full"), 4))
    dd = batch.graph.edges["dd"]
    n = dd.n_dst
    batch.graph.edges["dd"] = EdgeSet(
        torch.cat([dd.src, torch.tensor([n - 1])]), torch.cat([dd.dst, torch.tensor([0])]), n, n
    )
    order = torch.argsort(batch.graph.edges["dd"].dst * n + batch.graph.edges["dd"].src)
    e = batch.graph.edges["dd"]
    batch.graph.edges["dd"] = EdgeSet(e.src[order], e.dst[order], n, n)
    base = m(batch).logits[0]
    batch.tgt_in = batch.tgt_in.clone()
    batch.tgt_in[n - 1] = (batch.tgt_in[n - 1] + 1) % len(tiny_task.tgt_vocab)
    assert not torch.allclose(m(batch).logits[0], base)


@pytest.mark.parametrize("model", ["transformer", "ut"])
@pytest.mark.parametrize("beam", [1, 3])
def test_greedy_decoding_matches_teacher_forcing_on_its_own_output(tiny_task, model, beam):
    """Decoding grows the graph token by token; feeding its output back teacher-forced must give
    the same argmax at every position (greedy), and beam search returns valid sequences."""
    m = build(model, tiny_task, seed=3)
    m.eval()
    pattern = pattern_for(model, "local:w=2")
    batch = next(batches(tiny_task, "valid", pattern, 6))
    hyps = decode(m, tiny_task, batch, pattern, beam=beam)
    assert len(hyps) == 6
    limits = [tiny_task.max_decode_len(int(n) - 1) for n in batch.graph.src_lens]
    assert all(len(h) <= lim and Vocab.eos not in h and Vocab.sos not in h for h, lim in zip(hyps, limits))
    if beam > 1:
        return
    from gtx.data.batch import make_batch

    for i, h in enumerate(hyps):
        if len(h) >= limits[i]:
            continue  # stopped by the length limit, not by <eos>
        one = make_batch(tiny_task, "valid", [batch.index[i]], pattern)
        from gtx.graph.tokens import build_graph, positions

        tgt_in = torch.tensor([Vocab.sos] + h)
        graph = build_graph(pattern, one.graph.src_lens.tolist(), [len(tgt_in)])
        enc = m.encode(one.src, one.src_pos, graph)
        logits = m.decode(enc, tgt_in, positions(torch.tensor([len(tgt_in)])), graph).logits
        logits[:, [Vocab.pad, Vocab.sos]] = float("-inf")  # decoding never generates these
        assert logits.argmax(-1).tolist() == h + [Vocab.eos]


def _torch_lanes(monkeypatch):
    """Dropout's torch path, as where the C kernel cannot be built."""
    from gtx.model import layers

    monkeypatch.setattr(layers.native, "kernel", lambda *a, **k: None)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_each_element_with_probability_1_minus_p_and_rescales(p, kernel, monkeypatch):
    from gtx.model.layers import Dropout

    if not kernel:
        _torch_lanes(monkeypatch)
    torch.manual_seed(0)
    drop = Dropout(p)
    x = torch.ones(200_001)  # not a multiple of the four lanes a random word gives
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.005
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    assert not torch.equal(drop(x), y)  # a fresh mask per call
    # lanes of one word are independent: neighbours agree as often as chance says
    agree = (kept[:-1] == kept[1:]).float().mean().item()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 0.01
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # torch's seed reproduces it
    drop.eval()
    assert drop(x) is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_scales_by_the_kept_lanes_in_the_input_dtype(dtype, monkeypatch):
    """Without the kernel: the output is x times (kept lane) / (1 - p), bit for bit, in x's dtype, with that gradient."""
    from gtx.model.layers import Dropout

    _torch_lanes(monkeypatch)
    p, x = 0.1, torch.randn(1001, dtype=dtype, requires_grad=True)
    torch.manual_seed(3)
    y = Dropout(p)(x)
    torch.manual_seed(3)
    lanes = torch.empty(-(-x.numel() // 4), dtype=torch.int64).random_(-(2**63), None).view(torch.int16)[: x.numel()]
    scale = (lanes >= round(-32768 + p * 65536)).to(dtype).mul_(1 / (1 - p))
    assert y.dtype == dtype and torch.equal(y, x * scale)
    y.sum().backward()
    assert torch.equal(x.grad, scale)


def _splitmix_lanes(seed: int, n: int) -> torch.Tensor:
    """SplitMix64's outputs for counters 1.. after ``seed``, as n unsigned 16-bit lanes (int64), little-endian,
    in torch's wrapping int64 arithmetic: the kernel's generator written out independently."""

    def shift(z, s):  # logical, where torch's >> is arithmetic
        return (z >> s) & ((1 << (64 - s)) - 1)

    def signed(c):
        return c - (1 << 64) if c >= 1 << 63 else c

    z = signed(seed % 2**64) + torch.arange(1, -(-n // 4) + 1, dtype=torch.int64) * signed(0x9E3779B97F4A7C15)
    z = (z ^ shift(z, 30)) * signed(0xBF58476D1CE4E5B9)
    z = (z ^ shift(z, 27)) * signed(0x94D049BB133111EB)
    z = z ^ shift(z, 31)
    return torch.stack([shift(z, 16 * i) & 0xFFFF for i in range(4)], -1).flatten()[:n]


@pytest.mark.skipif(native.load(KERNEL) is None, reason="no C compiler")
def test_dropout_kernel_keeps_the_splitmix_lanes_and_masks_the_gradient_alike():
    """The kernel's mask is SplitMix64's lanes of one seed drawn from torch's generator, whatever the
    threads; the gradient is masked by the same lanes (drawn again, none kept)."""
    from gtx.model.layers import Dropout

    p, x = 0.1, torch.randn(3, 4099, requires_grad=True)  # parts end mid-word
    torch.manual_seed(5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = Dropout(p)(x)
        torch.manual_seed(5)
        torch.set_num_threads(1)
        assert torch.equal(Dropout(p)(x), y)
    finally:
        torch.set_num_threads(threads)
    torch.manual_seed(5)
    seed = int(torch.empty((), dtype=torch.int64).random_(-(2**63), None))
    scale = (_splitmix_lanes(seed, x.numel()) >= round(p * 65536)).float().view_as(x) / (1 - p)
    assert torch.equal(y, x * scale)
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g * scale)


@pytest.mark.parametrize("model, overrides", [("transformer", {}), ("ut", {}), ("ut", {"act": False})])
@pytest.mark.parametrize("spec", ["full", "local:w=2", "strided:l=3", "bigbird:b=2,r=1"])
def test_incremental_decoding_gives_the_logits_of_the_whole_prefix(tiny_task, model, overrides, spec):
    """Feeding tokens one at a time through ``decode_next`` gives, at every position, the logits
    ``decode`` computes over the whole prefix (for the UT: with nodes halting at different steps)."""
    from gtx.graph.tokens import build_graph, positions
    from gtx.model.decode import latest_edges

    m = build(model, tiny_task, seed=5, **overrides)
    m.eval()
    pattern = pattern_for(model, spec)
    batch = next(batches(tiny_task, "valid", pattern, 5))
    src_lens = batch.graph.src_lens.tolist()
    encoded = m.encode(batch.src, batch.src_pos, batch.graph)
    tokens = torch.randint(3, len(tiny_task.tgt_vocab), (len(src_lens), 7))
    graph = build_graph(pattern, src_lens, [7] * len(src_lens))
    with torch.no_grad():
        whole = m.decode(encoded, tokens.flatten(), positions(torch.full((len(src_lens),), 7)), graph)
        state = m.start_decoding(encoded, pattern)
        for t in range(7):
            logits, state = m.decode_next(
                state, tokens[:, t], torch.full((len(src_lens),), t), latest_edges(pattern, src_lens, t + 1, "cpu")
            )
            torch.testing.assert_close(logits, whole.logits.view(len(src_lens), 7, -1)[:, t], atol=1e-5, rtol=1e-5)
    if model == "ut" and not overrides:
        assert len(set(whole.steps[1].tolist())) > 1  # nodes halted at different steps


@pytest.mark.parametrize("model", ["transformer", "ut"])
@pytest.mark.parametrize("beam", [1, 3])
def test_incremental_decoding_equals_recomputing_the_prefix(tiny_task, model, beam):
    m = build(model, tiny_task, seed=5)
    m.eval()
    pattern = pattern_for(model, "local:w=2")
    batch = next(batches(tiny_task, "valid", pattern, 8))
    assert decode(m, tiny_task, batch, pattern, beam=beam) == decode(
        m, tiny_task, batch, pattern, beam=beam, incremental=False
    )


def test_a_model_without_incremental_decoding_is_decoded_by_recomputing(tiny_task):
    """A model plugin need not subclass Seq2SeqModel: encode and decode are enough."""

    class Plain(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def encode(self, *args):
            return self.inner.encode(*args)

        def decode(self, *args):
            return self.inner.decode(*args)

    m = build("transformer", tiny_task, seed=5)
    m.eval()
    pattern = pattern_for("transformer", "local:w=2")
    batch = next(batches(tiny_task, "valid", pattern, 8))
    assert decode(Plain(m), tiny_task, batch, pattern) == decode(m, tiny_task, batch, pattern)


def test_checkpoints_from_before_the_attention_rename_still_load(tiny_task):
    from gtx.attention.module import Attention

    entry = MODELS.get("transformer")

    def make():
        return entry.obj(
            entry.config(**TINY["transformer"]),
            tiny_task.src_vocab,
            tiny_task.tgt_vocab,
            Attention(get_backend("dense"), parse_pattern("full+relbias:buckets=8,max_distance=16"), 2),
        )

    trained, fresh = make(), make()
    old = {
        k.replace("attention.", "backend.", 1) if k.startswith("attention.") else k: v + 1
        for k, v in trained.state_dict().items()
    }
    assert any(k.startswith("backend.") for k in old)  # the learned bias table, saved under the old name
    fresh.load_state_dict(old)
    assert all(
        torch.equal(v, old[k.replace("attention.", "backend.", 1) if k.startswith("attention.") else k])
        for k, v in fresh.state_dict().items()
    )
    assert fresh.backend is fresh.attention  # plugins that read the old attribute
