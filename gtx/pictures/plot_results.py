"""The results figure: per group of runs, the metric against training speed (each run, its group's
mean and the Pareto front) and the learning curves; ``run_table`` and ``curve_table`` are its data."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gtx.errors import GtxError
from gtx.pictures.figure import new_figure
from gtx.records.compare import task_metric
from gtx.records.results import lower_is_better, metric_range, metric_values, training_runs
from gtx.records.stats import pareto_front

MAX_COLUMNS = 3  # groups side by side in the results figure: 7 in one row made it 3920 px wide


def parse_metric(metric: str) -> tuple[str, str, bool]:
    """(kind, base, higher_is_better): ``best_valid_X`` (best over valid epochs; also plain ``X``)
    or ``test_X`` (the test row); X is a results column (loss, token_acc, seq_acc) or a task metric
    in the ``metrics`` JSON (bpc, bleu, query_acc, ...)."""
    kind, base = "best_valid", metric
    for prefix in ("best_valid_", "test_"):
        if metric.startswith(prefix):
            kind, base = prefix[:-1], metric[len(prefix) :]
    return kind, base, not lower_is_better(base)


def _training_runs(df: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """``results.training_runs``: the rows of the runs ``results.compare`` counts, after checking ``by``."""
    unknown = [c for c in by if c not in df.columns]
    if unknown:
        raise GtxError(f"cannot group by {unknown}; columns are: {', '.join(df.columns)}")
    return training_runs(df)


def run_table(df: pd.DataFrame, by: Sequence[str], metric: str) -> pd.DataFrame:
    """One row per training run: the ``by`` columns, pattern, backend, seed, ``value`` (the metric:
    best over valid epochs, or the test value) and ``tokens_per_s`` (training, last epoch)."""
    kind, base, higher = parse_metric(metric)
    keep = list(dict.fromkeys([*by, "pattern", "backend", "seed"]))
    out = []
    for run_id, rows in _training_runs(df, by).groupby("run_id", sort=False):
        train = rows[rows.split == "train"]
        values = metric_values(rows[rows.split == ("valid" if kind == "best_valid" else "test")], base)
        if kind == "test":
            value = values.iloc[-1] if len(values) else np.nan
        else:
            value = values.max() if higher else values.min()
        tps = train[train.epoch == train.epoch.max()].tokens_per_s.iloc[-1] if len(train) else np.nan
        out.append({**{c: rows[c].iloc[0] for c in keep}, "run_id": run_id, "value": value, "tokens_per_s": tps})
    table = pd.DataFrame(out, columns=[*keep, "run_id", "value", "tokens_per_s"])
    if table.value.isna().all():
        raise GtxError(
            f"metric {metric!r} has no values in these runs; try best_valid_token_acc, best_valid_seq_acc, "
            "best_valid_loss, test_seq_acc, or a task metric such as best_valid_bpc"
        )
    return table


def curve_table(df: pd.DataFrame, by: Sequence[str], metric: str) -> pd.DataFrame:
    """The valid metric per run and epoch: the ``by`` columns, pattern, backend, run_id, epoch, value."""
    base = parse_metric(metric)[1]
    valid = _training_runs(df, by)
    valid = valid[valid.split == "valid"]
    keep = list(dict.fromkeys([*by, "pattern", "backend", "run_id", "epoch"]))
    return valid[keep].assign(value=metric_values(valid, base).to_numpy())


def _point_keys(runs: pd.DataFrame, by: Sequence[str]) -> list[str]:
    """A point per pattern; per (pattern, backend) when a panel would mix backends."""
    return ["pattern"] + (["backend"] if "backend" not in by and runs.backend.nunique() > 1 else [])


def _label(values) -> str:
    return " ".join(str(v) for v in (values if isinstance(values, tuple) else (values,)))


def own_metric(df: pd.DataFrame, task: str) -> str:
    """``best_valid_<name>`` of the metric ``task``'s runs in ``df`` are judged by, as ``gtx compare``
    picks it (``compare.task_metric``): the task's declared metric where its valid rows have it, else token_acc."""
    valid = df[df.split == "valid"]
    return "best_valid_" + task_metric(task, lambda t, name: metric_values(valid[valid.task == t], name).notna().any())


def _tables(df: pd.DataFrame, by: list[str], metric: str | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``run_table`` and ``curve_table`` with a ``metric`` column: ``metric`` for every run, else each task's own (``own_metric``)."""
    if metric is not None:
        return run_table(df, by, metric).assign(metric=metric), curve_table(df, by, metric).assign(metric=metric)
    tasks = {t: own_metric(df, t) for t in _training_runs(df, by).task.unique()}
    runs = [run_table(df[df.task == t], by, m).assign(metric=m) for t, m in tasks.items()]
    curves = [curve_table(df[df.task == t], by, m).assign(metric=m) for t, m in tasks.items()]
    return pd.concat(runs, ignore_index=True), pd.concat(curves, ignore_index=True)


def results(df: pd.DataFrame, by: Sequence[str] = ("task", "model"), metric: str | None = None) -> Figure:
    """Per group of ``by`` a column of two panels, ``MAX_COLUMNS`` groups to a row (more wrap). Top: the metric against training tokens/s, one point
    per pattern with error bars of the std over its runs (seeds) on both axes, the Pareto front as a
    dashed step line. Bottom: the valid metric per epoch, mean over runs, shaded +-1 std. ``metric``
    None: each task's own (``own_metric``: bpc for text, query_acc for recall), so a panel must not
    mix tasks judged by different metrics. Computed from ``gtx.records.results.load``'s per-epoch
    rows; GtxError if there are no runs, the metric has no values, or a panel would mix metrics."""
    by = list(by)
    if df.empty:
        raise GtxError("no runs to plot")
    runs, curves = _tables(df, by, metric)
    points = _point_keys(runs, by)
    labels = sorted({_label(k) for k, _ in runs.groupby(points)})
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    panels = list(runs.groupby(by, sort=True, dropna=False)) if by else [((), runs)]
    cols = min(len(panels), MAX_COLUMNS)
    rows = -(-len(panels) // cols)
    fig = new_figure(5.6 * cols, 8.4 * rows)
    axes = fig.subplots(2 * rows, cols, squeeze=False)
    for i, (key, group) in enumerate(panels):
        top, bottom = axes[2 * (i // cols), i % cols], axes[2 * (i // cols) + 1, i % cols]
        key = key if isinstance(key, tuple) else (key,)
        title = ", ".join(f"{c}={v}" for c, v in zip(by, key)) or "all runs"
        if group.metric.nunique() > 1:
            raise GtxError(
                f"the panel {title} holds tasks judged by different metrics ({', '.join(sorted(group.metric.unique()))}); "
                "split the panels by task (--by task,...) or give one --metric"
            )
        _, base, higher = parse_metric(group.metric.iloc[0])
        _tradeoff(top, group, points, colors, group.metric.iloc[0], higher)
        _curves(bottom, curves[curves.run_id.isin(group.run_id)], points, colors, base)
        top.set_title(title, fontsize=10)
    for i in range(len(panels), rows * cols):  # the last row's empty places
        axes[2 * (i // cols), i % cols].set_axis_off()
        axes[2 * (i // cols) + 1, i % cols].set_axis_off()
    return fig


def _tradeoff(ax, runs: pd.DataFrame, points: list[str], colors: dict, metric: str, higher: bool) -> None:
    stats = runs.groupby(points).agg(
        x=("tokens_per_s", "mean"),
        sx=("tokens_per_s", "std"),
        y=("value", "mean"),
        sy=("value", "std"),
        n=("run_id", "count"),
    )
    y_range = metric_range(metric)
    for key, s in stats.iterrows():
        label = _label(key)
        # std of a single run is NaN: no bar rather than no point; a bar ends where the values can
        # (tokens/s at 0, an accuracy at 0 and 1), never past it (throughput's reached -2,000)
        ax.errorbar(
            s.x,
            s.y,
            xerr=_bar(s.x, s.sx, (0.0, np.inf)),
            yerr=_bar(s.y, s.sy, y_range),
            fmt="o",
            capsize=3,
            color=colors[label],
            label=f"{label} (n={int(s.n)})",
        )
    front = stats[pareto_front(stats.x, stats.y if higher else -stats.y)].sort_values("x")
    fx, fy = front.x.to_numpy(float), front.y.to_numpy(float)
    # the front as a staircase: every point behind it is beaten on both speed and metric; rings mark its points
    ax.step(fx, fy, where="pre", color="0.4", linestyle="--", linewidth=1, zorder=0, label="Pareto front")
    ax.plot(fx, fy, linestyle="none", marker="o", markersize=13, markerfacecolor="none", markeredgecolor="0.4")
    ax.set(xlabel="training tokens/s (last epoch)", ylabel=f"{metric} ({'higher' if higher else 'lower'} is better)")
    # the autoscaled view's margin must not reach below what the values can be (0 tokens/s, an accuracy of 0)
    ax.set_xlim(left=max(ax.get_xlim()[0], 0.0))
    ax.set_ylim(bottom=max(ax.get_ylim()[0], y_range[0]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _bar(mean: float, std: float, limits: tuple[float, float]) -> list[list[float]]:
    """An error bar of +-std about ``mean`` as matplotlib takes it ([[below], [above]]), cut at ``limits``."""
    std = float(np.nan_to_num(std))
    return [[max(0.0, min(std, mean - limits[0]))], [max(0.0, min(std, limits[1] - mean))]]


def _curves(ax, curves: pd.DataFrame, points: list[str], colors: dict, base: str) -> None:
    curves = curves.dropna(subset=["value"])
    if curves.empty:
        ax.text(0.5, 0.5, f"no valid {base} per epoch", ha="center", va="center", transform=ax.transAxes)
    for key, rows in curves.groupby(points):
        label = _label(key)
        s = rows.groupby("epoch").value.agg(["mean", "std"]).fillna({"std": 0.0})  # one run: no band
        ax.plot(s.index, s["mean"], marker=".", color=colors[label], label=label)
        low, high = metric_range(base)
        ax.fill_between(
            s.index,
            (s["mean"] - s["std"]).clip(lower=low),
            (s["mean"] + s["std"]).clip(upper=high),
            color=colors[label],
            alpha=0.2,
            linewidth=0,
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="epoch", ylabel=f"valid {base} (mean +- std over runs)")
    ax.grid(alpha=0.3)
    if not curves.empty:
        ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------
