"""blocksparse's band layouts (sliding windows, by structure): strided key views instead of gathers,
the same function as dense; layouts shared by batches of one pattern and lengths."""

import dataclasses

import pytest
import torch

from gtx.backends import blocksparse
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import batch_edges, build_graph
from tests.test_backends import attention_and_grads, random_edges


@pytest.mark.parametrize(
    "spec, stage, n, block, first, width",
    [
        ("local:w=3", "dd", 41, 4, -1, 2),  # one block back
        ("local:w=9", "dd", 100, 4, -3, 4),
        ("local:w=5", "ee", 37, 4, -2, 5),  # two-sided
        ("local:w=0", "dd", 17, 4, 0, 1),  # the diagonal alone
        ("dilated:w=2,d=3", "dd", 60, 8, -1, 2),  # another pattern, the same block structure
    ],
)
def test_band_found_by_structure(spec, stage, n, block, first, width):
    edges = build_graph(parse_pattern(spec), None if stage == "dd" else [n], [n] if stage == "dd" else [3]).edges[stage]
    layout = blocksparse.plan(edges, block)
    assert (layout.band, layout.key_blocks.shape[1]) == (first, width)
    rows = torch.arange(layout.n_qb)[:, None]
    assert torch.equal(layout.key_blocks, (rows + first + torch.arange(width)).clamp(0, layout.n_kb - 1))


@pytest.mark.parametrize("spec, stage", [("full", "ee"), ("bigbird:b=2,r=1", "dd"), ("strided:l=16", "dd")])
def test_no_band_where_rows_are_not_one(spec, stage):
    """Rows of other shapes, or a band wider than the rows (full: 19 diagonals of 10 blocks), gather."""
    edges = build_graph(parse_pattern(spec), [40], [40] if stage == "dd" else [3]).edges[stage]
    assert blocksparse.plan(edges, 4).band is None
    assert blocksparse.plan(random_edges(3, 40, 40, 0.3), 4).band is None


def test_causal_is_a_band_of_every_block():
    edges = build_graph(parse_pattern("full"), None, [40]).edges["dd"]
    layout = blocksparse.plan(edges, 4)
    assert (layout.band, layout.key_blocks.shape[1]) == (-9, 10)


@pytest.mark.parametrize("block", [1, 4, 8])
@pytest.mark.parametrize("spec, lens", [("local:w=5", [50]), ("local:w=3", [11, 30]), ("local:w=2", [9, 1, 13])])
def test_band_agrees_with_the_gathered_path_and_dense(block, spec, lens):
    """Values and gradients in float64: the band's views against the same layout gathered, and dense."""
    from gtx.backends import get_backend

    edges = build_graph(parse_pattern(spec), None, lens).edges["dd"]
    band = blocksparse.plan(edges, block)
    kw = dict(heads=2, dim=8, dim_v=8, dtype=torch.float64)
    ref = attention_and_grads(get_backend("dense"), edges, **kw)

    class Gathered(blocksparse.BlockSparseBackend):
        def layout(self, edges):
            return dataclasses.replace(band, band=None, _additive={})

    for backend in (blocksparse.BlockSparseBackend(block), Gathered(block)):
        got = attention_and_grads(backend, edges, **kw)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"{type(backend).__name__} {what}")
    if len(lens) == 1:
        assert band.band is not None


def test_band_backward_in_chunks(monkeypatch):
    """One query block per backward call: the key gradients added by diagonals across chunks."""
    from gtx.backends import get_backend

    monkeypatch.setattr(blocksparse, "BAND_CHUNK_KEYS", 1)
    edges = build_graph(parse_pattern("local:w=6"), None, [45]).edges["dd"]
    assert len(blocksparse._chunks(blocksparse.plan(edges, 4))) == -(-45 // 4)
    ref = attention_and_grads(get_backend("dense"), edges, heads=2, dim=8, dim_v=8, dtype=torch.float64)
    got = attention_and_grads(blocksparse.BlockSparseBackend(4), edges, heads=2, dim=8, dim_v=8, dtype=torch.float64)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, msg=what)


def test_batches_of_one_shape_share_a_layout():
    pattern, backend = parse_pattern("local:w=3"), blocksparse.BlockSparseBackend(4)
    first = backend.layout(batch_edges(pattern, "dd", (20, 7), (20, 7)))
    assert backend.layout(batch_edges(pattern, "dd", (20, 7), (20, 7))) is first
    assert backend.layout(batch_edges(pattern, "dd", (7, 20), (7, 20))) is not first  # other lengths
    assert blocksparse.BlockSparseBackend(8).layout(batch_edges(pattern, "dd", (20, 7), (20, 7))) is not first
    # a set not made from a pattern's lengths plans for itself
    edges = random_edges(0, 27, 27, 0.3)
    assert backend.layout(edges) is backend.layout(edges)
    assert backend.layout(random_edges(0, 27, 27, 0.3)) is not backend.layout(edges)


def test_a_band_keeps_no_cells_and_a_bias_over_it_still_agrees_with_dense():
    """A band's edge places follow from its edges: not kept (8 bytes an edge, 16 MB for a window of 128 at
    16384 tokens) but computed where a bias needs them, with the same values and gradients as dense."""
    from gtx.attention import Attention
    from gtx.backends import get_backend

    pattern = parse_pattern("local:w=5+alibi")
    edges = build_graph(pattern, None, [45]).edges["dd"]
    layout = blocksparse.plan(edges, 4)
    assert layout.band is not None and layout.cell is None
    assert blocksparse.plan(random_edges(3, 40, 40, 0.3), 4).cell is not None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(45, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    results = []
    for backend in (get_backend("dense"), blocksparse.BlockSparseBackend(4)):
        out = Attention(backend, pattern, 2)(q, k, v, edges)
        results.append(
            (out, *torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), [q, k, v]))
        )
    for what, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=what)


def test_the_band_backward_reads_k_and_v_themselves_not_padded_copies(monkeypatch, peak_bytes):
    """The backward's chunks read strided views of k and v (copies only of the first chunk's span, whose
    blocks run before the keys): it holds dq, dk, dv and a chunk's gradients, where padded copies of k and
    v held two k-sized tensors more."""
    monkeypatch.setattr(blocksparse, "BAND_CHUNK_KEYS", 256)
    n, heads, dim = 2048, 4, 32
    edges = build_graph(parse_pattern("local:w=127"), None, [n]).edges["dd"]
    backend = blocksparse.BlockSparseBackend(64)
    assert backend.layout(edges).band is not None
    q, k, v = (torch.randn(n, heads, dim, requires_grad=True) for _ in range(3))
    out = backend(q, k, v, edges)
    grad = torch.randn_like(out)
    _, held = peak_bytes(lambda: out.backward(grad))
    assert held < 4.2 * q.numel() * q.element_size()  # 3.7 here; padded copies: 5.7
