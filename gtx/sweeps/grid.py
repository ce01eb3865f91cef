"""What a sweep crosses: the lists of run options (``Grid``) from the command line (``make_grid``) or a
TOML file (``read_grid_file``), and the list syntax they share (seeds ``0-2,7``, ``a,b``, pattern specs that
hold commas). Every error is one line naming the option or the file. Knows nothing of click or of running.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gtx.errors import GtxError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

AXES = ("task", "model", "pattern", "backend")
DEFAULTS = {"task": "copy", "model": "transformer", "pattern": "full", "backend": "auto", "seeds": "0"}
FILE_KEYS = {*AXES, "seeds", "set", "device", "results", "jobs"}
SEEDS_RE = re.compile(r"(\d+)(?:-(\d+))?\Z")
MAX_CELLS = 10_000  # a grid past this is a typo (--seeds 0-100000000), not a study: refused before it is expanded


def parse_seeds(text: str) -> list[int]:
    """``0-4`` (inclusive), ``0,2,5`` or a mix (``0-2,7``) -> seeds in order, duplicates dropped."""
    seeds: dict[int, None] = {}  # ordered, without duplicates
    for item in (s.strip() for s in str(text).split(",")):
        m = SEEDS_RE.match(item)
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            raise GtxError(f"--seeds {text}: {item!r} is not a seed or a range; write 0-4, 0,2,5 or 0-2,7")
        first, last = int(m[1]), int(m[2] or m[1])
        if len(seeds) + last - first + 1 > MAX_CELLS:
            raise GtxError(f"--seeds {text}: more than {MAX_CELLS:,} seeds; a sweep that large is split into several")
        seeds.update(dict.fromkeys(range(first, last + 1)))
    return list(seeds)


def split_list(text: str, what: str = "value") -> list[str]:
    """``a,b`` -> ``["a", "b"]``; an empty item (``1,,2``, ``1,``) is an error naming ``what``."""
    items = [v.strip() for v in text.split(",")]
    if not all(items):
        raise GtxError(f"{what} {text!r}: an empty item between commas; write a,b")
    return items


def split_patterns(text: str, names: Iterable[str]) -> list[str]:
    """Pattern specs from one ``--pattern``: a comma outside parentheses followed by a registered
    pattern name (not ``name=``) starts a new spec (``full,local:w=4``); other commas separate a
    pattern's parameters (``bigbird:b=2,r=1``) or sit inside ``heads(...)``."""
    names, specs, depth, start = set(names), [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            m = re.match(r"\s*([A-Za-z_][\w-]*)\s*(=?)", text[i + 1 :])
            if m and m[1] in names and not m[2]:
                specs.append(text[start:i].strip())
                start = i + 1
    return [*specs, text[start:].strip()]


@dataclass
class Grid:
    """The lists a sweep crosses; ``settings`` maps a ``--set`` key to its values (one value: a constant)."""

    task: list[str]
    model: list[str]
    pattern: list[str]
    backend: list[str]
    seeds: list[int]
    settings: dict[str, list[str]] = field(default_factory=dict)
    device: str = "auto"


def make_grid(
    seeds: str | None = None, settings: dict[str, list[str]] | None = None, device: str | None = None, **axes
) -> Grid:
    """A grid from lists (``task=[...]``, ...); a missing axis takes ``gtx run``'s default. Raises GtxError when empty."""
    lists = {a: list(axes[a]) if axes.get(a) is not None else [DEFAULTS[a]] for a in AXES}
    grid = Grid(
        **lists,
        seeds=parse_seeds(DEFAULTS["seeds"] if seeds is None else seeds),
        settings=dict(settings or {}),
        device=device or "auto",
    )
    for key, values in [*lists.items(), *grid.settings.items()]:
        if not values:
            raise GtxError(f"empty grid: {key} has no values")
    return grid


def _as_list(path: Path, key: str, value) -> list[str]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, (str, int, float)) for v in values):
        raise GtxError(f"{path}: {key} must be a value or a non-empty list of values, not {value!r}")
    return [str(v).lower() if isinstance(v, bool) else str(v) for v in values]


def _flat(table: dict, prefix: str = ""):
    """``[set]`` items with dotted keys: ``model.dim = 16`` is a nested table in TOML, a prefixed setting here."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def read_grid_file(path: str | Path) -> dict:
    """A TOML grid as ``make_grid`` keywords plus ``results``/``jobs`` where given; every error is one line naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise GtxError(f"{path}: cannot read the grid file ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise GtxError(f"{path}: not valid TOML: {e}") from None
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise GtxError(f"{path}: unknown key {unknown[0]!r}; a grid file has {', '.join(sorted(FILE_KEYS))}")
    out: dict = {a: _as_list(path, a, data[a]) for a in AXES if a in data}
    if "seeds" in data:
        out["seeds"] = ",".join(_as_list(path, "seeds", data["seeds"]))
        try:
            parse_seeds(out["seeds"])
        except GtxError as e:
            raise GtxError(f"{path}: {e}") from None
    if not isinstance(data.get("set", {}), dict):
        raise GtxError(f"{path}: set must be a table, [set] with key = value lines")
    out["settings"] = {k: _as_list(path, f"set.{k}", v) for k, v in _flat(data.get("set", {}))}
    checks = {
        "device": (lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda"),
        "results": (lambda v: isinstance(v, str), "a string"),
        "jobs": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
    }
    for key, (ok, what) in checks.items():
        if key in data:
            if not ok(data[key]):
                raise GtxError(f"{path}: {key} must be {what}, not {data[key]!r}")
            out[key] = data[key]
    return out
