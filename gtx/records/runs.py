"""What a run was: the runs of a results folder listed, and one run described. No click.

    from gtx.records import results, runs
    df = results.load("results")
    print(results.format_table(runs.summary(df, "results", {"text": "bpc"})))
    print(runs.describe(df, runs.find_run(df, "b54179"), "results"))

A run's status comes from its rows: ``finished`` (it has a test row), ``eval of ID`` (a ``gtx eval``
run, ``eval_of`` set) or ``incomplete`` (killed or still running: the rows cannot tell which), with
``resumable`` added where its ``last.pt`` exists.
"""

from __future__ import annotations

import datetime as dt
import json
import textwrap
from pathlib import Path

import pandas as pd

from gtx.errors import GtxError
from gtx.records import checkpoint
from gtx.records.results import (
    CONFIG_PARTS,
    differing,
    format_table,
    lower_is_better,
    metric_values,
    scalar_metrics,
    settings_of,
    settings_text,
    value_text,
)
from gtx.records.runref import match_run, short_id

SUMMARY_COLUMNS = [
    "run_id",
    "task",
    "model",
    "pattern",
    "backend",
    "seed",
    "status",
    "epochs",
    "metric",
    "best",
    "settings",
]


def config_of(rows: pd.DataFrame) -> dict:
    """A run's resolved configuration (the ``config`` JSON of its first row); {} where none was stored."""
    raw = rows.config.iloc[0]
    return json.loads(raw) if isinstance(raw, str) and raw else {}


def flat_settings(rows: pd.DataFrame) -> dict[str, object]:
    """A run's resolved settings, flat: ``model.dim``, ``task.n_train``, ``train.epochs``, ... (its names are columns already)."""
    return {k: v for k, v in settings_of(rows).items() if "." in k}


def status(rows: pd.DataFrame, results_dir: str | Path) -> str:
    """``finished``, ``eval of <short id>``, ``incomplete`` or ``incomplete, resumable`` (see the module)."""
    eval_of = rows.eval_of.dropna()
    if len(eval_of):
        return f"eval of {short_id(eval_of.iloc[0])}"
    if (rows.split == "test").any():
        return "finished"
    resumable = (checkpoint.checkpoint_dir(results_dir, rows.run_id.iloc[0]) / checkpoint.LAST).is_file()
    return "incomplete, resumable" if resumable else "incomplete"


def phase_metrics(rows: pd.DataFrame) -> pd.DataFrame:
    """The task's scalar metrics of each row (bpc, query_acc, ...), from its ``metrics`` JSON, on the rows' index."""
    return pd.DataFrame(
        [scalar_metrics(json.loads(m)) if isinstance(m, str) else {} for m in rows.metrics], index=rows.index
    )


def best(rows: pd.DataFrame, metric: str) -> float:
    """The best ``metric`` over a run's valid rows (an eval run: over its rows, the split it evaluated):
    a results column (token_acc, seq_acc, loss) or a key of the rows' metrics JSON; min where
    ``lower_is_better``, else max; NaN where no row has it."""
    valid = rows[rows.split == "valid"]
    values = metric_values(valid if len(valid) else rows, metric).dropna()
    if values.empty:
        return float("nan")
    return float(values.min() if lower_is_better(metric) else values.max())


def _epochs(rows: pd.DataFrame, config: dict) -> str:
    """``done/planned`` for a training run (``2/4``); an eval run: the epoch its checkpoint held."""
    done = int(rows.epoch.max())
    planned = (config.get("train") or {}).get("epochs")
    return f"{done}/{planned}" if rows.eval_of.isna().all() and planned else str(done)


def summary(df: pd.DataFrame, results_dir: str | Path, metrics: dict[str, str]) -> pd.DataFrame:
    """One row per run, oldest first (``SUMMARY_COLUMNS``): its names, ``status``, ``epochs``, the
    task's key metric (``metrics``: task -> metric name, token_acc where a task has none) and its
    ``best``, and ``settings``: the resolved settings that differ between these runs (``epochs=4
    n_train=300``; empty where all runs agree): a model's among the runs of that model, a task's and
    the training settings among the runs of that task (tasks set their own training defaults)."""
    runs = [rows for _, rows in df.groupby("run_id", sort=False)]
    # started_at has whole seconds: an evaluation started in its run's second still comes after it
    runs.sort(key=lambda rows: (rows.started_at.iloc[0], isinstance(rows.eval_of.iloc[0], str), rows.run_id.iloc[0]))
    configs = [config_of(rows) for rows in runs]
    settings = differing(
        [flat_settings(r) for r in runs],
        [{"model": r.model.iloc[0], "task": r.task.iloc[0], "train": r.task.iloc[0]} for r in runs],
    )
    out = []
    for rows, config, differ in zip(runs, configs, settings):
        first = rows.iloc[0]
        metric = metrics.get(first.task, "token_acc")
        out.append(
            {
                "run_id": first.run_id,
                "task": first.task,
                "model": first.model,
                "pattern": first.pattern,
                "backend": first.backend,
                "seed": int(first.seed),
                "status": status(rows, results_dir),
                "epochs": _epochs(rows, config),
                "metric": metric,
                "best": best(rows, metric),
                "settings": settings_text(differ),
            }
        )
    return pd.DataFrame(out, columns=SUMMARY_COLUMNS)


def find_run(df: pd.DataFrame, ref: str) -> str:
    """The run id among ``df``'s runs that ``ref`` names (``runref.match_run``: the id, a unique prefix or suffix)."""
    return match_run(df.run_id, ref)


def checkpoints(results_dir: str | Path, run_id: str) -> pd.DataFrame:
    """A run's checkpoint files: path, size, modified (UTC) and the epoch each holds, read with the
    tensors memory-mapped (cheap for any model size); "-" where a file is unreadable."""
    out = []
    for path in sorted(checkpoint.checkpoint_dir(results_dir, run_id).glob("*.pt")):
        stat = path.stat()
        try:
            epoch = str(checkpoint.load(path, mmap=True)["epoch"])
        except (GtxError, KeyError):
            epoch = "-"
        out.append(
            {
                "path": str(path),
                "size": f"{stat.st_size / 2**20:.2f} MiB",
                "modified": dt.datetime.fromtimestamp(stat.st_mtime, dt.timezone.utc).isoformat(timespec="seconds"),
                "epoch": epoch,
            }
        )
    return pd.DataFrame(out, columns=["path", "size", "modified", "epoch"])


def rows_table(rows: pd.DataFrame) -> pd.DataFrame:
    """A run's rows as shown: split, epoch, loss, accuracies, the task's scalar metrics, speed and time
    (ACT's mean steps where the model has them)."""
    cols = ["split", "epoch", "loss", "token_acc", "seq_acc"]
    extra = phase_metrics(rows)
    tail = ["tokens_per_s", "wall_s"] + (["act_mean_steps"] if rows.act_mean_steps.notna().any() else [])
    return pd.concat([rows[cols], extra.drop(columns=[c for c in extra if c in rows.columns]), rows[tail]], axis=1)


def _lines(pairs: list[tuple[str, object]], wrap: int = 110) -> list[str]:
    """``key  value`` lines, values aligned and long ones wrapped under themselves."""
    width = max(len(k) for k, _ in pairs)
    return [
        textwrap.fill(
            str(v), wrap, initial_indent=f"{k:<{width}}  ", subsequent_indent=" " * (width + 2), break_on_hyphens=False
        )
        for k, v in pairs
    ]


def describe(df: pd.DataFrame, run_id: str, results_dir: str | Path) -> str:
    """``gtx show``: one run's identity, status, resolved settings (grouped), versions, rows and checkpoints."""
    rows = df[df.run_id == run_id]  # in the order written: epoch by epoch, train then valid, test last
    first, config = rows.iloc[0], config_of(rows)
    head = [("run", run_id), ("status", status(rows, results_dir)), ("started_at", first.started_at)]
    head += [(c, first[c]) for c in ("task", "model", "pattern", "backend", "seed", "device")]
    head += [(c, first[c]) for c in ("cell", "experiment", "eval_of") if c in rows.columns and pd.notna(first[c])]
    head += [
        ("parameters", f"{first.n_params:,}"),
        ("versions", f"gtx {first.gtx_version}, torch {first.torch_version}, dgl {first.dgl_version}"),
    ]
    names = {"model_config": f"model {first.model}", "task_config": f"task {first.task}", "train": "train"}
    given = config.get("settings") or {}
    body = [("--set", settings_text(given) or "(none: all defaults)")] if "settings" in config else []
    body += [(names[part], settings_text(config.get(part) or {}) or "-") for part in CONFIG_PARTS if part in config]
    shown = {*CONFIG_PARTS, "settings", "task", "model", "backend", "seed", "device"} | (
        {"pattern"} if config.get("pattern") == first.pattern else set()
    )
    # the pattern as the model ran it (ut: act(...)), eval's checkpoint
    body += [(k, value_text(v)) for k, v in sorted(config.items()) if k not in shown]
    out = (
        _lines(head)
        + [""]
        + (_lines(body) if body else ["(no configuration stored)"])
        + ["", format_table(rows_table(rows))]
    )
    ckpts = checkpoints(results_dir, run_id)
    out += [
        "",
        format_table(ckpts) if len(ckpts) else f"no checkpoints under {checkpoint.checkpoint_dir(results_dir, run_id)}",
    ]
    return "\n".join(out)
