"""The results tables: one declared schema, validated on write, atomic and concurrent-safe.

Each run writes its own file ``<results>/runs/<run_id>.csv`` (one row per epoch x split), replaced
atomically after every epoch: a run killed at any moment leaves earlier runs, and its own earlier
epochs, intact; two runs writing into one folder never touch the same file. ``load`` reads them all.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from gtx.errors import GtxError
from gtx.stats import pareto_front, summarize, verdict, welch_p
from gtx.task import SPLITS, atomic_write

SCHEMA_VERSION = 3
#: columns added since version 1, with the value older files get on load
ADDED = {"context_len": pd.NA, "density": float("nan"), "cell": pd.NA, "eval_of": pd.NA}

#: name -> pandas dtype, in column order
COLUMNS: dict[str, str] = {
    "schema_version": "int64",
    "run_id": "string",
    "started_at": "string",  # ISO 8601, UTC
    "task": "string",
    "model": "string",
    "pattern": "string",  # canonical spec with parameters, e.g. "local:w=4"
    "backend": "string",
    "device": "string",
    "seed": "int64",
    "cell": "string",  # the experiment's key (runner.cell_key): runs of one configuration and seed share it; <NA> before schema 3
    "eval_of": "string",  # `gtx eval` rows: the run whose checkpoint was evaluated; <NA> for training runs
    "epoch": "int64",  # 1-based; test rows carry the last epoch
    "split": "string",  # train | valid | test
    "loss": "float64",  # mean cross-entropy (nats) per scored target, teacher forced, no label smoothing
    "token_acc": "float64",  # teacher-forced token accuracy
    "seq_acc": "float64",  # exact-match accuracy of decoded outputs; classify: accuracy; NaN where not decoded (train, lm)
    "tokens_per_s": "float64",  # tokens computed per second of wall time (decoder tokens; encoder tokens for classify)
    "wall_s": "float64",  # wall time of the phase (s)
    "peak_mem_mb": "float64",  # CUDA: peak allocated in the phase; CPU: peak RSS of the process
    "context_len": "Int64",  # the longest sequence of the phase (tokens); <NA> in schema 1 files
    "density": "float64",  # edges over the edges the stages allow (dd: the causal triangle); 1.0 = full attention
    "edges_per_query_ee": "float64",
    "edges_per_query_dd": "float64",
    "edges_per_query_ed": "float64",
    "act_mean_steps": "float64",  # mean steps per node (ACT models), else NaN
    "n_params": "int64",
    "metrics": "string",  # JSON: task metrics (bleu, per, ...) and decode timing
    "backend_plan": "string",  # JSON: what the backend chose per stage, where it chooses
    "config": "string",  # JSON: the full resolved run configuration
    "gtx_version": "string",
    "torch_version": "string",
    "dgl_version": "string",
}
REQUIRED = ["run_id", "started_at", "task", "model", "pattern", "backend", "device", "seed", "epoch", "split", "loss", "token_acc"]


def validate(df: pd.DataFrame) -> pd.DataFrame:
    """Return ``df`` with the schema's columns, order and dtypes; raise ValueError on any mismatch."""
    missing = [c for c in COLUMNS if c not in df.columns]
    extra = [c for c in df.columns if c not in COLUMNS]
    if missing or extra:
        raise ValueError(f"results do not match the schema: missing {missing}, unexpected {extra}")
    try:
        df = df[list(COLUMNS)].astype(COLUMNS)
    except (TypeError, ValueError) as e:
        raise ValueError(f"results do not match the schema's dtypes: {e}") from None
    bad_split = ~df["split"].isin(SPLITS)
    if bad_split.any():
        raise ValueError(f"results: split must be one of {SPLITS}, got {df['split'][bad_split].iloc[0]!r}")
    nulls = [c for c in REQUIRED if df[c].isna().any()]
    if nulls:
        raise ValueError(f"results: required columns hold missing values: {nulls}")
    return df


def write_run(results_dir: str | Path, run_id: str, rows: Sequence[dict]) -> Path:
    """Validate and (re)write one run's rows atomically; returns the file."""
    df = validate(pd.DataFrame(list(rows)))
    path = Path(results_dir) / "runs" / f"{run_id}.csv"
    atomic_write(path, df.to_csv(index=False))
    return path


def load(results_dir: str | Path) -> pd.DataFrame:
    """All runs under a results folder, validated; an empty frame with the schema if there are none."""
    files = sorted((Path(results_dir) / "runs").glob("*.csv"))  # temporary files start with '.'
    frames = []
    for f in files:
        try:
            df = pd.read_csv(f, dtype=str, keep_default_na=False, na_values=[""])
            frames.append(validate(df.assign(**{c: v for c, v in ADDED.items() if c not in df.columns})))
        except (ValueError, pd.errors.ParserError) as e:
            warnings.warn(f"skipping {f}: {e}", stacklevel=2)
    if not frames:
        return validate(pd.DataFrame({c: pd.Series(dtype=t) for c, t in COLUMNS.items()}))
    return pd.concat(frames, ignore_index=True)


#: compare()'s per-run metrics before the task's own (``best_valid_<name>``) and the speed
RUN_METRICS = ["best_valid_token_acc", "best_valid_seq_acc", "best_valid_loss", "test_seq_acc"]
SPEED = "train_tokens_per_s"
DEFAULT_METRIC = "best_valid_token_acc"
#: last words of metric names that improve downwards: losses, bits per character, error rates
LOWER_IS_BETTER = {"loss", "bpc", "per", "wer", "cer", "ppl"}


def lower_is_better(metric: str) -> bool:
    """Whether a metric improves downwards, by its last word: best_valid_loss, best_valid_bpc, best_valid_per.
    Any other metric (accuracies, bleu, a plugin's own) counts as higher-is-better."""
    return metric.rsplit("_", 1)[-1] in LOWER_IS_BETTER


def _per_run(rows: pd.DataFrame) -> dict:
    train, valid, test = (rows[rows.split == s] for s in SPLITS)
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
    }


def training_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the runs a comparison counts: no ``gtx eval`` rows (they re-score a run), and of
    runs sharing a cell (same configuration and seed: a repeat is no new seed) the latest finished."""
    df = df[df.eval_of.isna()]
    runs = df.groupby("run_id", sort=False).agg(cell=("cell", "first"), started=("started_at", "first"),
                                                finished=("split", lambda s: bool((s == "test").any())))
    runs = runs.sort_values(["finished", "started"], kind="stable")
    return df[df.run_id.isin(runs.index[runs.cell.isna() | ~runs.duplicated("cell", keep="last")])]


def compare(df: pd.DataFrame, by: Iterable[str] = ("task", "model", "pattern", "backend"), metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """One row per group of runs (seeds): accuracy against speed, as numbers (``format_compare`` renders them).

    Per run: best valid token/sequence accuracy and loss over epochs, its test sequence accuracy, the
    task's own scalar metrics of the valid rows (``best_valid_bpc``, ``best_valid_query_acc``, ...: the
    best epoch's, min for ``lower_is_better`` metrics, else max), train tokens/s of its last epoch
    and its density. Rows of ``gtx eval`` (``eval_of`` set) are left out; runs sharing a ``cell`` (same
    configuration and seed) count once, the latest finished one, as a repeat is no new seed.

    Columns: the ``by`` keys; ``runs`` (n); for each metric ``M`` above and ``train_tokens_per_s``:
    ``M_mean``, ``M_std`` (sample std, ddof=1; NaN for one run), ``M_ci_low`` and ``M_ci_high`` (95%
    Student-t interval of the mean over the runs; NaN for one run); ``density`` (mean edges over those
    the stages allow: 1.0 is full attention). Grouped by ``pattern``, each row is compared with the
    ``full`` row of the same other ``by`` values (same task, model, backend, ...):
    ``speed_vs_full`` (mean train tokens/s over full's), ``p_vs_full`` (Welch's t-test, unequal
    variances, two-sided, of ``metric`` over the runs; NaN for full, or when either side has fewer
    than 2 runs), ``vs_full`` ("better", "worse" at p < 0.05, else "same"; "-" untested) and
    ``pareto`` (True on the front of mean ``metric`` against mean train tokens/s among those rows:
    no other row is at least as good in both and better in one). ``attrs["metric"]`` names ``metric``,
    which is one of the metric names, its ``best_valid_`` prefix optional (``bpc``).
    """
    by = list(by)
    unknown = [c for c in by if c not in COLUMNS]
    if unknown:
        raise GtxError(f"cannot group by {unknown}; columns are: {', '.join(COLUMNS)}")
    df = training_runs(df)
    if df.empty:
        return pd.DataFrame(columns=[*by, "runs"])
    runs = pd.DataFrame([{**{c: rows[c].iloc[0] for c in by}, "run_id": run_id, **_per_run(rows)} for run_id, rows in df.groupby("run_id", sort=False)])
    task_metrics = sorted(c for c in runs.columns if c.startswith("best_valid_") and c not in RUN_METRICS)
    metrics = RUN_METRICS + task_metrics
    if metric not in metrics:
        metric = f"best_valid_{metric}"
    if metric not in metrics:
        raise GtxError(f"unknown metric {metric.removeprefix('best_valid_')!r}; metrics of these runs: {', '.join(metrics)}")
    rows, samples = [], []
    for keys, group in runs.groupby(by, sort=True, dropna=False):
        row = {**dict(zip(by, keys)), "runs": len(group)}
        for m in [*metrics, SPEED]:
            s = summarize(group[m])
            row.update({f"{m}_mean": s.mean, f"{m}_std": s.std, f"{m}_ci_low": s.ci_low, f"{m}_ci_high": s.ci_high})
        rows.append({**row, "density": group.density.mean()})
        samples.append(group[metric].to_numpy(dtype=float))
    table = pd.DataFrame(rows)
    if "pattern" in by:
        table = _against_full(table, samples, [c for c in by if c != "pattern"], metric)
    table.attrs["metric"] = metric
    return table


def _against_full(table: pd.DataFrame, samples: list[np.ndarray], others: list[str], metric: str) -> pd.DataFrame:
    """``compare``'s speed_vs_full, p_vs_full, vs_full and pareto, within each group of the ``others`` keys."""
    sign = -1.0 if lower_is_better(metric) else 1.0  # oriented so that higher is better
    table = table.assign(speed_vs_full=np.nan, p_vs_full=np.nan, vs_full="-", pareto=False)
    key = table[others].astype(str).agg("|".join, axis=1) if others else pd.Series("", index=table.index)
    for idx in table.groupby(key, sort=False).groups.values():
        group = table.loc[idx]
        table.loc[idx, "pareto"] = pareto_front(sign * group[f"{metric}_mean"], group[f"{SPEED}_mean"])
        full = group.index[group.pattern == "full"]
        if not len(full):
            continue
        f = full[0]
        table.loc[idx, "speed_vs_full"] = group[f"{SPEED}_mean"] / group.at[f, f"{SPEED}_mean"]
        for i in idx.drop(f):
            p = welch_p(samples[i], samples[f])
            table.loc[i, ["p_vs_full", "vs_full"]] = p, verdict(p, sign * (group.at[i, f"{metric}_mean"] - group.at[f, f"{metric}_mean"]))
    return table


def format_compare(table: pd.DataFrame, fmt: str = "table") -> str:
    """Render ``compare()``'s table. CSV: its numeric columns as they are. Table and markdown, to stay
    readable: ``mean ± std`` per metric (just the mean for one run), the chosen metric first with its
    95% interval beside it (``ci95``), metrics no run has and ``best_valid_loss`` (unless chosen: the
    accuracies and bpc say it) left out, ``welch_p`` for ``p_vs_full`` and ``*`` marking the front."""
    if fmt == "csv" or "runs" not in table.columns:
        return format_table(table, fmt)
    metric = table.attrs.get("metric", DEFAULT_METRIC)
    names = [c.removesuffix("_mean") for c in table.columns if c.endswith("_mean")]
    shown = sorted((m for m in names if table[f"{m}_mean"].notna().any() and (m != "best_valid_loss" or m == metric)), key=lambda m: m != metric)
    view = table.loc[:, :"runs"].copy()
    for m in shown:
        view[m] = [_pm(mean, std) for mean, std in zip(table[f"{m}_mean"], table[f"{m}_std"])]
        if m == metric:
            view["ci95"] = ["-" if np.isnan(lo) else f"[{_cell(lo)}, {_cell(hi)}]" for lo, hi in zip(table[f"{m}_ci_low"], table[f"{m}_ci_high"])]
    view["density"] = table.density
    if "pareto" in table.columns:
        view["speed_vs_full"] = table.speed_vs_full
        view["welch_p"] = ["-" if np.isnan(p) else "<0.001" if p < 0.001 else f"{p:.3f}" for p in table.p_vs_full]
        view["vs_full"] = table.vs_full
        view["pareto"] = np.where(table.pareto, "*", "")
    return format_table(view, fmt)


def _pm(mean: float, std: float) -> str:
    if np.isnan(std):
        return _cell(mean)
    return f"{_cell(mean)} ± {f'{std:.4f}' if abs(mean) < 10 else f'{std:,.0f}'}"  # std to the mean's precision


def format_table(df: pd.DataFrame, fmt: str = "table") -> str:
    """Render a comparison as an aligned text table, GitHub markdown, or CSV."""
    if fmt == "csv":
        return df.to_csv(index=False)
    cells = [[_cell(v) for v in row] for row in df.itertuples(index=False)]
    header = [str(c) for c in df.columns]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    if fmt == "markdown":
        lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"]
        lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
        return "\n".join(lines)
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return "-"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """A phase's single-number metrics (bpc, query_acc, bleu, seq_acc, ...), decode timing left out."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and k != "decode_s"}


def metrics_json(d: dict) -> str:
    return json.dumps(d, sort_keys=True)
