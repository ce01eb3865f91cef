"""A frontier's table once read: the smallest budget equivalent to full per cell, the cost front,
its printed form, and where ``gtx frontier`` keeps its tables (``load_frontiers`` reads them back)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from gtx.errors import GtxError
from gtx.records.compare import p_text, pm_text
from gtx.records.layout import ResultsFolder
from gtx.records.results import cell_text, format_table, lower_is_better
from gtx.records.stats import pareto_front
from gtx.sweeps.study import FULL


def equivalent_budgets(table: pd.DataFrame) -> pd.DataFrame:
    """Per task, model, length, settings and family: the smallest budget (fewest edges per query)
    equivalent to ``full`` (``frontier_table``'s ``equivalent``), its density and edges per query;
    ``smallest`` is ``none`` where no budget is (``untested`` where no budget had 2 runs and a full)."""
    keys = list(table.columns[: table.columns.get_loc("family")])
    out = []
    for values, group in table[table.family != FULL].groupby([*keys, "family"], sort=False):
        ok = group[group.equivalent.astype(bool)].sort_values("edges_per_query")
        row = {**dict(zip([*keys, "family"], values)), "budgets": len(group)}
        if len(ok):
            best = ok.iloc[0]
            row.update(
                smallest=best.budget,
                pattern=best.pattern,
                density=best.density,
                edges_per_query=best.edges_per_query,
                tost_p=best.tost_p,
            )
        else:
            row.update(
                smallest="none" if group.tost_p.notna().any() else "untested",
                pattern="-",
                density=math.nan,
                edges_per_query=math.nan,
                tost_p=math.nan,
            )
        out.append(row)
    return pd.DataFrame(out)


def cost_front(table: pd.DataFrame) -> pd.DataFrame:
    """Per task and length, across models, sizes (the swept settings), families and budgets: the rows
    on the Pareto front of training cost (``train_flops``, lower is better) against the metric,
    cheapest first. "Does a larger sparse model beat a smaller dense one at equal cost?" is whether
    a sparse row of the larger size sits on it, at or below the smaller ``full``'s cost."""
    out = []
    for _, rows in table.groupby(["task", "length"], sort=False):
        sign = -1.0 if lower_is_better(f"best_valid_{rows.metric.iloc[0]}") else 1.0
        front = pareto_front(-rows.train_flops, sign * rows["mean"])
        out.append(rows[front].sort_values("train_flops"))
    columns = [
        c
        for c in table.columns
        if c not in ("tokens_per_s", "speed_vs_full", "tost_p", "margin", "equivalent", "train_attn_flops")
    ]
    return pd.concat(out)[columns].reset_index(drop=True) if out else table[columns]


def format_frontier(table: pd.DataFrame, fmt: str = "table") -> str:
    """``frontier_table`` (or ``cost_front``) rendered: CSV as numbers; table and markdown with ``mean ±
    std``, the 95% interval, cost in GFLOP and ``tost_p``/``equivalent`` (``yes``, ``no``, ``-`` untested)."""
    if fmt == "csv" or table.empty:
        return format_table(table, fmt)
    one = table.metric.nunique() == 1
    view = table.loc[:, :"runs"].copy()
    if not one:
        view["metric"] = table.metric
    view[table.metric.iloc[0] if one else "score"] = [pm_text(m, s) for m, s in zip(table["mean"], table["std"])]
    view["ci95"] = [
        "-" if np.isnan(a) else f"[{cell_text(a)}, {cell_text(b)}]" for a, b in zip(table.ci_low, table.ci_high)
    ]
    view["density"] = table.density
    view["edges/query"] = table.edges_per_query
    if "tokens_per_s" in table:
        view["tokens/s"] = table.tokens_per_s
        view["vs_full"] = table.speed_vs_full
    view["train_gflop"] = table.train_flops / 1e9
    view["train_s"] = table.train_s
    if "tost_p" in table:
        view["attn_share"] = table.train_attn_flops / table.train_flops
        view["tost_p"] = [p_text(p) for p in table.tost_p]
        view["equivalent"] = [
            "-" if np.isnan(p) else "yes" if e else "no" for p, e in zip(table.tost_p, table.equivalent)
        ]
    return format_table(view, fmt)


#: what every saved frontier table holds, with the columns read as numbers
FRONTIER_NEEDS = {"task": False, "model": False, "length": False, "family": False, "budget": False, "pattern": False,
                  "metric": False, "runs": True, "mean": True}  # fmt: skip


def load_frontiers(results_dir) -> dict[str, pd.DataFrame]:
    """Every frontier table saved under ``results_dir`` (``ResultsFolder.frontiers``), by name, as numbers;
    GtxError naming a file there that is no frontier table (another program's, cut short, not text)."""
    return {p.stem: _read_frontier(p) for p in sorted(ResultsFolder(results_dir).frontiers().glob("*.csv"))}


def _read_frontier(path: Path) -> pd.DataFrame:
    fix = f"move it out of {path.parent} or run gtx frontier again to write it anew"
    try:
        table = pd.read_csv(path, dtype={"length": str, "budget": str})
    except (OSError, ValueError, pd.errors.ParserError) as e:  # a folder, not UTF-8, empty, ragged
        raise GtxError(f"{path} cannot be read as a frontier table ({str(e).splitlines()[0]}); {fix}") from None
    missing = [c for c in FRONTIER_NEEDS if c not in table.columns]
    if missing:
        raise GtxError(f"{path} is no gtx frontier table: it lacks {', '.join(missing)}; {fix}")
    for column in (c for c, numeric in FRONTIER_NEEDS.items() if numeric and len(table)):
        if not pd.api.types.is_numeric_dtype(table[column]):
            raise GtxError(f"{path}: its {column} column holds text where a frontier table holds numbers; {fix}")
    if table[["family", "budget", "pattern", "metric"]].isna().any(axis=None):
        raise GtxError(f"{path}: a row without its family, budget, pattern or metric (a table cut short?); {fix}")
    return table
