"""Token graphs: the batched disjoint union of per-sample graphs, no padding.

Node ids: encoder nodes of all samples are numbered 0..N_enc-1 sample by sample (sample 0's
positions first), decoder nodes 0..N_dec-1 likewise; each stage's ``EdgeSet`` indexes the node
type it reads: ``ee`` enc->enc, ``dd`` dec->dec, ``ed`` enc (keys) -> dec (queries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gtx.graph.pattern import STAGES, Pattern, within_window

STAGE_TYPES = {"ee": ("enc", "enc"), "dd": ("dec", "dec"), "ed": ("enc", "dec")}  # (key type, query type)
# Bytes of a pattern's batch edges kept on an accelerator per stage and sample lengths (``EdgeSet.src``):
# copying a long sequence's edges from the host every step cost more than its attention on a GPU.
DEVICE_EDGES_BYTES = 1 << 30


class EdgeSet:
    """One stage's edges over a batch: ``src`` (E,) key ids in [0, n_src), ``dst`` (E,) query ids in
    [0, n_dst), int64, sorted by (dst, src). ``plan`` caches what backends derive from it.

    ``q_lens``/``k_lens``: per-sample query and key counts when the set is a disjoint union of
    samples (``batch_edges``): sample i's queries and keys are the i-th consecutive runs of q_lens[i]
    and k_lens[i] ids; None: unknown. ``structure``: ``"complete"`` or ``"causal"`` when every
    sample is known to be (from the pattern), so that plain attention can run without reading a
    single edge; the edges of such a set are built only when something reads ``src`` or ``dst``
    (``build``). ``parent``/``keep``: for a subset made by ``filter_dst``, the full edge set and the
    kept queries, so that backends can reuse the full set's plan (ACT filters every step).
    ``pattern``: the pattern that made the set; ``groups``: a head-grouped pattern's set per group.
    A set is built whole: nothing of it changes after construction but the caches."""

    def __init__(
        self,
        src: torch.Tensor | None,
        dst: torch.Tensor | None,
        n_src: int,
        n_dst: int,
        stage: str = "",
        q_lens: tuple[int, ...] | None = None,
        k_lens: tuple[int, ...] | None = None,
        parent: EdgeSet | None = None,
        keep: torch.Tensor | None = None,
        *,
        structure: str | None = None,
        build: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
        num_edges: int | None = None,
        device: torch.device | str = "cpu",
        pattern: Pattern | None = None,
        groups: Sequence[EdgeSet] = (),
    ):
        self._edges = None if src is None else (src, dst)
        self._build, self._num_edges = build, num_edges
        self._device = torch.device(device) if src is None else src.device
        self.n_src, self.n_dst, self.stage = n_src, n_dst, stage
        self.q_lens, self.k_lens, self.structure = q_lens, k_lens, structure
        self.parent, self.keep = parent, keep
        self._plans: dict = {}
        self.pattern = pattern  # the pattern that made the set (batch_edges): what gtx.attention reads at run time
        self.groups = list(groups)  # a head-grouped pattern's edge set per group (``heads(a,b)``)

    @property
    def root(self) -> EdgeSet:
        """The full set a ``filter_dst`` subset came from, else this one: what knows the samples."""
        return self.parent or self

    def sample_lens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sample query and key counts (of ``root``); one sample when the set does not say."""
        root = self.root
        if root.q_lens is None or root.k_lens is None:
            return (root.n_dst,), (root.n_src,)
        return tuple(root.q_lens), tuple(root.k_lens)

    def _built(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._edges is None:

            def moved():
                src, dst = self._build()
                return src.to(self._device), dst.to(self._device)

            if self._device.type == "cpu" or self.pattern is None or self.q_lens is None:
                self._edges = moved()
            else:  # the same for every batch of these lengths: built and copied to the device once
                key = (self.stage, self.q_lens, self.k_lens, str(self._device))
                self._edges = self.pattern.memo("device edges", key, moved, DEVICE_EDGES_BYTES, lambda e: _bytes(*e))
        return self._edges

    @property
    def src(self) -> torch.Tensor:
        return self._built()[0]

    @property
    def dst(self) -> torch.Tensor:
        return self._built()[1]

    @property
    def num_edges(self) -> int:
        return int(self.src.numel()) if self._num_edges is None else self._num_edges

    @property
    def device(self) -> torch.device:
        return self._device

    def __repr__(self) -> str:
        return f"EdgeSet(stage={self.stage!r}, n_src={self.n_src}, n_dst={self.n_dst}, num_edges={self.num_edges}, structure={self.structure})"

    def plan(self, key, build: Callable[[], object]):
        """Build once per key (backend, device, ...) and keep it with the edges."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def shared_plan(self, key, build: Callable[[], object], size: int, weigh: Callable[[object], int]):
        """``plan``, and for a set made by ``batch_edges`` also kept with its pattern (``Pattern.memo``,
        at most ``size`` by ``weigh``) per stage, sample lengths and device: its edges are the same for
        every batch of those lengths, so such batches share one plan instead of planning each step."""
        if self.pattern is None or self.parent is not None or self.q_lens is None:
            return self.plan(key, build)
        shared = (key, self.stage, self.q_lens, self.k_lens, str(self.device))
        return self.plan(key, lambda: self.pattern.memo("plans", shared, build, size, weigh))

    def in_degree(self) -> torch.Tensor:
        count = lambda: torch.bincount(self.dst, minlength=self.n_dst)  # noqa: E731
        return self.shared_plan("in_degree", count, DEVICE_EDGES_BYTES, _bytes)

    def to(self, device) -> EdgeSet:
        device = torch.device(device)
        if device == self.device:
            return self
        same = {
            "q_lens": self.q_lens,
            "k_lens": self.k_lens,
            "structure": self.structure,
            "num_edges": self._num_edges,
            "pattern": self.pattern,
            "groups": [g.to(device) for g in self.groups],
        }
        if self._edges is None:
            return EdgeSet(None, None, self.n_src, self.n_dst, self.stage, build=self._build, device=device, **same)
        return EdgeSet(self.src.to(device), self.dst.to(device), self.n_src, self.n_dst, self.stage, **same)

    def filter_dst(self, keep: torch.Tensor) -> EdgeSet:
        """The edges whose query is kept; ``keep`` is a bool tensor of shape (n_dst,). Order kept."""
        mask = keep[self.dst]
        root = self.root
        kept = keep if self.keep is None else keep & self.keep
        groups = [g.filter_dst(keep) for g in self.groups]
        count = sum(g.num_edges for g in groups) // len(groups) if groups else None
        return EdgeSet(
            self.src[mask],
            self.dst[mask],
            self.n_src,
            self.n_dst,
            self.stage,
            parent=root,
            keep=kept,
            num_edges=count,
            pattern=self.pattern,
            groups=groups,
        )

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each edge's query and key position within its sample, (E,) int64 each (score biases read them)."""
        root = self.root

        def within(ids, lens, n):
            return ids if lens is None else positions(torch.as_tensor(lens, device=ids.device))[ids]

        return self.plan(
            "positions", lambda: (within(self.dst, root.q_lens, root.n_dst), within(self.src, root.k_lens, root.n_src))
        )

    def dense(self) -> torch.Tensor:
        """(n_dst, n_src) bool adjacency: row = query, column = key."""
        adj = torch.zeros(self.n_dst, self.n_src, dtype=torch.bool, device=self.device)
        adj[self.dst, self.src] = True
        return adj


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def possible_edges(edges: EdgeSet) -> int:
    """The edges a stage allows over the same samples: every key per query, and for ``dd`` every
    key at or before the query (the causal triangle). Density = edges / this; 1.0 is full attention."""
    q_lens = torch.tensor(edges.q_lens if edges.q_lens is not None else (edges.n_dst,))
    k_lens = torch.tensor(edges.k_lens if edges.k_lens is not None else (edges.n_src,))
    if edges.stage == "dd":
        return int((q_lens * (q_lens + 1) // 2).sum())
    return int((q_lens * k_lens).sum())


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lens, 0) - lens


def positions(lens: torch.Tensor) -> torch.Tensor:
    """Position of every node within its sample, for lengths (B,): concatenated aranges."""
    total = int(lens.sum())
    return torch.arange(total, device=lens.device) - torch.repeat_interleave(_offsets(lens), lens)


@dataclass(eq=False)
class TokenGraph:
    """A batch: per-sample lengths, node positions and one EdgeSet per stage. ``src_lens`` is None
    for a decoder-only batch (lm: ``dd`` alone), ``tgt_lens`` None for an encoder-only one (``ee``)."""

    src_lens: torch.Tensor | None
    tgt_lens: torch.Tensor | None
    edges: dict[str, EdgeSet]
    pattern: Pattern

    @property
    def n_enc(self) -> int:
        return 0 if self.src_lens is None else int(self.src_lens.sum())

    @property
    def n_dec(self) -> int:
        return 0 if self.tgt_lens is None else int(self.tgt_lens.sum())

    def to(self, device) -> TokenGraph:
        return TokenGraph(self.src_lens, self.tgt_lens, {s: e.to(device) for s, e in self.edges.items()}, self.pattern)


def batch_edges(pattern: Pattern, stage: str, q_lens: Sequence[int], k_lens: Sequence[int]) -> EdgeSet:
    """The disjoint union of per-sample edge sets (each cached by the pattern per lengths), built when
    something first reads them. When every sample is complete or every one causal
    (``Pattern.structure``), the count is known without them, and plain attention runs from the
    lengths alone: such a batch's edges are built only if a backend reads them."""
    q_lens, k_lens = tuple(map(int, q_lens)), tuple(map(int, k_lens))
    # a 1x1 sample is complete and causal at once: it does not decide the batch's structure
    structures = {pattern.structure(stage, nq, nk) for nq, nk in zip(q_lens, k_lens) if (nq, nk) != (1, 1)}
    structures = structures or {pattern.structure(stage, 1, 1)}
    structure = structures.pop() if len(structures) == 1 else None

    def build():
        parts = [pattern.edges(stage, nq, nk) for nq, nk in zip(q_lens, k_lens)]
        if len(parts) == 1:
            return parts[0]
        counts = torch.tensor([p[0].numel() for p in parts])
        q_off = torch.repeat_interleave(_offsets(torch.as_tensor(q_lens)), counts)
        k_off = torch.repeat_interleave(_offsets(torch.as_tensor(k_lens)), counts)
        return torch.cat([p[0] for p in parts]) + k_off, torch.cat([p[1] for p in parts]) + q_off

    sizes = (sum(k_lens), sum(q_lens), stage, q_lens, k_lens)
    if pattern.heads:  # attended group by group; the set itself is their union, counted as what one head attends to
        groups = [batch_edges(g, stage, q_lens, k_lens) for g in pattern.heads]
        count = round(sum(g.num_edges for g in groups) / len(groups))
        return EdgeSet(None, None, *sizes, build=build, num_edges=count, pattern=pattern, groups=groups)
    if structure is None:  # built when first read: a step that reads no edges (the bench's ceiling) builds none
        return EdgeSet(None, None, *sizes, build=build, pattern=pattern)
    count = sum(nq * nk if structure == "complete" else nq * (nq + 1) // 2 for nq, nk in zip(q_lens, k_lens))
    return EdgeSet(None, None, *sizes, structure=structure, build=build, num_edges=count, pattern=pattern)


def window_edges(edges: EdgeSet, keys: int) -> EdgeSet:
    """A batch's edge set (``batch_edges``) again, its pattern read ``within_window`` of ``keys`` keys."""
    if edges.pattern is None or edges.q_lens is None:
        raise ValueError("window_edges needs an edge set made by batch_edges (its pattern and samples)")
    return batch_edges(within_window(edges.pattern, keys), edges.stage, edges.q_lens, edges.k_lens).to(edges.device)


def build_graph(pattern: Pattern, src_lens: Sequence[int] | None, tgt_lens: Sequence[int] | None = None) -> TokenGraph:
    """The token graph of a batch: ``ee`` over the sources, ``dd`` over the targets, ``ed`` when
    there are both (encoder-only: ``tgt_lens`` None; decoder-only: ``src_lens`` None)."""
    src = None if src_lens is None else [int(n) for n in src_lens]
    tgt = None if tgt_lens is None else [int(n) for n in tgt_lens]
    edges = {}
    if src is not None:
        edges["ee"] = batch_edges(pattern, "ee", src, src)
    if tgt is not None:
        edges["dd"] = batch_edges(pattern, "dd", tgt, tgt)
        if src is not None:
            edges["ed"] = batch_edges(pattern, "ed", tgt, src)
    return TokenGraph(
        None if src is None else torch.tensor(src), None if tgt is None else torch.tensor(tgt), edges, pattern
    )


__all__ = ["EdgeSet", "TokenGraph", "build_graph", "batch_edges", "positions", "window_edges", "STAGES", "STAGE_TYPES"]
