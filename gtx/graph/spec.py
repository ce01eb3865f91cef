"""Pattern specs: the small language of ``gtx run --pattern``, resolved against the registry.

    local:w=4                  a registered pattern with parameters
    local:w=2|strided:l=8      union; ``&`` intersection (binds tighter); parentheses group
    act(local:w=4)             a modifier around another pattern; heads(a,b) takes several
    local:w=64+alibi           a registered score bias on every edge

The result's ``spec`` is canonical (every parameter written out), so results name patterns alike.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import lru_cache

from gtx.errors import GtxError, PatternError, PluginError
from gtx.graph.pattern import Pattern
from gtx.values import parse_scalar

_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_-]*)|(?P<op>[|&():,+]))")
# parameters run to the next operator; a comma continues them only before another key=value
_PARAMS = re.compile(r"(?:[^|&()+,]|,(?=\s*[A-Za-z_][A-Za-z0-9_-]*\s*=))*")


def parse_pattern(spec: str) -> Pattern:
    """Resolve a pattern spec against the registry; the result's ``spec`` is canonical."""
    from gtx.plugins.registry import _state

    return _parse_cached(spec.strip(), _state["generation"])


def forget_parsed() -> None:
    """Drop every parsed pattern, and with them their cached edges: the next parse builds anew."""
    _parse_cached.cache_clear()


MAX_SPEC = 4096  # characters: a composition past this belongs in a pattern plugin
MAX_DEPTH = 64  # levels of parentheses
MAX_INT = 2**31 - 1  # an integer parameter beyond this is no position, count or size gtx can use


def _short(spec: str) -> str:
    return spec if len(spec) <= 80 else f"{spec[:60]}...{spec[-17:]}"


def _check_shape(spec: str) -> None:
    """One line for a spec the parser should not walk: too long, too deep, or with characters no spec has."""
    if len(spec) > MAX_SPEC:
        raise PatternError(
            f"pattern spec of {len(spec):,} characters ({_short(spec)!r}): gtx takes at most {MAX_SPEC:,}; "
            "write a composition this large as a pattern plugin (docs/writing-patterns.md)"
        )
    odd = next(((i, c) for i, c in enumerate(spec) if not (c.isascii() and c.isprintable())), None)
    if odd:
        raise PatternError(
            f"pattern spec {_short(spec)!r}: {odd[1]!r} at position {odd[0]} is not part of a spec; names, keys and values "
            "are ASCII (see `gtx patterns`)"
        )
    depth = deepest = 0
    for c in spec:
        depth += (c == "(") - (c == ")")
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise PatternError(
            f"pattern spec {_short(spec)!r} nests {deepest} levels of parentheses; gtx takes at most {MAX_DEPTH}"
        )


@lru_cache(maxsize=256)
def _parse_cached(spec: str, generation: int) -> Pattern:
    if not spec:
        raise PatternError("empty pattern spec; give a name such as 'full' or 'local:w=4' (see `gtx patterns`)")
    _check_shape(spec)
    parser = _Parser(spec)
    pattern = parser.biased()
    if parser.pos != len(spec):
        raise PatternError(
            f"cannot parse pattern {_short(spec)!r} at {_short(spec[parser.pos :])!r}; expected '|', '&', '+' or the end"
        )
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
            rest = self.spec[self.pos :].strip() or "the end"
            raise PatternError(f"cannot parse pattern {_short(self.spec)!r}: expected {what!r} at {_short(rest)!r}")
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
    params: dict[str, str] = {}
    if not text.strip():
        raise PatternError(
            f"pattern {name!r}: ':' with no parameters after it; write {name} for its defaults, or key=value after the ':'"
        )
    for item in (s.strip() for s in text.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PatternError(f"bad parameter {item!r} for pattern {name!r}; write key=value, e.g. {name}:w=4")
        if key.strip() in params:
            raise PatternError(
                f"pattern {name!r}: parameter {key.strip()!r} is given twice ({params[key.strip()]} and {value.strip()}); give it once"
            )
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
        typ = param_type(p).__name__ if p.annotation is p.empty else getattr(p.annotation, "__name__", p.annotation)
        parts.append(f"{n}: {typ} = {p.default!r}" if p.default is not p.empty else f"{n}: {typ}")
    return ", ".join(parts)


def param_type(p: inspect.Parameter) -> type:
    """What a parameter's text from the command line becomes: its annotation (int, float, bool or str),
    else, unannotated, its default's type (``w=4``: int), else str."""
    named = getattr(p.annotation, "__name__", p.annotation)  # a string under ``from __future__ import annotations``
    if p.annotation is p.empty and p.default is not p.empty and p.default is not None:
        named = type(p.default).__name__
    return {"int": int, "float": float, "bool": bool, "str": str}.get(named, str)


def _convert(name: str, key: str, value: str, typ: type) -> object:
    try:
        parsed = parse_scalar(value, typ)
    except ValueError:
        raise PatternError(
            f"parameter {key} of pattern {name!r} must be {typ.__name__}, got {_short(value)!r}"
        ) from None
    if typ is int and abs(parsed) > MAX_INT:
        raise PatternError(
            f"parameter {key} of pattern {name!r} is {_short(value)}: beyond {MAX_INT:,}, no position, count or size gtx can use"
        )
    return parsed


def _kwargs(kind: str, name: str, factory: Callable, raw: Mapping[str, str], skip: str = "inner") -> dict:
    known = pattern_params(factory, skip)
    renamed = getattr(factory, "renamed", {})  # old parameter name -> new: refused with the new spelling
    for key in raw:
        if key in renamed and key not in known:
            raise PatternError(
                f"{kind} {name!r} has no parameter {key!r}: it is named {renamed[key]!r} now; write {name}:{renamed[key]}={raw[key]}"
            )
        if key not in known:
            listing = describe_params(factory, skip) or "none"
            raise PatternError(f"{kind} {name!r} has no parameter {key!r}; its parameters: {listing}")
    return {k: _convert(name, k, v, param_type(known[k])) for k, v in raw.items()}


def add_bias(pattern: Pattern, name: str, raw: Mapping[str, str]) -> Pattern:
    """``pattern+name:params``: the registered score bias ``name`` on every edge of the pattern."""
    from gtx.plugins.registry import BIASES

    if pattern.bias is not None:
        raise PatternError(
            f"pattern {pattern.spec!r} already has the bias {pattern.bias[0]!r}; give one bias per pattern"
        )
    entry = BIASES.get(name)
    factory = entry.obj
    kwargs = _kwargs("bias", name, factory, raw, skip="heads")
    resolved = {n: kwargs.get(n, p.default) for n, p in pattern_params(factory, "heads").items()}
    args = ",".join(f"{k}={_fmt(v)}" for k, v in resolved.items())
    return replace(
        pattern,
        bias=(name, tuple(kwargs.items())),
        spec=f"{pattern.spec}+{name}{':' + args if args else ''}",
        definitions=declared(pattern.definitions, name, entry.definition),
        _cache={},
    )


def declared(parts: Mapping[str, int], name: str, definition: int | None) -> dict[str, int]:
    """The definition versions of a pattern's parts, with ``name``'s own where its registration declares one."""
    return dict(sorted({**parts, **({name: definition} if definition is not None else {})}.items()))


def build_pattern(name: str, raw: Mapping[str, str], inner: Pattern | tuple[Pattern, ...] | None = None) -> Pattern:
    """Build a registered pattern from string parameters; errors name the pattern and the fix.
    ``inner``: the wrapped pattern of a modifier (a tuple where several are given: ``heads(a,b)``)."""
    from gtx.plugins.registry import PATTERNS

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
    parts = {k: v for p in (*inners, pattern) for k, v in p.definitions.items()}
    return replace(
        pattern,
        spec=f"{spec}:{args}" if args else spec,
        definitions=declared(parts, name, entry.definition),
        _cache={},
    )


def _fmt(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
