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
from gtx.task import SPLITS, atomic_write_text

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
    atomic_write_text(path, df.to_csv(index=False))
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


def compare(df: pd.DataFrame, by: Iterable[str] = ("task", "model", "pattern", "backend")) -> pd.DataFrame:
    """One row per group of runs: accuracy against speed.

    Per run: best valid token/sequence accuracy and loss over epochs, train tokens/s of its last
    epoch, its test sequence accuracy and its density (edges over those the stages allow: 1.0 is
    full attention); then the mean over the group's runs. ``speed_vs_full`` divides
    train tokens/s by that of the ``full`` pattern in the group with the same other ``by`` values.
    """
    by = list(by)
    unknown = [c for c in by if c not in COLUMNS]
    if unknown:
        raise GtxError(f"cannot group by {unknown}; columns are: {', '.join(COLUMNS)}")
    if df.empty:
        return pd.DataFrame(columns=[*by, "runs"])
    per_run = []
    for run_id, rows in df.groupby("run_id", sort=False):
        train, valid, test = (rows[rows.split == s] for s in SPLITS)
        last_train = train[train.epoch == train.epoch.max()] if len(train) else train
        per_run.append(
            {
                **{c: rows[c].iloc[0] for c in by},
                "run_id": run_id,
                "best_valid_token_acc": valid.token_acc.max(),
                "best_valid_seq_acc": valid.seq_acc.max(),
                "best_valid_loss": valid.loss.min(),
                "test_seq_acc": test.seq_acc.iloc[-1] if len(test) else np.nan,
                "train_tokens_per_s": last_train.tokens_per_s.iloc[-1] if len(last_train) else np.nan,
                "density": rows.density.mean(),
            }
        )
    runs = pd.DataFrame(per_run)
    table = runs.groupby(by, sort=True, dropna=False).agg(
        runs=("run_id", "count"),
        best_valid_token_acc=("best_valid_token_acc", "mean"),
        best_valid_seq_acc=("best_valid_seq_acc", "mean"),
        best_valid_loss=("best_valid_loss", "mean"),
        test_seq_acc=("test_seq_acc", "mean"),
        train_tokens_per_s=("train_tokens_per_s", "mean"),
        density=("density", "mean"),
    ).reset_index()
    if "pattern" in by:
        others = [c for c in by if c != "pattern"]
        full = table[table.pattern == "full"].set_index(others)["train_tokens_per_s"] if others else None
        if others:
            ref = table.set_index(others).index.map(lambda k: full.get(k, np.nan))
        else:
            ref = table.loc[table.pattern == "full", "train_tokens_per_s"].mean()
        table["speed_vs_full"] = table["train_tokens_per_s"] / ref
    return table


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
