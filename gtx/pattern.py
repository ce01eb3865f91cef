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

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from gtx import checks
from gtx.errors import GtxError, PatternError, PluginError
from gtx.values import parse_scalar

STAGES = ("ee", "dd", "ed")
STAGE_NAMES = {"ee": "encoder self-attention", "dd": "decoder self-attention", "ed": "encoder->decoder cross attention"}
Rule = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
EdgeFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
_GRID_CHUNK = 1 << 22  # predicate cells evaluated at once: bounds memory for long sequences


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
    heads: tuple[Pattern, ...] = ()  # head groups, ``heads(a,b)``: the heads split evenly, in order; the rules above are their union
    bias: tuple[str, tuple] | None = None  # a registered score bias and its parameters, ``P+alibi``: (name, ((key, value), ...))
    select: Callable | None = None  # ``select(q, k, edges) -> Selection``: per head, a subset of this pattern's edges
    budget: int | None = None  # most keys a selection keeps per query: a run checks it is below the candidates
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
        return not self.heads and self.bias is None and self.select is None

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
        """Validated ``(src, dst)`` int64 tensors of one sample, sorted by (dst, src); cached."""
        key = (stage, n_q, n_k)
        if key not in self._cache:
            src, dst = self._raw_edges(stage, n_q, n_k)
            check_edges(self.spec, stage, n_q, n_k, src, dst)
            if stage != "ee" and n_q > 1:
                shorter = self._raw_edges(stage, n_q - 1, n_k - 1 if stage == "dd" else n_k)
                check_prefix(self.spec, stage, n_q, n_k, src, dst, shorter)
            self._cache[key] = (src, dst)
        return self._cache[key]

    def structure(self, stage: str, n_q: int, n_k: int) -> str | None:
        """``"complete"`` (every key), ``"causal"`` (n_q == n_k, keys at or before the query) or
        None, for one sample's validated edges; cached."""
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
        try:
            if stage in self.edge_fns:
                return sort_edges(*checks.edge_pair(who, self.edge_fns[stage](n_q, n_k)), n_k)
            return grid_edges(self.rule(stage), n_q, n_k, who)
        except GtxError:
            raise
        except Exception as e:
            raise PluginError(
                f"pattern {self.spec!r} raised while building {stage} edges for n_q={n_q}, n_k={n_k}: {type(e).__name__}: {e}"
            ) from e

    def __or__(self, other: Pattern) -> Pattern:
        return _combine(self, other, "|", torch.logical_or, _union_keys)

    def __and__(self, other: Pattern) -> Pattern:
        return _combine(self, other, "&", torch.logical_and, _intersect_keys)


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


def _keys(p: Pattern, stage: str, n_q: int, n_k: int) -> torch.Tensor:
    src, dst = p.edges(stage, n_q, n_k)
    return dst * n_k + src  # sorted, unique: edges are validated


def _union_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.unique(torch.cat([a, b]))


def _intersect_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a[torch.isin(a, b)]


def _combine(a: Pattern, b: Pattern, op: str, logical, merge) -> Pattern:
    for p in (a, b):
        if not p.plain:
            raise PatternError(f"pattern {p.spec!r} splits heads, biases scores or selects edges at run time: it cannot be combined with "
                               f"'{op}'; combine fixed patterns inside it instead, e.g. topk(local:w=8|strided:l=8) or (a|b)+alibi")
    def stage_rule(stage):
        ra, rb = a.rule(stage), b.rule(stage)
        return lambda q, k, n_q, n_k: logical(ra(q, k, n_q, n_k), rb(q, k, n_q, n_k))

    def stage_edges(stage):
        def fn(n_q, n_k):
            keys = merge(_keys(a, stage, n_q, n_k), _keys(b, stage, n_q, n_k))
            return keys % n_k, keys // n_k

        return fn

    return Pattern(
        **{s: stage_rule(s) for s in STAGES},
        spec=f"{_wrap(a.spec, op)}{op}{_wrap(b.spec, op)}",
        edge_fns={s: stage_edges(s) for s in STAGES},
        filter=a.filter or b.filter,
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
        raise PatternError(f"{where}: edge {int(src[i])}->{int(dst[i])} is out of range (keys 0..{n_k - 1}, queries 0..{n_q - 1})")
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


# ---------------------------------------------------------------------------------------------
# Specs: "local:w=4|strided:l=8", "(a|b)&c", modifiers such as "act(local:w=4)".
# ---------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_-]*)|(?P<op>[|&():,+]))")
# parameters run to the next operator; a comma continues them only before another key=value
_PARAMS = re.compile(r"(?:[^|&()+,]|,(?=\s*[A-Za-z_][A-Za-z0-9_-]*\s*=))*")


def parse_pattern(spec: str) -> Pattern:
    """Resolve a pattern spec against the registry; the result's ``spec`` is canonical."""
    from gtx.plugins import _state

    return _parse_cached(spec.strip(), _state["generation"])


@lru_cache(maxsize=256)
def _parse_cached(spec: str, generation: int) -> Pattern:
    if not spec:
        raise PatternError("empty pattern spec; give a name such as 'full' or 'local:w=4' (see `gtx patterns`)")
    parser = _Parser(spec)
    pattern = parser.biased()
    if parser.pos != len(spec):
        raise PatternError(f"cannot parse pattern {spec!r} at {spec[parser.pos:]!r}; expected '|', '&', '+' or the end")
    return pattern


class _Parser:
    """biased := expr ('+' NAME [':' params])* ; expr := term ('|' term)* ; term := atom ('&' atom)* ;
    atom := '(' biased ')' | NAME ['(' biased (',' biased)* ')'] [':' key=value (',' key=value)*]"""

    def __init__(self, spec: str):
        self.spec, self.pos = spec, 0

    def peek(self) -> str | None:
        m = _TOKEN.match(self.spec, self.pos)
        return (m.group("op") or "name") if m else None

    def take(self, what: str) -> str:
        m = _TOKEN.match(self.spec, self.pos)
        got = (m.group("op") or "name") if m else None
        if got != what:
            rest = self.spec[self.pos:].strip() or "the end"
            raise PatternError(f"cannot parse pattern {self.spec!r}: expected {what!r} at {rest!r}")
        self.pos = m.end()
        return m.group("name") or m.group("op")

    def biased(self) -> Pattern:
        p = self.expr()
        while self.peek() == "+":
            self.take("+")
            name = self.take("name")
            p = add_bias(p, name, self.params(name))
        return p

    def params(self, name: str) -> dict[str, str]:
        if self.peek() != ":":
            return {}
        self.take(":")
        m = _PARAMS.match(self.spec, self.pos)
        self.pos = m.end()
        return _split_params(name, m.group(0))

    def expr(self) -> Pattern:
        p = self.term()
        while self.peek() == "|":
            self.take("|")
            p = p | self.term()
        return p

    def term(self) -> Pattern:
        p = self.atom()
        while self.peek() == "&":
            self.take("&")
            p = p & self.atom()
        return p

    def atom(self) -> Pattern:
        if self.peek() == "(":
            self.take("(")
            p = self.biased()
            self.take(")")
            return p
        name = self.take("name")
        inner = None
        if self.peek() == "(":
            self.take("(")
            inner = [self.biased()]
            while self.peek() == ",":
                self.take(",")
                inner.append(self.biased())
            self.take(")")
            inner = inner[0] if len(inner) == 1 else tuple(inner)
        return build_pattern(name, self.params(name), inner)


def _split_params(name: str, text: str) -> dict[str, str]:
    params = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PatternError(f"bad parameter {item!r} for pattern {name!r}; write key=value, e.g. {name}:w=4")
        params[key.strip()] = value.strip()
    return params


def pattern_params(factory: Callable, skip: str = "inner") -> dict[str, inspect.Parameter]:
    """A factory's command-line parameters (everything but the inner pattern of a modifier, or a bias's ``heads``)."""
    return {n: p for n, p in inspect.signature(factory).parameters.items() if n != skip}


def is_modifier(factory: Callable) -> bool:
    """A modifier wraps another pattern: ``act(local:w=4)``."""
    return "inner" in inspect.signature(factory).parameters


def describe_params(factory: Callable, skip: str = "inner") -> str:
    parts = []
    for n, p in pattern_params(factory, skip).items():
        typ = getattr(p.annotation, "__name__", p.annotation)
        parts.append(f"{n}: {typ} = {p.default!r}" if p.default is not p.empty else f"{n}: {typ}")
    return ", ".join(parts)


def _convert(name: str, key: str, value: str, annotation) -> object:
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(getattr(annotation, "__name__", annotation), str)
    try:
        return parse_scalar(value, typ)
    except ValueError:
        raise PatternError(f"parameter {key} of pattern {name!r} must be {typ.__name__}, got {value!r}") from None


def _kwargs(kind: str, name: str, factory: Callable, raw: Mapping[str, str], skip: str = "inner") -> dict:
    known = pattern_params(factory, skip)
    for key in raw:
        if key not in known:
            listing = describe_params(factory, skip) or "none"
            raise PatternError(f"{kind} {name!r} has no parameter {key!r}; its parameters: {listing}")
    return {k: _convert(name, k, v, known[k].annotation) for k, v in raw.items()}


def add_bias(pattern: Pattern, name: str, raw: Mapping[str, str]) -> Pattern:
    """``pattern+name:params``: the registered score bias ``name`` on every edge of the pattern."""
    from gtx.plugins import BIASES

    if pattern.bias is not None:
        raise PatternError(f"pattern {pattern.spec!r} already has the bias {pattern.bias[0]!r}; give one bias per pattern")
    factory = BIASES.get(name).obj
    kwargs = _kwargs("bias", name, factory, raw, skip="heads")
    resolved = {n: kwargs.get(n, p.default) for n, p in pattern_params(factory, "heads").items()}
    args = ",".join(f"{k}={_fmt(v)}" for k, v in resolved.items())
    return replace(pattern, bias=(name, tuple(kwargs.items())), spec=f"{pattern.spec}+{name}{':' + args if args else ''}", _cache={})


def build_pattern(name: str, raw: Mapping[str, str], inner: Pattern | tuple[Pattern, ...] | None = None) -> Pattern:
    """Build a registered pattern from string parameters; errors name the pattern and the fix.
    ``inner``: the wrapped pattern of a modifier (a tuple where several are given: ``heads(a,b)``)."""
    from gtx.plugins import PATTERNS

    entry = PATTERNS.get(name)
    factory = entry.obj
    known = pattern_params(factory)
    kwargs = _kwargs("pattern", name, factory, raw)
    if is_modifier(factory):
        needs = inspect.signature(factory).parameters["inner"].default is inspect.Parameter.empty
        if inner is None and needs:
            raise PatternError(f"pattern {name!r} wraps another pattern: write {name}(full) or {name}(local:w=4)")
        if inner is not None:
            kwargs["inner"] = inner
    elif inner is not None:
        raise PatternError(f"pattern {name!r} does not wrap another pattern; remove the parentheses after {name}")
    try:
        pattern = factory(**kwargs)
    except (ValueError, TypeError) as e:
        raise PatternError(f"bad parameters for pattern {name!r}: {e}") from None
    except GtxError:
        raise
    except Exception as e:
        raise PluginError(f"plugin {entry.plugin} raised in pattern {name!r}: {type(e).__name__}: {e}") from e
    if not isinstance(pattern, Pattern):
        raise PatternError(f"pattern {name!r} from {entry.plugin} returned {type(pattern).__name__}, not a gtx Pattern")
    resolved = {n: kwargs.get(n, p.default) for n, p in known.items()}
    args = ",".join(f"{k}={_fmt(v)}" for k, v in resolved.items())
    inners = inner if isinstance(inner, tuple) else (inner,) if inner is not None else ()
    spec = f"{name}({','.join(p.spec for p in inners)})" if inners else name
    return replace(pattern, spec=f"{spec}:{args}" if args else spec, _cache={})


def _fmt(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


__all__ = ["Pattern", "STAGES", "align", "causal", "parse_pattern", "check_edges"]
