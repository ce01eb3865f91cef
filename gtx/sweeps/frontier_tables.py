"""A frontier's table once read: the smallest budget equivalent to full per cell, the largest compression
not significantly worse than full (paired tests), the cost front,
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
from gtx.sweeps.frontier_paired import PAIRED_COLUMNS
from gtx.sweeps.study import ALL, FULL


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


def largest_not_worse(table: pd.DataFrame) -> pd.DataFrame:
    """Per task, model, length, settings and family: the budget of the largest ``compression`` (full's
    keys per query over the budget's) that the paired test against full did not find significantly
    worse (``frontier_table``'s ``largest_not_worse``), with its pattern, accuracies and one-sided p;
    ``largest`` is ``none`` where every paired budget is worse, ``untested`` where none was paired (runs
    without per-sample outcomes). Empty for a table without paired columns (one saved before them)."""
    if "largest_not_worse" not in table:
        return pd.DataFrame()
    keys = list(table.columns[: table.columns.get_loc("family")])
    out = []
    for values, group in table[table.family != FULL].groupby([*keys, "family"], sort=False):
        pick = group[group.largest_not_worse.astype(bool)]
        row = {**dict(zip([*keys, "family"], values)), "phase": group.phase.iloc[0], "budgets": len(group)}
        if len(pick):
            best = pick.iloc[0]
            row.update(largest=best.budget, pattern=best.pattern, compression=best.compression)
            row.update(full_acc=best.full_acc, paired_acc=best.paired_acc, worse_p=best.worse_p)
        else:
            row.update(largest="none" if group.pairs.notna().any() else "untested", pattern="-")
            row.update({c: math.nan for c in ("compression", "full_acc", "paired_acc", "worse_p")})
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
        if c
        not in ("tokens_per_s", "speed_vs_full", "tost_p", "margin", "equivalent", "train_attn_flops", *PAIRED_COLUMNS)
    ]
    return pd.concat(out)[columns].reset_index(drop=True) if out else table[columns]


def format_frontier(table: pd.DataFrame, fmt: str = "table") -> str:
    """``frontier_table`` (or ``cost_front``) rendered: CSV as numbers; table and markdown with ``mean ±
    std``, the 95% interval, the compression (``8.0x``), cost in GFLOP, ``tost_p``/``equivalent``
    (``yes``, ``no``, ``-`` untested) and, where runs held per-sample outcomes, the paired test
    (full's and the budget's accuracy on the pairs, the discordant pairs ``worse/better``, the
    two-sided p, the one-sided ``worse_p`` and ``worse``: significantly worse than full). The phase
    is shown where a family has one."""
    if fmt == "csv" or table.empty:
        return format_table(table, fmt)
    one = table.metric.nunique() == 1
    view = table.loc[:, :"runs"].copy()
    if "phase" in view and (view.phase == ALL).all():
        view = view.drop(columns="phase")
    if not one:
        view["metric"] = table.metric
    view[table.metric.iloc[0] if one else "score"] = [pm_text(m, s) for m, s in zip(table["mean"], table["std"])]
    view["ci95"] = [
        "-" if np.isnan(a) else f"[{cell_text(a)}, {cell_text(b)}]" for a, b in zip(table.ci_low, table.ci_high)
    ]
    view["density"] = table.density
    view["edges/query"] = table.edges_per_query
    if "compression" in table:
        view["compression"] = ["-" if np.isnan(c) else f"{c:.1f}x" for c in table.compression.astype(float)]
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
    if "pairs" in table and table.pairs.notna().any():
        paired = table.pairs.notna()
        view["pairs"] = [
            "-" if not ok else f"{int(n)} ({t})" for ok, n, t in zip(paired, table.pairs, table.paired_test)
        ]
        view["full_acc"] = table.full_acc
        view["paired_acc"] = table.paired_acc
        view["worse/better"] = [
            f"{int(w)}/{int(b)}" if ok else "-" for ok, w, b in zip(paired, table.worse_pairs, table.better_pairs)
        ]
        view["p"] = [p_text(p) for p in table.paired_p]
        view["worse_p"] = [p_text(p) for p in table.worse_p]
        view["worse"] = ["-" if not ok else "yes" if s else "no" for ok, s in zip(paired, table.sig_worse.astype(bool))]
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
