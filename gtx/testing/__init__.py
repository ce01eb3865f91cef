"""Checks for pattern authors, for their own test suites (gtx's tests use them too):

    from gtx import testing
    def test_my_pattern():
        testing.check_pattern("near_max:k=2")      # a spec, or a Pattern

``check_edges``: at every stage and many lengths, edges in range and sorted, none twice, no query
without a key, no decoder edge from the future, and decoder edges that do not depend on the target
length (a decoder generating token by token cannot know it). ``check_agrees_with_dense``: the
attention the pattern gives (head groups, biases, content-chosen edges included), on every listed
backend in float32, equals gtx's dense reference in float64 on values and on the gradients of q, k, v
and any learned parameter, within what float32 holds on those inputs (``gtx.testing.float32``: the
same verdict on any CPU). Each raises ``PatternError`` or ``AssertionError`` naming the pattern,
stage and lengths.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.graph.pattern import STAGES, Pattern
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.testing.float32 import Reference, float64_reference

LENGTHS = (1, 2, 3, 5, 8, 13, 21, 40)
BACKENDS = ("auto", "blocksparse", "torch")


def _pattern(pattern: str | Pattern) -> Pattern:
    return parse_pattern(pattern) if isinstance(pattern, str) else pattern


def check_edges(pattern: str | Pattern, lengths: Sequence[int] = LENGTHS) -> None:
    """Every stage's edges at every pair of ``lengths`` (sources x targets) pass gtx's edge checks
    (``gtx.graph.pattern.check_edges`` and ``check_prefix``, run by ``Pattern.edges``)."""
    p = _pattern(pattern)
    for n_src in lengths:
        for n_tgt in lengths:
            for stage, (n_q, n_k) in {"ee": (n_src, n_src), "dd": (n_tgt, n_tgt), "ed": (n_tgt, n_src)}.items():
                p.edges(stage, n_q, n_k)


def _run(attention: Attention, edges):
    """(q, k, v, layer inputs) -> attention's output and the gradients of q, k, v and its parameters."""

    def run(q, k, v, inputs):
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = attention(*xs, edges, inputs=inputs)
        # an uneven loss: every output position matters differently
        weights = torch.linspace(-1, 1, out.numel()).to(out.dtype).view_as(out)
        return out, *torch.autograd.grad((out * weights).sum(), [*xs, *attention.parameters()], materialize_grads=True)

    return run


def check_agrees_with_dense(
    pattern: str | Pattern,
    lens: Sequence[int] = (5, 11, 3),
    heads: int = 2,
    dim: int = 8,
    backends: Sequence[str] = BACKENDS,
    atol: float = 0.0,
    seed: int = 0,
) -> None:
    """Attention under ``pattern`` on each backend (float32) equals the dense reference (float64),
    within the bound float32 holds on these inputs (plus ``atol``), on a batch of samples of lengths
    ``lens``, for encoder (``ee``) and decoder (``dd``) self-attention; random layer inputs
    (``heads * dim`` wide) stand for the states q, k and v come from."""
    p = _pattern(pattern)
    g = torch.Generator().manual_seed(seed)
    for stage in ("ee", "dd"):
        edges = build_graph(p, lens if stage == "ee" else None, lens if stage == "dd" else None).edges[stage]
        q, k, v = (torch.randn(n, heads, dim, generator=g) for n in (edges.n_dst, edges.n_src, edges.n_src))
        inputs = torch.randn(edges.n_dst, heads * dim, generator=g)
        reference = Attention(get_backend("dense"), p, heads, dim)
        for table in reference.parameters():  # learned parameters away from their start: their gradients compared
            table.data = torch.randn(table.shape, generator=g)
        want = float64_reference(_run(copy.deepcopy(reference).double(), edges), q, k, v, inputs)
        want = Reference(want.values, [b + atol for b in want.bound])
        names = ", ".join(["q", "k", "v", *(n for n, _ in reference.named_parameters())])
        for name in backends:
            attention = Attention(get_backend(name), p, heads, dim)
            attention.load_state_dict(reference.state_dict())
            where = f"pattern {p.spec!r}, stage {stage}, lengths {list(lens)}, backend {name}"
            want.check(_run(attention, edges)(q, k, v, inputs), f"{where} (the output, then the gradients of {names})")


def check_pattern(pattern: str | Pattern, lengths: Sequence[int] = LENGTHS, backends: Sequence[str] = BACKENDS) -> None:
    """``check_edges`` and ``check_agrees_with_dense``: what a pattern plugin's test suite calls."""
    check_edges(pattern, lengths)
    check_agrees_with_dense(pattern, backends=backends)


__all__ = ["STAGES", "check_agrees_with_dense", "check_edges", "check_pattern", "float64_reference"]
