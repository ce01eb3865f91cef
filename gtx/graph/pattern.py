"""Attention patterns: the edges of each stage for one sample's lengths, and their composition.

Stages: ``ee`` (encoder self, n_src queries over n_src keys), ``dd`` (decoder self, n_tgt over
n_tgt) and ``ed`` (cross, n_tgt decoder queries over n_src encoder keys). Positions are 0-based
within the sample. Edge convention: an edge ``src -> dst`` means query ``dst`` attends to key
``src``; edge arrays are sorted by ``(dst, src)``.

A pattern is three pure predicates ``rule(q, k, n_q, n_k) -> BoolTensor`` over broadcast int64
position tensors (attention-gym's ``mask_mod``, one per stage), plus optional fast edge builders
that tests check against the predicates, plus, for dynamic patterns such as ACT, a run-time filter.
Every edge set is validated before use (``check_edges``) and cached per (pattern, stage, lengths).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from gtx.errors import PatternError, plugin_code
from gtx.plugins import checks

STAGES = ("ee", "dd", "ed")
STAGE_NAMES = {"ee": "encoder self-attention", "dd": "decoder self-attention", "ed": "encoder->decoder cross attention"}
Rule = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
EdgeFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
_GRID_CHUNK = 1 << 22  # predicate cells evaluated at once: bounds memory for long sequences
# bytes of encoder (ee) and cross (ed) edges kept per pattern, the most recently used length pairs:
# kept all, an encoder task of many lengths (listops' LRA preset: 500 to 2000 tokens) grew by
# gigabytes (bigbird: 10 MB a length)
EDGE_CACHE_BYTES = 512 << 20


def align(q: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """The source position a cross-attention query at target position q lines up with: the same
    position, clipped to the last source token. It must not depend on n_q: a decoder generating
    token by token does not know the target length (see ``check_prefix``)."""
    return q.clamp(max=n_k - 1)


def causal(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Key at or before the query."""
    return k <= q


def everything(q: torch.Tensor, k: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """Every key: a rule that broadcasts to all True."""
    return torch.ones((), dtype=torch.bool)


@dataclass(frozen=True, eq=False)
class Pattern:
    """Per-stage predicates; ``spec`` is the canonical name with parameters (``local:w=4``).

    Args:
        ee, dd, ed: ``rule(q, k, n_q, n_k)`` -> bool, broadcast over query rows and key columns.
        edge_fns: optional ``stage -> fn(n_q, n_k) -> (src, dst)``, faster than the grid of ``rule``.
        filter: for dynamic patterns (ACT), ``filter(edges, active) -> EdgeSet`` applied at run time
            to a batch's ``gtx.graph.EdgeSet`` given a boolean mask of active query nodes.
    """

    ee: Rule
    dd: Rule
    ed: Rule
    spec: str = ""
    edge_fns: Mapping[str, EdgeFn] = field(default_factory=dict)
    filter: Callable | None = None
    # What a pattern does at run time, beyond fixed edges (gtx.attention executes it):
    heads: tuple[
        Pattern, ...
    ] = ()  # head groups, ``heads(a,b)``: the heads split evenly, in order; the rules above are their union
    bias: tuple[str, tuple] | None = (
        None  # a registered score bias and its parameters, ``P+alibi``: (name, ((key, value), ...))
    )
    select: Callable | None = None  # ``select(q, k, edges) -> Selection``: per head, a subset of this pattern's edges
    budget: int | None = None  # most keys a selection keeps per query: a run checks it is below the candidates
    # ``trainable(heads, head_dim) -> gtx.attention.trainable.Trainable``: attention with parameters of its own (nsa, dsa),
    # built once per model layer; it attends in place of the backend on this pattern's (candidate) edges
    trainable: Callable | None = None
    # stage -> "complete" or "causal" where that holds by construction at every length: plain attention
    # then runs from the lengths alone, never listing the n^2 edges (tests check the claim against the rules)
    structures: Mapping[str, str] = field(default_factory=dict)
    # registered name -> definition version, for each method in this pattern (a union's parts, a modifier's inner
    # pattern, its bias) that declares one (``register(name, factory, definition=N)``): what results rows record
    definitions: Mapping[str, int] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_rule(cls, rule: Rule, decoder_rule: Rule | None = None, **kw) -> Pattern:
        """One bidirectional rule for all stages: ``ee`` as is, ``dd`` intersected with causal
        (``decoder_rule`` replaces ``rule`` there if given), ``ed`` evaluated at the source position
        the query aligns with (``align``)."""

        def dd(q, k, n_q, n_k):
            return (decoder_rule or rule)(q, k, n_q, n_k) & causal(q, k)

        def ed(q, k, n_q, n_k):
            return rule(align(q, n_q, n_k), k, n_k, n_k)

        return cls(ee=rule, dd=dd, ed=ed, **kw)

    @property
    def dynamic(self) -> bool:
        return self.filter is not None

    @property
    def plain(self) -> bool:
        """Fixed edges alike for every head, no bias: what every backend computes directly."""
        return not self.heads and self.bias is None and self.select is None and self.trainable is None

    def rule(self, stage: str) -> Rule:
        if stage not in STAGES:
            raise PatternError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        return getattr(self, stage)

    def dense(self, stage: str, n_q: int, n_k: int) -> torch.Tensor:
        """The (n_q, n_k) boolean adjacency of the predicate: row = query, column = key."""
        q = torch.arange(n_q)[:, None]
        k = torch.arange(n_k)[None, :]
        return torch.broadcast_to(self.rule(stage)(q, k, n_q, n_k), (n_q, n_k))

    def edges(self, stage: str, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated ``(src, dst)`` int64 tensors of one sample, sorted by (dst, src); cached. Decoder
        self-attention (``dd``, n_q == n_k) keeps one sample, the longest asked for: a shorter one's
        edges are its first rows (``check_prefix`` holds every pattern to that: a query's keys must
        not depend on how many tokens follow it), so samples of every length up to 4096 cost the
        memory of one, where a copy per length held gigabytes."""
        if stage == "dd" and n_q == n_k:
            n, src, dst = self._cache.get("dd", (0, None, None))
            if n < n_q:
                n, (src, dst) = n_q, self._checked(stage, n_q, n_k)
                self._cache["dd"] = (n, src, dst)
            if n == n_q:
                return src, dst
            rows = int(torch.searchsorted(dst, n_q))
            return src[:rows], dst[:rows]
        return self.memo(
            "edges",
            (stage, n_q, n_k),
            lambda: self._checked(stage, n_q, n_k),
            EDGE_CACHE_BYTES,
            weigh=lambda edges: 16 * edges[0].numel(),
        )

    def _checked(self, stage: str, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = self._raw_edges(stage, n_q, n_k)
        check_edges(self.spec, stage, n_q, n_k, src, dst)
        if stage != "ee" and n_q > 1:
            shorter = self._raw_edges(stage, n_q - 1, n_k - 1 if stage == "dd" else n_k)
            check_prefix(self.spec, stage, n_q, n_k, src, dst, shorter)
        return src, dst

    def memo(
        self, group: str, key, build: Callable[[], object], size: int, weigh: Callable[[object], int] = lambda _: 1
    ):
        """``build()``, kept with this pattern among the most recently used values of its ``group``
        whose weights (``weigh``, default 1 each) sum to at most ``size`` (the newest always kept):
        what a pattern's run derives per batch (e.g. per lengths) and reuses across layers and
        steps, cleared with the pattern's edges."""
        kept = self._cache.setdefault(("memo", group), OrderedDict())
        if key in kept:
            kept.move_to_end(key)
            return kept[key][0]
        value = build()
        kept[key] = (value, weigh(value))
        total = sum(w for _, w in kept.values())
        while total > size and len(kept) > 1:
            total -= kept.popitem(last=False)[1][1]
        return value

    def most_keys(self, stage: str, n_q: int, n_k: int) -> int:
        """The most keys any query of one (n_q, n_k) sample has: n_k where the sample is complete or
        causal (``structure``: no edges built where it is declared, and a causal sample of 16384 tokens
        holds 134 M), else its edges' largest in-degree."""
        if self.structure(stage, n_q, n_k) is not None:  # complete, or causal with n_q == n_k: the last query's
            return n_k if n_q else 0
        dst = self.edges(stage, n_q, n_k)[1]
        return int(torch.bincount(dst).max()) if dst.numel() else 0

    def structure(self, stage: str, n_q: int, n_k: int) -> str | None:
        """``"complete"`` (every key), ``"causal"`` (n_q == n_k, keys at or before the query) or
        None, for one sample's validated edges; cached."""
        # 1x1: "complete", as counted
        if stage in self.structures and (n_q, n_k) != (1, 1) and (self.structures[stage] == "complete" or n_q == n_k):
            return self.structures[stage]
        key = ("structure", stage, n_q, n_k)
        if key not in self._cache:
            src, dst = self.edges(stage, n_q, n_k)
            if src.numel() == n_q * n_k:
                self._cache[key] = "complete"  # validated edges are unique and in range: all of them
            elif n_q == n_k and src.numel() == n_q * (n_q + 1) // 2 and not bool((src > dst).any()):
                self._cache[key] = "causal"
            else:
                self._cache[key] = None
        return self._cache[key]

    def _raw_edges(self, stage: str, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        who = f"pattern {self.spec!r} ({stage} edges for n_q={n_q}, n_k={n_k})"
        with plugin_code(f"pattern {self.spec!r}", f"while building {stage} edges for n_q={n_q}, n_k={n_k}"):
            if stage in self.edge_fns:
                return sort_edges(*checks.edge_pair(who, self.edge_fns[stage](n_q, n_k)), n_k)
            return grid_edges(self.rule(stage), n_q, n_k, who)

    def __or__(self, other: Pattern) -> Pattern:
        return _combine(self, other, "|", torch.logical_or, _union_keys)

    def __and__(self, other: Pattern) -> Pattern:
        return _combine(self, other, "&", torch.logical_and, _intersect_keys)


def within_window(pattern: Pattern, keys: int) -> Pattern:
    """``pattern`` where each query reads at most ``keys`` positions: its own and the ``keys - 1``
    nearest (before it, in ``dd``), as a pretrained model's sliding-window layers do. Its head
    groups, bias and selection are kept, the selection choosing among the windowed candidates;
    cached with the pattern. PatternError for attention of its own (``nsa``, ``dsa``)."""
    return pattern.memo("window", keys, lambda: _windowed(pattern, keys), 16)


def _windowed(pattern: Pattern, keys: int) -> Pattern:
    name = f"window of {keys} keys"
    if pattern.trainable is not None:
        raise PatternError(
            f"pattern {pattern.spec!r} attends with its own parameters over every earlier key: it cannot run within a {name}; "
            "use a fixed pattern, topk or lsh there"
        )
    window = Pattern.from_rule(lambda q, k, n_q, n_k: (q - k < keys) & (k - q < keys), spec=f"window:{keys}")
    core = replace(pattern, heads=(), bias=None, select=None, budget=None, _cache={}) & window
    select = pattern.select

    def chosen_within(q, k, edges):
        chosen = select(q, k, edges)
        if chosen is None or isinstance(chosen, torch.Tensor) or edges.root.structure is not None:
            return chosen  # a keep mask over the windowed candidates, or every candidate (causal): inside the window
        raise PatternError(
            f"pattern {pattern.spec!r} chooses among all earlier keys, not among its candidates: it cannot run within a {name}; "
            "use a fixed pattern, topk or lsh there"
        )

    spec = f"({pattern.spec})" if set("|+") & set(_top_level(pattern.spec)) else pattern.spec
    return replace(
        core,
        heads=tuple(within_window(g, keys) for g in pattern.heads),
        bias=pattern.bias,
        select=select and chosen_within,
        budget=pattern.budget,
        spec=f"{spec}&{window.spec}",
        _cache={},
    )


def grid_edges(rule: Rule, n_q: int, n_k: int, who: str = "rule") -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluate a predicate on the (n_q, n_k) grid in row chunks; (src, dst) sorted by (dst, src)."""
    rows = max(1, _GRID_CHUNK // max(n_k, 1))
    k = torch.arange(n_k)[None, :]
    srcs, dsts = [], []
    for q0 in range(0, n_q, rows):
        q = torch.arange(q0, min(q0 + rows, n_q))[:, None]
        m = checks.rule_mask(who, rule(q, k, n_q, n_k), (q.shape[0], n_k))
        d, s = m.nonzero(as_tuple=True)
        srcs.append(s)
        dsts.append(d + q0)
    return torch.cat(srcs), torch.cat(dsts)


def sort_edges(src: torch.Tensor, dst: torch.Tensor, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(dst * n_k + src)
    return src[order], dst[order]


def _keys(p: Pattern, stage: str, n_q: int, n_k: int, validated: bool = True) -> torch.Tensor:
    """Edge keys ``dst * n_k + src``, sorted and unique. Not ``validated``: an intersection's operand,
    which may leak or leave a query empty where the other operand cuts or fills it (``leaky&causal``):
    only the result is judged."""
    src, dst = p.edges(stage, n_q, n_k) if validated else p._raw_edges(stage, n_q, n_k)
    keys = dst * n_k + src
    return keys if validated else torch.unique(keys)


def _union_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.unique(torch.cat([a, b]))


def _intersect_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a[torch.isin(a, b)]


def _combine(a: Pattern, b: Pattern, op: str, logical, merge) -> Pattern:
    for p in (a, b):
        if not p.plain:
            raise PatternError(
                f"pattern {p.spec!r} splits heads, biases scores or selects edges at run time: it cannot be combined with "
                f"'{op}'; combine fixed patterns inside it instead, e.g. topk(local:w=8|strided:l=8) or (a|b)+alibi"
            )

    def stage_rule(stage):
        ra, rb = a.rule(stage), b.rule(stage)
        return lambda q, k, n_q, n_k: logical(ra(q, k, n_q, n_k), rb(q, k, n_q, n_k))

    def stage_edges(stage):
        def fn(n_q, n_k):
            keys = merge(_keys(a, stage, n_q, n_k, op != "&"), _keys(b, stage, n_q, n_k, op != "&"))
            return keys % n_k, keys // n_k

        return fn

    return Pattern(
        **{s: stage_rule(s) for s in STAGES},
        spec=f"{_wrap(a.spec, op)}{op}{_wrap(b.spec, op)}",
        edge_fns={s: stage_edges(s) for s in STAGES},
        filter=a.filter or b.filter,
        definitions={**a.definitions, **b.definitions},
    )


def _wrap(spec: str, op: str) -> str:
    """Parenthesise a union inside an intersection so that the spec parses back to the same pattern."""
    return f"({spec})" if op == "&" and "|" in _top_level(spec) else spec


def _top_level(spec: str) -> str:
    depth, out = 0, []
    for ch in spec:
        depth += ch == "("
        depth -= ch == ")"
        out.append(ch if depth == 0 else " ")
    return "".join(out)


def check_edges(spec: str, stage: str, n_q: int, n_k: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Raise PatternError unless: indices in range, no duplicates, every query has an incoming edge,
    and ``dd`` never lets a position see a later one. Edges must be sorted by (dst, src)."""
    where = f"pattern {spec or '<unnamed>'!r}, stage {stage} ({STAGE_NAMES[stage]}), lengths n_q={n_q}, n_k={n_k}"
    bad = (src < 0) | (src >= n_k) | (dst < 0) | (dst >= n_q)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise PatternError(
            f"{where}: edge {int(src[i])}->{int(dst[i])} is out of range (keys 0..{n_k - 1}, queries 0..{n_q - 1})"
        )
    key = dst * n_k + src
    dup = key[1:] == key[:-1]
    if dup.any():
        i = int(dup.nonzero()[0]) + 1
        raise PatternError(f"{where}: edge {int(src[i])}->{int(dst[i])} appears more than once")
    counts = torch.bincount(dst, minlength=n_q)
    if (counts == 0).any():
        qi = int((counts == 0).nonzero()[0])
        raise PatternError(f"{where}: query {qi} has no incoming edge; every query must attend to at least one key")
    if stage == "dd":
        future = src > dst
        if future.any():
            i = int(future.nonzero()[0])
            raise PatternError(
                f"{where}: edge {int(src[i])}->{int(dst[i])} lets position {int(dst[i])} see later position {int(src[i])}; "
                "intersect the decoder rule with causal (k <= q)"
            )


def check_prefix(spec: str, stage: str, n_q: int, n_k: int, src, dst, shorter) -> None:
    """Raise PatternError unless the decoder-side edges of the first n_q - 1 queries are the same
    for n_q and n_q - 1 queries: a decoder generating token by token sees only a prefix, so edges
    that depend on the final target length would differ between training and generation (and leak
    the length). Applies to ``dd`` (keys are that prefix too) and ``ed``."""
    n_k_short = n_k - 1 if stage == "dd" else n_k
    keep = dst < n_q - 1
    a = dst[keep] * n_k_short + src[keep]
    b = shorter[1] * n_k_short + shorter[0]
    if a.shape != b.shape or not torch.equal(a, b):
        diff = set(zip(dst[keep].tolist(), src[keep].tolist())) ^ set(zip(shorter[1].tolist(), shorter[0].tolist()))
        d, s = min(diff)
        raise PatternError(
            f"pattern {spec or '<unnamed>'!r}, stage {stage} ({STAGE_NAMES[stage]}): edge {s}->{d} exists for target "
            f"length {n_q} but not {n_q - 1} (or the reverse): decoder edges must not depend on the target length, "
            "which a decoder generating token by token cannot know; make the rule independent of n_q"
        )


__all__ = ["Pattern", "STAGES", "align", "causal", "check_edges", "within_window"]
