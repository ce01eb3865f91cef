"""Figure tables: the CSVs behind the docs' tables, each with what produced it, and the pages' table
blocks made from them.

A figure table is ``NAME.csv`` (as the command that measured it wrote it, or its figures copied out)
beside ``NAME.toml``, its provenance::

    command = "gtx bench train --task text ..."   # what produced the rows
    commit = "6bcd939"                            # the commit whose code was measured
    machine = "cpu2"                              # where (the page says what each machine is)
    date = "2026-11-27"
    columns = ["pattern", "step_ms"]              # optional: the columns a page shows, in order (default: all)

    [definitions]                                 # the definition version of each method in the rows that declares one
    dsa = 2

A page shows one between two markers, which ``make docs`` fills (``fill``) with the CSV as a
markdown table::

    <!-- table: results/NAME.csv -->
    <!-- end table -->

``problems`` is what tests/test_figures.py holds to nothing: a CSV without its provenance, a table
that cites a definition version the registered methods no longer have (or names a method that
declares one without saying which), and a page's block that is not its CSV.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gtx.errors import GtxError
from gtx.files import atomic_write
from gtx.records.results import cell_text

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: what every provenance file states
FIELDS = ("command", "commit", "machine", "date")
#: the folders of figure tables, relative to the checkout, and the pages that may show them
FOLDERS = ("docs/results", "docs/gpu")
PAGES = "docs"
BLOCK = re.compile(r"(<!-- table: (?P<csv>\S+\.csv) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)
# a number written with more decimals than a table shows (a bench's CSV as written): shown as gtx's tables show numbers
_LONG = re.compile(r"-?\d+\.\d{5,}\Z")


@dataclass(frozen=True)
class Figures:
    """One figure table: its rows as written (text), and its provenance (``FIELDS``, ``definitions``, ``columns``)."""

    path: Path
    rows: pd.DataFrame
    provenance: dict

    @property
    def definitions(self) -> dict[str, int]:
        return dict(self.provenance.get("definitions", {}))

    def markdown(self) -> str:
        """The table as a page shows it: the chosen columns, each cell as the CSV writes it (a number with
        more than 4 decimals as ``cell_text`` rounds it), ``|`` escaped."""
        columns = self.provenance.get("columns") or list(self.rows.columns)
        lines = ["| " + " | ".join(_escape(c) for c in columns) + " |", "|" + "---|" * len(columns)]
        for _, row in self.rows[columns].iterrows():
            lines.append("| " + " | ".join(_escape(_shown(v)) for v in row) + " |")
        return "\n".join(lines) + "\n"


def _shown(text: str) -> str:
    return cell_text(float(text)) if _LONG.match(text) else text


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def sidecar(csv: Path) -> Path:
    """The provenance file of a figure table: ``NAME.toml`` beside ``NAME.csv``."""
    return csv.with_suffix(".toml")


def read(csv: str | Path) -> Figures:
    """A figure table and its provenance; one GtxError line where either is missing or incomplete."""
    csv = Path(csv)
    about = sidecar(csv)
    if not csv.is_file():
        raise GtxError(f"figure table {csv} does not exist")
    if not about.is_file():
        raise GtxError(
            f"{csv} has no provenance: write {about.name} beside it with {', '.join(FIELDS)} (gtx.records.figures)"
        )
    try:
        provenance = tomllib.loads(about.read_text())
    except tomllib.TOMLDecodeError as e:
        raise GtxError(f"{about}: not TOML ({e})") from None
    missing = [f for f in FIELDS if not str(provenance.get(f, "")).strip()]
    if missing:
        raise GtxError(f"{about} lacks {', '.join(missing)}: say what produced {csv.name}")
    provenance = {**provenance, **{f: str(provenance[f]) for f in FIELDS}}  # a TOML date reads as a date
    definitions = provenance.get("definitions", {})
    if not isinstance(definitions, dict) or any(type(v) is not int or v < 1 for v in definitions.values()):
        raise GtxError(
            f"{about}: [definitions] maps each method's name to its version, a whole number from 1 (dsa = 2)"
        )
    try:
        rows = pd.read_csv(csv, dtype=str, keep_default_na=False)
    except (ValueError, pd.errors.ParserError) as e:
        raise GtxError(f"{csv}: not a CSV table ({e})") from None
    columns = provenance.get("columns")
    if columns is not None and (not isinstance(columns, list) or [c for c in columns if c not in rows.columns]):
        raise GtxError(f"{about}: columns names {columns!r}; the CSV's columns are {', '.join(rows.columns)}")
    return Figures(csv, rows, provenance)


def fill(text: str, folder: Path) -> str:
    """A page's text with each table block replaced by its CSV's table (paths relative to ``folder``, the page's)."""
    # blank lines around the table: the markers are HTML blocks, and a line after a table would be read as its row
    return BLOCK.sub(lambda m: f"{m.group(1)}\n{read(folder / m.group('csv')).markdown()}\n{m.group(4)}", text)


def current_definitions() -> dict[str, int]:
    """The definition version of every registered pattern and score bias that declares one."""
    from gtx.plugins.registry import BIASES, PATTERNS

    entries = [*PATTERNS.entries().values(), *BIASES.entries().values()]
    return {e.name: e.definition for e in entries if e.definition is not None}


def cited(figures: Figures, definitions: dict[str, int]) -> list[str]:
    """What a table says of the methods' definitions that the code contradicts: a version it cites that
    the method no longer has, a method it cites that is gone, a method its cells name without a version."""
    name = figures.path.name
    out = []
    for method, version in sorted(figures.definitions.items()):
        if method not in definitions:
            out.append(f"{name} cites {method} definition {version}, and no registered method declares {method}'s")
        elif definitions[method] != version:
            out.append(
                f"{name} cites {method} definition {version}; the code's {method} is definition {definitions[method]}: "
                f"measure it again ({figures.provenance['command']}) or remove the table"
            )
    text = "\n".join(" ".join(row) for row in figures.rows.itertuples(index=False))
    for method in sorted(set(definitions) - set(figures.definitions)):
        if re.search(rf"(?<![\w-]){re.escape(method)}(?![\w-])", text):
            out.append(
                f"{name} names {method} in its rows but not the definition they ran under: add {method} = "
                f"{definitions[method]} under [definitions] in {sidecar(figures.path).name} if they ran under it"
            )
    return out


def problems(root: str | Path) -> list[str]:
    """Every figure table under ``root``'s ``FOLDERS`` read with its provenance and its definitions
    checked against the registered methods; every block of the pages under ``root/PAGES`` equal to its
    CSV. One line per problem."""
    root = Path(root)
    definitions = current_definitions()
    out = []
    for csv in sorted(p for folder in FOLDERS for p in (root / folder).glob("*.csv")):
        try:
            out += [f"{csv.relative_to(root)}: {p}" for p in cited(read(csv), definitions)]
        except GtxError as e:
            out.append(str(e))
    for page in sorted((root / PAGES).glob("*.md")):
        text = page.read_text()
        try:
            if fill(text, page.parent) != text:
                out.append(f"{page.relative_to(root)}: a table block is not its CSV: make docs")
        except GtxError as e:
            out.append(f"{page.relative_to(root)}: {e}")
    return out


def write_pages(root: str | Path) -> list[Path]:
    """Each page under ``root/PAGES`` that shows a figure table, its blocks filled from the CSVs."""
    written = []
    for page in sorted((Path(root) / PAGES).glob("*.md")):
        text = page.read_text()
        if BLOCK.search(text):
            atomic_write(page, fill(text, page.parent))
            written.append(page)
    return written
