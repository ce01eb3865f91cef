"""Look inside a trained model: run a checkpoint's model on examples and record its attention
weights per edge and its ACT step counts. No plotting (``gtx.pictures.plot_model`` draws what this records).

    from gtx.measure import probe
    model, resolved, state = probe.load_model("results/checkpoints/<run_id>/best.pt")
    seen = probe.run_example(model, resolved, "test", 0)
    seen.calls[0].weights()      # (src, dst, w): the first call's edges and their softmax weights, mean over heads

Recording works at the backend: the model's ``gtx.attention.Attention`` keeps deciding head groups,
biases and run-time selections, and every backend call it makes is recorded with the edges, heads
and scores it actually used. The model's output is the real backend's, unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from gtx.attention.module import Attention
from gtx.backends import Backend
from gtx.data.batch import Batch, batches, make_batch
from gtx.data.task import SPLITS
from gtx.errors import GtxError
from gtx.graph.pattern import STAGES
from gtx.graph.tokens import EdgeSet
from gtx.records import checkpoint
from gtx.records.runref import find_checkpoint
from gtx.run.config import resolve_device

FALLBACK_BACKEND = "torch"  # any device, takes score biases: for a checkpoint whose backend is unusable here


def load_model(
    ref: str,
    results_dir: str | None = None,
    device: str = "cpu",
    backend: str | None = None,
    pattern: str | None = None,
):
    """(model, resolved, state): the trained model of a checkpoint (a .pt path, or a run under
    ``results_dir``: ``runref.find_checkpoint``) in eval mode on ``device``, its resolved configuration (``gtx.run.config.resolve``)
    and the checkpoint dict. ``backend``: the checkpoint's by default, ``torch`` where that one is
    unusable on ``device``; ``pattern``: the run's own by default. GtxError (one line) for a missing or foreign checkpoint."""
    from gtx.plugins.registry import BACKENDS
    from gtx.run.evaluation import trained_model  # the runner's own path: what trains is what is probed

    path = find_checkpoint(ref, results_dir or "results")
    state = checkpoint.load(path)
    trained = checkpoint.run_config(state)
    if backend is None:
        usable = BACKENDS.get(trained.backend).obj.available(resolve_device(device)) is None
        backend = trained.backend if usable else FALLBACK_BACKEND
    model, resolved, _ = trained_model(
        path,
        state,
        dataclasses.replace(trained, pattern=pattern or trained.pattern, backend=backend, device=device, loggers=[]),
    )
    return model.eval(), resolved, state


def check_example(resolved, split: str, index: int) -> None:
    if split not in SPLITS:
        raise GtxError(f"split {split!r}: choose one of {', '.join(SPLITS)}")
    n = len(resolved.task.splits()[split])
    if not 0 <= index < n:
        raise GtxError(f"example {index} is out of range: the {split} split has {n} examples (0-{n - 1})")


def edge_softmax(q: torch.Tensor, k: torch.Tensor, edges: EdgeSet, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(E, H) weights: for edge e (key src[e] -> query dst[e]) the softmax of q[dst]·k[src] (+ bias)
    over the query's incoming edges, as every backend computes it (q already scaled)."""
    src, dst = edges.src, edges.dst
    # edges per gather: q[dst] is E x H x D, far more than the (E, H) scores
    chunk = max(1, 2**24 // (q.shape[1] * q.shape[2]))
    score = torch.cat(
        [(q[dst[i : i + chunk]].float() * k[src[i : i + chunk]].float()).sum(-1) for i in range(0, len(src), chunk)]
        or [q.new_zeros(0, q.shape[1], dtype=torch.float32)]
    )
    if bias is not None:
        score = score + bias.float()
    top = torch.full((edges.n_dst, q.shape[1]), float("-inf"), device=score.device)
    top = top.scatter_reduce(0, dst[:, None].expand_as(score), score, "amax")
    weight = torch.exp(score - top[dst])
    z = torch.zeros(edges.n_dst, q.shape[1], device=score.device).index_add(0, dst, weight)
    return weight / z[dst]


@dataclass
class Part:
    """One backend call: the edges it attended (key ``src`` -> query ``dst``, (E,) int64 each) and
    ``weights`` (E, h) for the model's heads ``first .. first + h - 1``."""

    src: torch.Tensor
    dst: torch.Tensor
    weights: torch.Tensor
    first: int


@dataclass
class AttentionCall:
    """One attention sub-layer: the ``index``-th call of ``stage`` (layer ``index``; for ACT models,
    step ``index``), over ``n_q`` queries and ``n_k`` keys, split into backend calls (``parts``:
    one for a plain pattern, one per head group or per head for head-grouped or selecting patterns)."""

    stage: str
    index: int
    n_q: int
    n_k: int
    heads: int
    parts: list[Part] = field(default_factory=list)

    def covered(self) -> int:
        return sum(p.weights.shape[1] for p in self.parts)

    def weights(self, head: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src, dst, w) on the CPU: head ``head``'s edges and weights; None: the mean over heads,
        as (E,) over the edges of every head (an edge of some heads only counts 0 in the others, so
        each query's weights still sum to 1; an edge may repeat: weights of a pair add up)."""
        if head is not None and not 0 <= head < self.heads:
            raise GtxError(f"head {head} is out of range: the model has {self.heads} heads (0-{self.heads - 1})")
        src, dst, w = [], [], []
        for p in self.parts:
            for h in range(p.weights.shape[1]):
                if head is None or p.first + h == head:
                    src.append(p.src)
                    dst.append(p.dst)
                    w.append(p.weights[:, h] / (self.heads if head is None else 1))
        return torch.cat(src).cpu(), torch.cat(dst).cpu(), torch.cat(w).cpu()


class Recorder(Backend):
    """A backend that records each call's per-edge softmax weights (``parts``), then returns the
    wrapped backend's output; ``bias`` reaches the wrapped backend only when given."""

    supports_bias = True

    def __init__(self, inner: Backend):
        self.inner, self.name = inner, inner.name
        self.parts: list[Part] = []  # since the current sub-layer started
        self.first = 0  # head offset of the next call within the current sub-layer (set by ``recording``)

    def available(self, device="cpu"):
        return self.inner.available(device)

    def trains_on(self, device="cpu"):
        return self.inner.trains_on(device)

    def reset_choices(self):
        return self.inner.reset_choices()

    def __call__(self, q, k, v, edges, bias=None):
        self.parts.append(Part(edges.src, edges.dst, edge_softmax(q, k, edges, bias), self.first))
        self.first += q.shape[1]  # a sub-layer's calls cover its heads in order: groups, then heads of a selection
        if bias is None:
            return self.inner(q, k, v, edges)
        if not getattr(self.inner, "supports_bias", False):
            raise GtxError(f"backend {self.inner.name!r} cannot apply score biases; use --backend torch or dense")
        return self.inner(q, k, v, edges, bias=bias)


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[list[AttentionCall]]:
    """Record every attention sub-layer ``model`` runs inside the block, in call order. ``model.attention``
    must be a ``gtx.attention.Attention`` (models built by the runner are); its backend is wrapped by a
    ``Recorder`` and restored afterwards. Each call of the Attention module starts a sub-layer (head
    groups and per-head selections are backend calls within it)."""
    attention = getattr(model, "attention", None)
    if not isinstance(attention, Attention):
        raise GtxError(
            f"model {type(model).__name__} does not attend through gtx.attention.Attention; build it with gtx.run.runner"
        )
    if attention.pattern is not None and attention.pattern.trainable is not None:
        raise GtxError(
            f"pattern {attention.pattern.spec!r} mixes attentions of its own (trainable: branches, gates, compressed keys): "
            "its weights are not one edge set and cannot be recorded; plot a model trained under another pattern"
        )
    recorder, calls = Recorder(attention.backend), []
    counts = dict.fromkeys(STAGES, 0)

    def start(module, args, kwargs):
        q, edges = args[0], args[3] if len(args) > 3 else kwargs["edges"]
        finish()
        calls.append(AttentionCall(edges.stage, counts[edges.stage], edges.n_dst, edges.n_src, q.shape[1]))
        counts[edges.stage] += 1
        recorder.first = 0

    def finish():  # move the parts recorded so far into the open sub-layer
        if calls:
            calls[-1].parts += recorder.parts
        recorder.parts.clear()

    hook = attention.register_forward_pre_hook(start, with_kwargs=True)
    attention.backend, attention.list_edges = recorder, True
    try:
        yield calls
        finish()
    finally:
        attention.backend, attention.list_edges = recorder.inner, False
        hook.remove()
    for call in calls:
        if call.covered() != call.heads:  # block selections (moba) attend without the backend
            raise GtxError(
                f"the {call.stage} attention sends {call.covered()} of its {call.heads} heads through the backend (a block "
                "selection such as moba runs its own kernel): its weights cannot be recorded"
            )


@dataclass
class Probe:
    """What one example did in the model: its tokens per side (``src``: encoder inputs, ``tgt``:
    decoder inputs, None where the model has no such side), the attention sub-layers in call order,
    and the ACT step counts per side (``steps["enc"]``, ``steps["dec"]``: (n,) int64; empty without ACT)."""

    split: str
    index: int
    src: list[str] | None
    tgt: list[str] | None
    calls: list[AttentionCall]
    steps: dict[str, torch.Tensor]

    def stage(self, stage: str) -> list[AttentionCall]:
        return [c for c in self.calls if c.stage == stage]

    def tokens(self, stage: str) -> tuple[list[str], list[str]]:
        """(query tokens, key tokens) of a stage: ee source, dd target inputs, ed target over source."""
        return {"ee": (self.src, self.src), "dd": (self.tgt, self.tgt), "ed": (self.tgt, self.src)}[stage]


def sides(batch: Batch) -> list[str]:
    """The node types of a batch, in the order ``Output.steps`` lists them (encoder first)."""
    return [side for side, ids in (("enc", batch.src), ("dec", batch.tgt_in)) if ids is not None]


def step_counts(batch: Batch, steps: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {side: s.detach().cpu() for side, s in zip(sides(batch), steps)}


def run_example(model, resolved, split: str = "test", index: int = 0) -> Probe:
    """Run example ``index`` of ``split`` through ``model`` (eval, no grad, teacher forced: the decoder
    reads the reference target) and record its attention and ACT steps."""
    check_example(resolved, split, index)
    batch = make_batch(resolved.task, split, [index], resolved.pattern).to(resolved.device)
    model.eval()
    with torch.no_grad(), recording(model) as calls:
        out = model(batch)
    src = None if batch.src is None else resolved.task.src_vocab.decode(batch.src.tolist())
    tgt_vocab = resolved.task.src_vocab if resolved.task.form == "lm" else resolved.task.tgt_vocab
    tgt = None if batch.tgt_in is None else tgt_vocab.decode(batch.tgt_in.tolist())
    return Probe(split, index, src, tgt, calls, step_counts(batch, out.steps))


def split_steps(model, resolved, split: str = "test") -> dict[str, torch.Tensor]:
    """ACT step counts of every node of a split, per side (``enc``, ``dec``); empty without ACT."""
    out: dict[str, list[torch.Tensor]] = {}
    model.eval()
    with torch.no_grad():
        for batch in batches(resolved.task, split, resolved.pattern, resolved.train.eval_batch_size):
            batch = batch.to(resolved.device)
            for side, s in step_counts(batch, model(batch).steps).items():
                out.setdefault(side, []).append(s)
    return {side: torch.cat(s) for side, s in out.items()}


__all__ = [
    "AttentionCall",
    "Part",
    "Probe",
    "Recorder",
    "check_example",
    "edge_softmax",
    "load_model",
    "recording",
    "run_example",
    "split_steps",
]
