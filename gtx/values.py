"""Command-line strings to typed values, for pattern parameters and ``--set`` settings alike, and
the ranges a setting's values must lie in."""

from __future__ import annotations

import dataclasses
import math
import re

BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
INTERVAL_RE = re.compile(r"([\[(])(-?(?:inf|\d+(?:\.\d+)?)), (-?(?:inf|\d+(?:\.\d+)?))([\])])\Z")


def parse_scalar(raw: str, typ: type) -> object:
    """``raw`` as ``typ`` (int, float, bool or str); raises ValueError when it does not parse."""
    if typ is bool:
        if raw.lower() not in BOOLS:
            raise ValueError(raw)
        return BOOLS[raw.lower()]
    return typ(raw)


def setting(default, help: str | None = None, range: str | None = None):
    """A config dataclass field with its ``--set`` help and the interval its values must lie in,
    written as in mathematics: ``"[1, inf)"``, ``"[0, 1)"``, ``"(0, 1]"``. ``gtx run`` checks every
    setting against its interval before anything runs (``out_of_range``)."""
    if range is not None and not INTERVAL_RE.match(range):
        raise ValueError(f"range {range!r}: write an interval such as '[1, inf)' or '(0, 1]'")
    return dataclasses.field(
        default=default, metadata={k: v for k, v in (("help", help), ("range", range)) if v is not None}
    )


def out_of_range(config) -> tuple[str, object, str] | None:
    """The first field of a config dataclass whose value lies outside its declared ``range``:
    (name, value, interval); None when all do. NaN lies in no interval."""
    for f in dataclasses.fields(config):
        interval = f.metadata.get("range")
        value = getattr(config, f.name)
        if interval and not _inside(value, interval):
            return f.name, value, interval
    return None


def _inside(value, interval: str) -> bool:
    left, lo, hi, right = INTERVAL_RE.match(interval).groups()
    lo, hi = float(lo), float(hi)
    if not isinstance(value, (int, float)) or math.isnan(value):
        return False
    return (value >= lo if left == "[" else value > lo) and (value <= hi if right == "]" else value < hi)
