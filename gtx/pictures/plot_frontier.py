"""The frontier figure (``gtx.pictures.plot.frontier``): accuracy against budget and against cost, per length.

Drawn from ``gtx.sweeps.frontier.frontier_table``'s numbers, or the same table read back from
the CSV ``gtx frontier`` writes under ``<results>/frontiers/``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from gtx.errors import GtxError
from gtx.pictures.figure import new_figure
from gtx.sweeps.study import FULL

NEEDED = ["task", "model", "length", "family", "pattern", "mean", "ci_low", "ci_high", "edges_per_query", "train_flops"]


def frontier(table: pd.DataFrame) -> Figure:
    """Two rows of panels, a column per length (per task, model and setting where a table holds several):
    top, the metric against edges per query (log scale), one line per family through its budgets with
    the 95% interval as a band, ``full`` as a grey band across; bottom, the metric against training
    GFLOP (log scale), ``full`` as a point with its interval. GtxError if the table lacks the columns."""
    missing = [c for c in NEEDED if c not in table.columns]
    if table.empty or missing:
        raise GtxError(
            f"not a frontier table: {'no rows' if table.empty else 'missing ' + ', '.join(missing)}; "
            "give gtx.sweeps.frontier.frontier_table's or a <results>/frontiers/*.csv"
        )
    where = list(table.columns[: table.columns.get_loc("family")])  # task, model, length, swept settings
    panels = list(table.groupby(where, sort=False))
    families = [f for f in dict.fromkeys(table.family) if f != FULL]
    colors = {f: f"C{i % 10}" for i, f in enumerate(families)}
    metric = str(table.metric.iloc[0]) if "metric" in table else "metric"
    fig = new_figure(4.2 * len(panels), 7.4)
    axes = fig.subplots(2, len(panels), squeeze=False)
    for col, (key, rows) in enumerate(panels):
        budget_ax, cost_ax = axes[0, col], axes[1, col]
        full = rows[rows.family == FULL]
        for family in families:
            line = rows[rows.family == family].sort_values("edges_per_query")
            if line.empty:
                continue
            for ax, x in ((budget_ax, line.edges_per_query), (cost_ax, line.train_flops / 1e9)):
                ax.plot(x, line["mean"], marker="o", color=colors[family], label=family)
                ax.fill_between(
                    x,
                    line.ci_low.fillna(line["mean"]),
                    line.ci_high.fillna(line["mean"]),
                    color=colors[family],
                    alpha=0.15,
                    linewidth=0,
                )
        if len(full):
            f = full.iloc[0]
            lo, hi = (f.ci_low, f.ci_high) if np.isfinite(f.ci_low) else (f["mean"], f["mean"])
            budget_ax.axhspan(lo, hi, color="0.5", alpha=0.25, linewidth=0)
            budget_ax.axhline(
                f["mean"], color="0.3", linestyle="--", linewidth=1, label=f"full ({f.edges_per_query:.0f} edges/query)"
            )
            cost_ax.errorbar(
                [f.train_flops / 1e9],
                [f["mean"]],
                yerr=[[f["mean"] - lo], [hi - f["mean"]]],
                fmt="s",
                color="0.3",
                capsize=3,
                label=FULL,
            )
        title = ", ".join(
            f"{c}={v}"
            for c, v in zip(where, key if isinstance(key, tuple) else (key,))
            if c not in ("task", "model") or len(panels) > 1
        )
        budget_ax.set_title(title, fontsize=10)
        budget_ax.set(
            xscale="log", xlabel="edges per query (measured; log)", ylabel=f"{metric}, mean and 95% CI over seeds"
        )
        cost_ax.set(xscale="log", xlabel="training GFLOP (counted; log)", ylabel=metric)
        for ax in (budget_ax, cost_ax):
            # a study's budgets and costs often span less than a decade: few decade ticks
            ax.xaxis.set_major_locator(MaxNLocator(5))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 16, 32, 64 rather than 1.6 x 10^1
            ax.xaxis.set_minor_locator(NullLocator())
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    return fig
