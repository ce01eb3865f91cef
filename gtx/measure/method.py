"""``gtx bench attention``'s cell for a pattern that chooses or learns its keys at run time: the
method as a run runs it, on the stage it serves, its keys counted by the runs' account."""

from __future__ import annotations

import torch


def method_stage(pattern) -> str:
    """The stage a pattern's run-time choice serves: a trainable method's first (``dd`` for NSA and
    DSA), ``dd`` for a chooser that keeps its candidates elsewhere (MoBA), else ``ee``."""
    if pattern.trainable is not None:
        from gtx.attention.module import Attention

        return Attention.for_width(None, pattern, 1, 1).trainable.stages[0]
    probe = torch.zeros(2, 1, 1)
    edges = method_edges(pattern, "ee", 2, torch.device("cpu"))
    return "dd" if pattern.select is not None and pattern.select(probe, probe, edges) is None else "ee"


def method_edges(pattern, stage: str, n: int, device: torch.device):
    """One sequence of n tokens' ``stage`` edge set on ``device``, held as a training batch holds it."""
    from gtx.graph.tokens import batch_edges

    return batch_edges(pattern, stage, [n], [n]).to(device)


def method_cell(cell, pattern, device: torch.device, gen: torch.Generator):
    """(step, choice, read) for a ``gtx.measure.bench.AttentionCell`` of a pattern that chooses or learns its keys: forward +
    backward (or forward, ``cell.forward``) of the model's ``Attention`` (its choice, its attention over the chosen keys, a
    trainable method's auxiliary losses) on the stage it serves, as a training step runs it;
    ``read()``: (keys read, queries, keys allowed) of the last step (``gtx.attention.budget``)."""
    from gtx.attention.module import Attention
    from gtx.attention.trainable import stages_of
    from gtx.backends import get_backend

    stage = method_stage(pattern)
    attention = Attention.for_width(
        get_backend(cell.backend, device), pattern, cell.heads, cell.heads * cell.head_dim
    ).to(device)
    layer = attention.for_layer().to(device) if pattern.trainable is not None else attention
    edges = method_edges(pattern, stage, cell.n, device)
    q, k, v = (
        torch.randn(cell.n, cell.heads, cell.head_dim, generator=gen).to(device).requires_grad_(not cell.forward)
        for _ in range(3)
    )
    grad = torch.randn(cell.n, cell.heads, cell.head_dim, generator=gen).to(device)
    width = cell.heads * cell.head_dim
    inputs = torch.randn(cell.n, width, generator=gen).to(device)  # the layer's input, which DSA's indexer reads
    with torch.no_grad():  # one tiny call first: what the method and backend import lazily must not count as its memory
        layer(
            *(torch.randn(8, cell.heads, cell.head_dim, device=device) for _ in range(3)),
            method_edges(pattern, stage, 8, device),
            inputs=torch.randn(8, width, device=device),
        )
    attention.take_reads(), attention.take_losses(), attention.reset_choices(), attention.reset_stats()
    # every step below is a run's first (step 0): the stage a method with stages (DSA) is in now is the
    # one they run in (dsa's dense stage unless dense=0), named in the row beside the density it reads
    described = stages_of(layer)
    reads = []

    def step():
        q.grad = k.grad = v.grad = None
        attention.begin_step(0)
        with torch.set_grad_enabled(not cell.forward):
            out = layer(q, k, v, edges, inputs=inputs)
        reads[:] = [attention.take_reads()[stage]]
        aux, _ = attention.take_losses()
        if not cell.forward:
            ((out * grad).sum() + (aux if aux is not None else 0)).backward()

    def choice():
        counts = attention.reset_choices().get(stage, {})
        ran = f"{stage}: " + (max(counts, key=counts.get) if counts else "its own kernels")
        return f"{ran} ({described})" if described else ran

    return step, choice, lambda: reads[0]
