"""``gtx compare``: runs grouped by experiment, summarised over seeds, tested against ``full``.

A group pools only runs of one experiment, runs whose task, model, pattern, backend and every
resolved setting are equal (``experiment_of``): they differ by seed alone, and the spread is over
seeds. Where the ``--by`` columns would leave several experiments in one group, the group is split
and a ``settings`` column names what differs. ``full`` is matched within the same experiment but
for the pattern. Evaluations (``gtx eval`` rows) are compared with the same checkpoint under its
training pattern (``compare_evals``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
import pandas as pd

from gtx.errors import GtxError
from gtx.graph.pattern import STAGES
from gtx.plugins.registry import task_metrics as registered_task_metrics
from gtx.records.results import (
    COLUMNS,
    cell_text,
    differing,
    finished,
    format_table,
    lower_is_better,
    metric_range,
    metric_values,
    scalar_metrics,
    settings_of,
    settings_text,
    training_runs,
)
from gtx.records.stats import paired_p, pareto_front, summarize, verdict, welch_p

#: compare()'s per-run metrics before the task's own (``best_valid_<name>``) and the speed
RUN_METRICS = ["best_valid_token_acc", "best_valid_seq_acc", "best_valid_loss", "test_seq_acc"]
SPEED = "train_tokens_per_s"
DEFAULT_BY = ("task", "model", "pattern", "backend")
FALLBACK_METRIC = "token_acc"  # a task without a declared metric, or whose metric these runs lack


# results columns a run has a value of per epoch and split, not one of its own: --by refuses them. (context_len
# is a run's too: its first row's, the training phase's longest sequence, the length it trains at.)
PHASE_COLUMNS = (
    *("epoch", "split", "loss", "token_acc", "seq_acc", "tokens_per_s", "wall_s", "peak_mem_mb", "flops", "attn_flops"),
    *("density", "edges_per_query_ee", "edges_per_query_dd", "edges_per_query_ed", "act_mean_steps", "metrics"),
    "backend_plan",
)


def check_by(by: Iterable[str], columns: Iterable[str] = COLUMNS) -> list[str]:
    """``--by``'s columns (items may hold several, comma-separated), checked: at least one, each a results
    column that a run holds once (not a ``PHASE_COLUMNS`` one), none twice."""
    by, columns = [c.strip() for item in by for c in item.split(",") if c.strip()], list(columns)
    if not by:
        raise GtxError(f"--by names no column; give some of: {', '.join(columns)}")
    unknown = [c for c in by if c not in columns]
    if unknown:
        raise GtxError(f"cannot group by {unknown}; columns are: {', '.join(columns)}")
    phases = [c for c in by if c in PHASE_COLUMNS]
    if phases:
        runs = ", ".join(c for c in columns if c not in PHASE_COLUMNS)
        raise GtxError(
            f"cannot group runs by {', '.join(phases)}: a run's rows differ there (one per epoch and split); group by "
            f"what a run holds once: {runs}"
        )
    repeated = sorted({c for c in by if by.count(c) > 1})
    if repeated:
        raise GtxError(f"--by names {', '.join(repeated)} more than once; name each column once")
    return by


def _signature(settings: dict, leave_out: Iterable[str] = ()) -> str:
    return json.dumps({k: v for k, v in settings.items() if k not in leave_out}, sort_keys=True, default=str)


def _per_run(rows: pd.DataFrame) -> dict:
    train, valid, test = (rows[rows.split == s] for s in ("train", "valid", "test"))
    last_train = train[train.epoch == train.epoch.max()]
    task = pd.DataFrame([scalar_metrics(json.loads(m)) for m in valid.metrics.dropna()])
    return {
        "best_valid_token_acc": valid.token_acc.max(),
        "best_valid_seq_acc": valid.seq_acc.max(),
        "best_valid_loss": valid.loss.min(),
        "test_seq_acc": test.seq_acc.iloc[-1] if len(test) else np.nan,
        # the task's own metrics, each at its best valid epoch; seq_acc and the like are columns already
        **{f"best_valid_{k}": v.min() if lower_is_better(k) else v.max() for k, v in task.items() if k not in COLUMNS},
        SPEED: last_train.tokens_per_s.iloc[-1] if len(last_train) else np.nan,
        "density": rows.density.mean(),
        # NaN stages left out; a run scored untrained (--epochs 0) trains nothing: its valid rows read the keys
        "edges_per_query": (train if len(train) else valid)[[f"edges_per_query_{s}" for s in STAGES]].mean().mean(),
        "train_flops": train.flops.sum(min_count=1),
        "train_attn_flops": train.attn_flops.sum(min_count=1),
        "train_s": train.wall_s.sum(min_count=1),
    }


def _metric_names(runs: pd.DataFrame, metric: str | None, task_metrics: dict[str, str] | None) -> pd.Series:
    """The metric each run is judged by: ``metric`` for all, else its task's own (``Task.metric``)."""
    metrics = RUN_METRICS + sorted(c for c in runs.columns if c.startswith("best_valid_") and c not in RUN_METRICS)
    if metric is not None:
        name = metric if metric in metrics else f"best_valid_{metric}"
        if name not in metrics:
            raise GtxError(
                f"unknown metric {metric!r}; metrics of these runs: {', '.join(m.removeprefix('best_valid_') for m in metrics)}"
            )
        return pd.Series(name, index=runs.index)

    def has(task: str, name: str) -> bool:
        return f"best_valid_{name}" in runs.columns and runs.loc[runs.task == task, f"best_valid_{name}"].notna().any()

    return runs.task.map({t: f"best_valid_{task_metric(t, has, task_metrics)}" for t in runs.task.unique()})


def task_metric(task: str, has, task_metrics: dict[str, str] | None = None) -> str:
    """The metric ``task``'s runs are judged by when none is asked for: its declared one
    (``Task.metric``: bpc for text, query_acc for recall) where ``has(task, name)``, else token_acc."""
    name = (registered_task_metrics() if task_metrics is None else task_metrics).get(task, FALLBACK_METRIC)
    return name if has(task, name) else FALLBACK_METRIC


def _clipped(values: pd.Series, metric: str):
    s = summarize(values)
    lo, hi = metric_range(metric)
    return s.mean, s.std, max(s.ci_low, lo), min(s.ci_high, hi)  # NaN stays NaN: max(nan, x) is nan


def run_table(
    df: pd.DataFrame,
    by: Iterable[str] = DEFAULT_BY,
    metric: str | None = None,
    task_metrics: dict[str, str] | None = None,
) -> pd.DataFrame:
    """One row per training run that a comparison counts (``training_runs``, finished ones only:
    ``results.finished``): the ``by`` columns, ``task``, ``run_id``, ``experiment`` and ``cell``, the
    per-run values ``compare`` summarises (see there), the cost (``train_flops``, ``train_attn_flops``:
    summed over the train rows; ``train_s``: their wall seconds), ``edges_per_query`` (the train rows'
    mean, or the valid rows' for a run scored untrained, averaged over the model's stages) and ``metric``, the name of the column the run is judged
    by. ``attrs["unfinished"]``: the run ids left out for having no test rows yet."""
    df = training_runs(df)
    done = finished(df)
    unfinished = list(df.run_id[~done].unique())
    df = df[done]
    per = []
    for run_id, rows in df.groupby("run_id", sort=False):
        settings = settings_of(rows)
        per.append(
            {
                **{c: rows[c].iloc[0] for c in by},
                **{c: rows[c].iloc[0] for c in ("task", "experiment", "cell")},
                "run_id": run_id,
                "_settings": settings,
                "_experiment": _signature(settings),
                "_baseline": _signature(settings, ["pattern"]),
                **_per_run(rows),
            }
        )
    runs = pd.DataFrame(per)
    if not runs.empty:
        runs["metric"] = _metric_names(runs, metric, task_metrics)
    runs.attrs["unfinished"] = unfinished
    return runs


def compare(
    df: pd.DataFrame,
    by: Iterable[str] = DEFAULT_BY,
    metric: str | None = None,
    task_metrics: dict[str, str] | None = None,
) -> pd.DataFrame:
    """One row per experiment within each group of ``by`` (seeds pooled), as numbers (``format_compare`` renders them).

    Per run: best valid token/sequence accuracy and loss over epochs, its test sequence accuracy, the
    task's own scalar metrics of the valid rows (``best_valid_bpc``, ``best_valid_query_acc``, ...: the
    best epoch's, min for ``lower_is_better`` metrics, else max), train tokens/s of its last epoch
    and its density. Eval rows are left out, runs of one cell count once (``training_runs``), and
    only finished runs count (``results.finished``): ``attrs["unfinished"]`` lists the run ids of
    those left out for having no test rows yet (still training, or stopped).

    Columns: the ``by`` keys; ``settings`` (what differs between experiments that share the ``by``
    values; empty where one experiment has them); ``runs`` (n); ``metric``, the metric each row is
    judged by (``metric`` if given, else the task's own: ``task_metrics`` maps a task to it,
    by default each registered task's ``Task.metric``); for each metric ``M`` and ``train_tokens_per_s``: ``M_mean``, ``M_std`` (ddof=1;
    NaN for one run), ``M_ci_low`` and ``M_ci_high`` (95% Student-t interval of the mean, clipped to
    the metric's range, ``results.metric_range``); ``density``. Against ``full`` of the same
    experiment but for the pattern: ``speed_vs_full``, ``p_vs_full`` (Welch's t-test of the row's
    metric over the runs; NaN with fewer than 2 runs a side), ``vs_full`` ("better", "worse" at
    p < 0.05, else "same"; "-" untested) and ``pareto`` (on the front of the metric against train
    tokens/s among those rows). ``attrs["metric"]``: the metric when all rows share one, else None.
    """
    by = check_by(by)
    runs = run_table(df, by, metric, task_metrics)
    unfinished = runs.attrs["unfinished"]
    if runs.empty:
        table = pd.DataFrame(columns=[*by, "runs"])
        table.attrs["unfinished"] = unfinished
        return table
    metrics = [c for c in runs.columns if c.startswith(("best_valid_", "test_"))]
    rows, samples = [], []
    for keys, group in runs.groupby([*by, "_experiment"], sort=True, dropna=False):
        name = group.metric.iloc[0]
        row = {
            **dict(zip(by, keys)),
            "runs": len(group),
            "metric": name,
            "_settings": group._settings.iloc[0],
            "_baseline": group._baseline.iloc[0],
        }
        for m in [*metrics, SPEED]:
            row.update(dict(zip((f"{m}_mean", f"{m}_std", f"{m}_ci_low", f"{m}_ci_high"), _clipped(group[m], m))))
        rows.append({**row, "density": group.density.mean()})
        samples.append(group[name].to_numpy(dtype=float))
    table = pd.DataFrame(rows)
    table.insert(len(by), "settings", "")
    for idx in table.groupby(by, sort=False, dropna=False).indices.values():
        if len(idx) > 1:  # the names (model, pattern, ...) compared like settings: as if prefixed
            named = [{k if "." in k else f"run.{k}": v for k, v in s.items()} for s in table.loc[idx, "_settings"]]
            table.loc[idx, "settings"] = [settings_text(s) for s in differing(named)]
    table = _against_full(table, samples).drop(columns=["_settings", "_baseline"])
    table.attrs["metric"] = table.metric.iloc[0] if table.metric.nunique() == 1 else None
    table.attrs["unfinished"] = unfinished
    return table


def _against_full(table: pd.DataFrame, samples: list[np.ndarray]) -> pd.DataFrame:
    """``compare``'s speed_vs_full, p_vs_full, vs_full and pareto, among rows of one experiment but for the pattern."""
    table = table.assign(speed_vs_full=np.nan, p_vs_full=np.nan, vs_full="-", pareto=False)
    for idx in table.groupby("_baseline", sort=False).groups.values():
        group = table.loc[idx]
        metric = group.metric.iloc[0]  # one task per baseline, so one metric
        sign = -1.0 if lower_is_better(metric) else 1.0  # oriented so that higher is better
        table.loc[idx, "pareto"] = pareto_front(sign * group[f"{metric}_mean"], group[f"{SPEED}_mean"])
        full = group.index[group.pattern == "full"] if "pattern" in group else []
        if not len(full):
            continue
        f = full[0]
        table.loc[idx, "speed_vs_full"] = group[f"{SPEED}_mean"] / group.at[f, f"{SPEED}_mean"]
        for i in idx.drop(f):
            p = welch_p(samples[i], samples[f])
            table.loc[i, ["p_vs_full", "vs_full"]] = (
                p,
                verdict(p, sign * (group.at[i, f"{metric}_mean"] - group.at[f, f"{metric}_mean"])),
            )
    return table


def compare_evals(
    df: pd.DataFrame,
    by: Iterable[str] = DEFAULT_BY,
    metric: str | None = None,
    task_metrics: dict[str, str] | None = None,
) -> pd.DataFrame:
    """``gtx eval`` runs, each beside the same checkpoint under its training pattern.

    An eval run scores a checkpoint (epoch ``e`` of run ``eval_of``) on one split under ``pattern``.
    Its baseline is the same checkpoint on the same split under the pattern it was trained with: an
    eval of it under that pattern if there is one, else the training run's own row of that split and
    epoch (the same model). One row per group of ``by`` + ``trained_pattern`` + ``split`` + experiment
    (seeds pooled): ``runs``, ``metric`` (the split's metric: ``metric``, else the task's own),
    ``value_mean/std/ci_low/ci_high``, ``trained_mean`` (the baselines' mean), ``delta_mean`` and
    ``delta_std`` (eval minus baseline, per checkpoint), ``p_vs_trained`` (paired t-test over the
    checkpoints; NaN for fewer than 2) and ``vs_trained`` (``stats.verdict``)."""
    by = check_by(by)
    evals = df[df.eval_of.notna()]
    task_metrics = registered_task_metrics() if task_metrics is None else task_metrics
    if evals.empty:
        raise GtxError(
            "no gtx eval runs among these results; evaluate a trained run first: gtx eval RUN_ID --pattern SPEC"
        )
    per = []
    for _, rows in evals.groupby("run_id", sort=False):
        row = rows.iloc[-1]
        config = json.loads(row.config)
        name = (metric or task_metrics.get(row.task, FALLBACK_METRIC)).removeprefix("best_valid_").removeprefix("test_")
        settings = settings_of(rows)
        per.append(
            {
                **{c: row[c] for c in by},
                "trained_pattern": config.get("trained_pattern", "?"),
                "split": row.split,
                "_experiment": _signature(settings, ["pattern"]),
                "metric": name,
                "value": float(metric_values(rows.iloc[-1:], name).iloc[0]),
                "trained": _trained_value(df, row, config.get("trained_pattern"), name),
            }
        )
    runs = pd.DataFrame(per)
    if runs.value.isna().all():
        raise GtxError(
            f"metric {runs.metric.iloc[0]!r} has no values in these eval runs; try token_acc, seq_acc, loss or the task's own metric"
        )
    out = []
    keys = list(dict.fromkeys([*by, "trained_pattern", "split", "_experiment"]))
    for values, group in runs.groupby(keys, sort=True, dropna=False):
        name = group.metric.iloc[0]
        lower = lower_is_better(name)
        mean, std, lo, hi = _clipped(group.value, name)
        delta = group.value - group.trained
        p = paired_p(group.value, group.trained)
        out.append(
            {
                **dict(zip(keys, values)),
                "runs": len(group),
                "metric": name,
                "value_mean": mean,
                "value_std": std,
                "value_ci_low": lo,
                "value_ci_high": hi,
                "trained_mean": group.trained.mean(),
                "delta_mean": delta.mean(),
                "delta_std": delta.std(),
                "p_vs_trained": p,
                "vs_trained": verdict(p, -delta.mean() if lower else delta.mean()),
            }
        )
    return pd.DataFrame(out).drop(columns="_experiment")


def _trained_value(df: pd.DataFrame, row: pd.Series, trained_pattern: str | None, name: str) -> float:
    """The checkpoint of eval row ``row`` on its split under its training pattern (see ``compare_evals``)."""
    same = df[
        (df.eval_of == row.eval_of)
        & (df.split == row.split)
        & (df.epoch == row.epoch)
        & (df.pattern == trained_pattern)
    ]
    if same.empty:
        same = df[(df.run_id == row.eval_of) & (df.split == row.split) & (df.epoch == row.epoch)]
    return float(metric_values(same.iloc[-1:], name).iloc[0]) if len(same) else np.nan


def format_compare(table: pd.DataFrame, fmt: str = "table") -> str:
    """Render ``compare()``'s or ``compare_evals()``'s table. CSV: the numeric columns as they are. Table
    and markdown, to stay readable: ``mean ± std`` (just the mean for one run), the judging metric
    first with its 95% interval (``ci95``; named after the metric when all rows share one, else a
    ``metric`` and a ``score`` column), metrics no run has and ``best_valid_loss`` (unless judged by
    it) left out, ``settings`` only where a group was split, ``*`` marking the front."""
    if fmt == "csv" or "runs" not in table.columns:
        return format_table(table, fmt)
    if "value_mean" in table.columns:
        return _format_evals(table, fmt)
    one = table.attrs.get("metric")
    view = table.loc[:, :"runs"].copy()
    if not view.settings.astype(bool).any():
        view = view.drop(columns="settings")
    judged = [
        table.at[i, f"{table.at[i, 'metric']}_{s}"] for i in table.index for s in ("mean", "std", "ci_low", "ci_high")
    ]
    mean, std, lo, hi = (judged[k::4] for k in range(4))
    if not one:
        view["metric"] = table.metric.str.removeprefix("best_valid_")
    view[one or "score"] = [pm_text(m, s) for m, s in zip(mean, std)]
    view["ci95"] = ["-" if np.isnan(a) else f"[{cell_text(a)}, {cell_text(b)}]" for a, b in zip(lo, hi)]
    names = [c.removesuffix("_mean") for c in table.columns if c.endswith("_mean")]
    for m in names:
        if m != one and table[f"{m}_mean"].notna().any() and (m != "best_valid_loss" or (table.metric == m).any()):
            view[m] = [pm_text(a, b) for a, b in zip(table[f"{m}_mean"], table[f"{m}_std"])]
    view["density"] = table.density
    view["speed_vs_full"] = table.speed_vs_full
    view["welch_p"] = [p_text(p) for p in table.p_vs_full]
    view["vs_full"] = table.vs_full
    view["pareto"] = np.where(table.pareto, "*", "")
    return format_table(view, fmt)


def _format_evals(table: pd.DataFrame, fmt: str) -> str:
    view = table.loc[:, :"metric"].copy()
    view["value"] = [pm_text(m, s) for m, s in zip(table.value_mean, table.value_std)]
    view["ci95"] = [
        "-" if np.isnan(a) else f"[{cell_text(a)}, {cell_text(b)}]"
        for a, b in zip(table.value_ci_low, table.value_ci_high)
    ]
    view["trained"] = table.trained_mean
    view["delta"] = [pm_text(m, s) for m, s in zip(table.delta_mean, table.delta_std)]
    view["p"] = [p_text(p) for p in table.p_vs_trained]
    view["vs_trained"] = table.vs_trained
    return format_table(view, fmt)


def p_text(p: float) -> str:
    return "-" if np.isnan(p) else "<0.001" if p < 0.001 else f"{p:.3f}"


def pm_text(mean: float, std: float) -> str:
    if np.isnan(std):
        return cell_text(mean)
    return f"{cell_text(mean)} ± {f'{std:.4f}' if abs(mean) < 10 else cell_text(std)}"  # std to the mean's precision
