"""The HTML report of a results folder: one self-contained page that opens from disk in a browser.

Images are embedded as base64 PNG data URIs and the styling is inline: no server, no external CSS,
no script. Sections: the ``gtx compare`` table, the results figure (``gtx.pictures.plot.results``), each
pattern's picture at a typical length of its runs, and every run's configuration.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
from pathlib import Path

import pandas as pd

from gtx.errors import GtxError
from gtx.graph.pattern import STAGES
from gtx.pictures import plot
from gtx.pictures.figure import png_bytes, ready_to_write
from gtx.records.compare import check_by, compare, format_compare
from gtx.records.layout import ResultsFolder
from gtx.records.results import load, training_runs
from gtx.sweeps.frontier_tables import format_frontier, load_frontiers

DEFAULT_LEN = 64  # pattern pictures of runs without a recorded context_len
MAX_LEN = 4096  # longer contexts are drawn at this length: building the edges of a longer one takes long

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1800px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: .85em; display: block; overflow-x: auto; }
th, td { border: 1px solid #ddd; padding: .25em .4em; text-align: left; white-space: nowrap; }
th { background: #f3f3f3; white-space: normal; min-width: 3em; }
td.wrap { white-space: normal; min-width: 12em; }
img { max-width: 100%; height: auto; display: block; margin: .5em 0 1.5em; }
details { margin: .3em 0; } summary { cursor: pointer; font-family: monospace; }
pre { background: #f7f7f7; padding: .7em; overflow-x: auto; font-size: .85em; }
.note { color: #666; font-size: .9em; }
"""


def _img(fig, alt: str) -> str:
    data = base64.b64encode(png_bytes(fig)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def comparison_html(df: pd.DataFrame) -> str:
    """``gtx compare``'s table (``gtx.records.compare.compare``, rendered by ``format_compare``) as an HTML
    table. The markdown rendering pads every column to a fixed width, so the separator line's '|' mark
    the column edges exactly, also around cells that hold a '|' themselves (``local:w=2|strided:l=4``).
    Runs left out for being unfinished are named in a note under it."""
    table = compare(df)
    unfinished = table.attrs.get("unfinished") or []
    note = (
        _note(f"Left out: {len(unfinished)} unfinished run(s), without test rows yet: {', '.join(unfinished)}")
        if unfinished
        else ""
    )
    return _html_table(format_compare(table, "markdown"), after=("ci95", VERDICT)) + note


#: the comparison's verdict on each row: in the report beside the judged metric's interval, not past
#: the other metrics' columns, where a window narrower than the table hid it
VERDICT = ("vs_full", "welch_p", "pareto")


def _html_table(markdown: str, after: tuple[str, tuple[str, ...]] | None = None) -> str:
    """A table rendered as gtx's fixed-width markdown, as an HTML table. ``after``: (a column, the
    columns moved to follow it). Headers break after their underscores, a settings cell between its
    settings: the table is as narrow as its figures allow."""
    lines = markdown.splitlines()
    edges = [i for i, ch in enumerate(lines[1]) if ch == "|"]
    cells = [[line[a + 1 : b].strip() for a, b in zip(edges, edges[1:])] for line in lines]
    order = list(range(len(cells[0])))
    if after and after[0] in cells[0]:
        moved = [cells[0].index(c) for c in after[1] if c in cells[0]]
        rest = [i for i in order if i not in moved]
        at = rest.index(cells[0].index(after[0])) + 1
        order = rest[:at] + moved + rest[at:]
    td = ['<td class="wrap">' if name == "settings" else "<td>" for name in cells[0]]
    head = "".join(f"<th>{html.escape(cells[0][i]).replace('_', '_<wbr>')}</th>" for i in order)
    body = "".join(
        "<tr>" + "".join(f"{td[i]}{html.escape(row[i])}</td>" for i in order) + "</tr>\n" for row in cells[2:]
    )
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def pattern_length(rows: pd.DataFrame) -> int:
    """A typical length for a pattern's picture: the median context_len of its rows, capped at MAX_LEN."""
    lens = pd.to_numeric(rows["context_len"], errors="coerce").dropna()
    return min(int(lens.median()), MAX_LEN) if len(lens) else DEFAULT_LEN


def patterns_html(df: pd.DataFrame) -> str:
    """One picture per pattern of the runs, of the stages its runs used (the stages with edges per
    query); a pattern that only evaluations (``gtx eval``) used is headed as such."""
    parts = []
    for spec, rows in df.groupby("pattern", sort=True):
        stages = [s for s in STAGES if rows[f"edges_per_query_{s}"].notna().any()] or list(STAGES)
        n = pattern_length(rows)
        evaluated = " (evaluations only: gtx eval)" if rows.eval_of.notna().all() else ""
        parts.append(f"<h3>{html.escape(str(spec) + evaluated)}</h3>")
        try:
            parts.append(_img(plot.pattern(spec, src_len=n, stages=stages), f"pattern {spec}"))
        except GtxError as e:  # e.g. a pattern from a plugin that is not loaded here: the rest of the report stands
            parts.append(_note(f"cannot draw pattern {spec}: {e}"))
    return "\n".join(parts)


def configs_html(df: pd.DataFrame) -> str:
    """Each run's resolved configuration (the ``config`` JSON column) in a collapsible block; an
    evaluation (``gtx eval``) is summarised as one, not as a run of its own."""
    parts = []
    for run_id, rows in df.groupby("run_id", sort=True):
        first = rows.iloc[0]
        try:
            text = json.dumps(json.loads(first["config"]), indent=2, sort_keys=True)
        except (TypeError, ValueError):
            text = str(first["config"])
        summary = (
            f"{run_id}: evaluation of run {first['eval_of']} under {first['pattern']} / {first['backend']} "
            f"on its {first['split']} split"
            if isinstance(first["eval_of"], str)
            else f"{run_id}: {first['task']} / {first['model']} / {first['pattern']} / {first['backend']}, "
            f"seed {first['seed']}, {rows['epoch'].max()} epochs"
        )
        parts.append(f"<details><summary>{html.escape(summary)}</summary><pre>{html.escape(text)}</pre></details>")
    return "\n".join(parts)


def frontiers_html(frontiers: dict[str, pd.DataFrame]) -> str:
    """Each saved frontier (``gtx.sweeps.frontier_tables.load_frontiers``): its table and figure."""
    parts = []
    for name, table in frontiers.items():
        margin = f" at margin {table['margin'].iloc[0]:g}" if "margin" in table and len(table) else ""
        parts.append(
            f"<h3>{html.escape(name)}</h3>\n{_html_table(format_frontier(table, 'markdown'))}\n"
            f"{_img(plot.frontier(table), f'frontier {name}: metric against budget and cost')}{_note('equivalent: TOST against full' + margin)}"
        )
    return "\n".join(parts)


OWN_METRIC = "each task's own metric (bpc for text, query_acc for recall, ...)"


def report(
    df: pd.DataFrame,
    source: str = "",
    by=("task", "model"),
    metric: str | None = None,
    frontiers: dict[str, pd.DataFrame] | None = None,
) -> str:
    """The report page of a results frame (``gtx.records.results.load``) as an HTML string; ``source`` names
    where the runs came from. ``by`` and ``metric`` go to ``gtx.pictures.plot.results``; ``frontiers``
    (``gtx.sweeps.frontier_tables.load_frontiers``) add a section. GtxError if there are no runs, or
    ``by`` or ``metric`` name nothing these runs have."""
    if df.empty:
        raise GtxError(f"no runs in {source or 'the results'}; run `gtx run` first")
    by = check_by(by, df.columns)  # a bad --by or --metric is the user's error, not a note inside the page
    if training_runs(df).empty:
        figure = _note("no results plot: these results hold only evaluations (gtx eval), no training runs")
    else:
        figure = _img(plot.results(df, by=by, metric=metric), "accuracy against speed, and learning curves")
    frontier_section = (
        ""
        if not frontiers
        else (
            '<h2>Frontiers</h2>\n<p class="note">As <code>gtx frontier</code> printed them: per length, each family\'s budgets against full, mean '
            f"and 95% CI over seeds; top panels against edges per query, bottom against training FLOPs.</p>\n{frontiers_html(frontiers)}\n"
        )
    )
    trained, evals = df[df.eval_of.isna()], df[df.eval_of.notna()]
    counted = f"{trained.run_id.nunique()} runs" + (
        f" and {evals.run_id.nunique()} evaluations of them (gtx eval)" if len(evals) else ""
    )
    only_evaluated = sorted(set(evals.pattern) - set(trained.pattern))
    patterns = ", ".join(map(str, sorted(trained.pattern.unique()))) + (
        f"; evaluated under {', '.join(only_evaluated)}" if only_evaluated else ""
    )
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"gtx report: {source}" if source else "gtx report"
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="note">{counted}; tasks: {html.escape(", ".join(map(str, sorted(df["task"].unique()))))};
patterns: {html.escape(patterns)}. Generated {when}.</p>
<h2>Comparison</h2>
<p class="note">As <code>gtx compare</code> prints it: one row per task, model, pattern and backend, over its runs.</p>
{comparison_html(df)}
<h2>Accuracy against speed</h2>
<p class="note">Top: {html.escape(metric or OWN_METRIC)} against training tokens/s, mean and std over runs (seeds), with the Pareto front.
Bottom: the valid metric per epoch, mean and std over runs.</p>
{figure}
{frontier_section}<h2>Patterns</h2>
<p class="note">Rows are queries, columns keys, dark cells edges; drawn at the runs' median context length (at most {MAX_LEN}).</p>
{patterns_html(df)}
<h2>Run configurations</h2>
{configs_html(df)}
</body>
</html>
"""


def write_report(results_dir: str | Path, path: str | Path | None = None, **kw) -> Path:
    """Write the report of the runs under ``results_dir`` to ``path`` (default
    ``<results_dir>/report.html``); returns the path. GtxError if there are no runs or the path
    cannot be written."""
    results_dir = Path(results_dir)
    df = load(results_dir)
    if df.empty:
        raise GtxError(f"no runs under {ResultsFolder(results_dir).runs()}; run `gtx run` first, or pass --results DIR")
    path = Path(path) if path is not None else ResultsFolder(results_dir).report()
    text = report(df, source=str(results_dir), frontiers=load_frontiers(results_dir), **kw)
    ready_to_write(path)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise GtxError(f"cannot write {path}: {e.strerror or e}; choose another path") from None
    return path
