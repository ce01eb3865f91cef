"""The results tables: one declared schema, validated on write, atomic and concurrent-safe.

Each run writes its own file ``<results>/runs/<run_id>.csv`` (one row per epoch x split), replaced
atomically after every epoch: a run killed at any moment leaves earlier runs, and its own earlier
epochs, intact; two runs writing into one folder never touch the same file. ``load`` reads them all.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from gtx.data.task import SPLITS
from gtx.errors import GtxError
from gtx.files import atomic_write
from gtx.records.layout import ResultsFolder

SCHEMA_VERSION = 6
KEYED_SINCE = 4  # cell and experiment keys as today's: older files are rekeyed on load
#: columns added since version 1, with the value older files get on load
ADDED = {
    "context_len": pd.NA,
    "density": float("nan"),
    "cell": pd.NA,
    "experiment": pd.NA,
    "eval_of": pd.NA,
    "flops": float("nan"),
    "attn_flops": float("nan"),
    "definitions": pd.NA,
}
#: the resolved configs an experiment's identity holds, as stored in the ``config`` column
CONFIG_PARTS = ("model_config", "task_config", "train")
#: settings added after runs were stored, per config part, at the value under which a run does what
#: runs did before them: left out of what a run stores and of its identity there, so no run's keys change
OPTIONAL_SETTINGS = {"train": {"decode_pattern": ""}}

#: name -> pandas dtype, in column order
COLUMNS: dict[str, str] = {
    "schema_version": "int64",
    "run_id": "string",
    "started_at": "string",  # ISO 8601, UTC
    "task": "string",
    "model": "string",
    "pattern": "string",  # canonical spec with parameters, e.g. "local:w=4"
    # JSON {name: version}: the definition version of each method the run's attention ran that declares one
    # (``register(name, factory, definition=N)``; a decode pattern's too), {} where none does; <NA> before schema 6
    "definitions": "string",
    "backend": "string",
    "device": "string",
    "seed": "int64",
    "cell": "string",  # identity_keys' cell: runs of one configuration and seed share it; <NA> for eval rows
    "experiment": "string",  # identity_keys' experiment: the cell without the seed, what seeds of one experiment share
    "eval_of": "string",  # `gtx eval` rows: the run whose checkpoint was evaluated; <NA> for training runs
    "epoch": "int64",  # 1-based; test rows carry the last epoch
    "split": "string",  # train | valid | test
    "loss": "float64",  # mean cross-entropy (nats) per scored target, teacher forced, no label smoothing
    "token_acc": "float64",  # teacher-forced token accuracy
    "seq_acc": "float64",  # exact-match accuracy of decoded outputs; classify: accuracy; NaN where not decoded (train, lm)
    "tokens_per_s": "float64",  # tokens computed per second of wall time (decoder tokens; encoder tokens for classify)
    "wall_s": "float64",  # wall time of the phase (s)
    "peak_mem_mb": "float64",  # CUDA: peak allocated in the phase; CPU: peak RSS of the process
    "flops": "float64",  # floating-point operations of the phase, counted (gtx.run.cost); train: forward and backward
    "attn_flops": "float64",  # the attention's share of flops (q.k and the sum over v, on the edges attended); NaN before schema 5
    "context_len": "Int64",  # the longest sequence of the phase (tokens); <NA> in schema 1 files
    # keys read over the keys the stages allow (dd: the causal triangle; plus keys a method offers, NSA's compressed ones);
    # 1.0 = full attention, never above: gtx.attention.budget
    "density": "float64",
    # the keys each query's attention read in the stage, mean over heads, per query per attention call (every layer, every
    # ACT step over its active nodes): a content-chosen or trainable pattern's chosen keys, each counted once
    "edges_per_query_ee": "float64",
    "edges_per_query_dd": "float64",
    "edges_per_query_ed": "float64",
    "act_mean_steps": "float64",  # mean steps per node (ACT models), else NaN
    "n_params": "int64",
    "metrics": "string",  # JSON: task metrics (bleu, per, ...), decode timing; tasks scored by generation: each sample's outcome
    "backend_plan": "string",  # JSON: what the backend chose per stage, where it chooses
    "config": "string",  # JSON: the full resolved run configuration
    "gtx_version": "string",
    "torch_version": "string",
    "dgl_version": "string",
}
REQUIRED = [
    "run_id",
    "started_at",
    "task",
    "model",
    "pattern",
    "backend",
    "device",
    "seed",
    "epoch",
    "split",
    "loss",
    "token_acc",
]


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
    for column in JSON_COLUMNS:
        broken = [i for i, text in df[column].dropna().items() if _not_json(text)]
        if broken:
            raise ValueError(f"results: column {column} of row {broken[0]} is not JSON")
    for column, (low, high) in RANGES.items():
        values = df[column].astype("float64")
        # a share summed in floats (keys read, mean over heads) may pass 1 by a rounding error
        outside = values.notna() & ~(values.between(low, high * (1 + 1e-9)) & np.isfinite(values))
        if outside.any():
            i = outside.idxmax()
            interval = f"[{low:g}, {high:g}]" if np.isfinite(high) else f"[{low:g}, inf)"
            raise ValueError(
                f"results: column {column} of row {i} holds {values[i]}, which it cannot: a finite number in {interval}"
            )
    return df


JSON_COLUMNS = ("definitions", "metrics", "backend_plan", "config")
#: the values a numeric column can hold (NaN aside where the column allows it); never infinite.
#: Accuracies and density are shares (density: keys read over keys allowed, never above 1); the rest
#: counts, sizes, times and losses.
RANGES: dict[str, tuple[float, float]] = {
    **{c: (0.0, 1.0) for c in ("token_acc", "seq_acc", "density")},
    **{
        c: (0.0, np.inf)
        for c in (
            "schema_version",
            "seed",
            "epoch",
            "loss",
            "tokens_per_s",
            "wall_s",
            "peak_mem_mb",
            "flops",
            "attn_flops",
            "context_len",
            "edges_per_query_ee",
            "edges_per_query_dd",
            "edges_per_query_ed",
            "act_mean_steps",
            "n_params",
        )
    },
}


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def identity_keys(
    task: str, model: str, pattern: str, backend: str, configs: dict[str, dict], seed: int
) -> tuple[str, str]:
    """The ``cell`` and ``experiment`` keys of a run: hashes of its task and model names, canonical
    pattern, backend and every resolved setting (``configs``: the ``CONFIG_PARTS`` dicts), with and
    without the seed. Names and settings live under separate keys, so nothing can overwrite anything
    (schema 3 merged the task's settings over its name: two tasks with equal settings shared a key)."""
    ident = {
        "names": {"task": task, "model": model, "pattern": pattern, "backend": backend},
        **{k: stored_settings(k, configs[k]) for k in CONFIG_PARTS},
    }

    def digest(d: dict) -> str:
        return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return digest({**ident, "seed": seed}), digest(ident)


def stored_settings(part: str, settings: dict) -> dict:
    """One resolved config (``part``: ``train``, ...) as a run stores it: ``OPTIONAL_SETTINGS`` at their
    as-before value left out."""
    skip = OPTIONAL_SETTINGS.get(part, {})
    return {k: v for k, v in settings.items() if k not in skip or v != skip[k]}


def _rekey(df: pd.DataFrame) -> pd.DataFrame:
    """Keys for a run file written before schema 4, recomputed from its stored settings (its own
    ``cell`` may mix tasks or models); left missing where the file stored no settings."""
    config = json.loads(df.config.iloc[0]) if df.config.notna().iloc[0] else {}
    if not all(isinstance(config.get(k), dict) for k in CONFIG_PARTS):
        return df.assign(cell=pd.NA, experiment=pd.NA)
    first = df.iloc[0]
    cell, experiment = identity_keys(first.task, first.model, first.pattern, first.backend, config, int(first.seed))
    return df.assign(cell=cell if df.eval_of.isna().all() else pd.NA, experiment=experiment)


def check_known_schema(path: Path, versions) -> None:
    """One line for a results file written by a newer gtx (a schema version above ``SCHEMA_VERSION``):
    its columns may mean what this gtx cannot know, so it is neither read nor rewritten."""
    newer = [v for v in pd.to_numeric(pd.Series(versions), errors="coerce").dropna() if v > SCHEMA_VERSION]
    if newer:
        raise GtxError(
            f"results file {path} has schema version {int(max(newer))}, newer than this gtx reads ({SCHEMA_VERSION}): "
            f"read it with the gtx that wrote it, or move it out of {path.parent}"
        )


def write_run(results_dir: str | Path, run_id: str, rows: Sequence[dict]) -> Path:
    """Validate and (re)write one run's rows atomically; returns the file. One line, nothing written,
    where that file exists with a newer schema (``check_known_schema``)."""
    df = validate(pd.DataFrame(list(rows)))
    path = ResultsFolder(results_dir).run_table(run_id)
    try:
        on_disk = pd.read_csv(path, usecols=["schema_version"], dtype=str).schema_version
    except (OSError, ValueError, pd.errors.ParserError):  # none yet, or one load would skip
        on_disk = []
    check_known_schema(path, on_disk)
    atomic_write(path, df.to_csv(index=False))
    return path


def load(results_dir: str | Path) -> pd.DataFrame:
    """All runs under a results folder, validated; an empty frame with the schema if there are none.
    Files written before schema 4 get their ``cell`` and ``experiment`` recomputed (``_rekey``); a
    file that does not parse or fit the schema is skipped with a warning, one of a newer schema
    refused (``check_known_schema``)."""
    files = sorted(ResultsFolder(results_dir).runs().glob("*.csv"))  # temporary files start with '.'
    frames = []
    for f in files:
        try:
            df = pd.read_csv(f, dtype=str, keep_default_na=False, na_values=[""])
            check_known_schema(f, df.get("schema_version", []))
            df = validate(df.assign(**{c: v for c, v in ADDED.items() if c not in df.columns}))
            frames.append(validate(_rekey(df)) if len(df) and df.schema_version.iloc[0] < KEYED_SINCE else df)
        except (OSError, ValueError, pd.errors.ParserError) as e:  # OSError: a folder named *.csv, unreadable
            warnings.warn(f"skipping {f}: {e}", stacklevel=2)
    if not frames:
        return validate(pd.DataFrame({c: pd.Series(dtype=t) for c, t in COLUMNS.items()}))
    return pd.concat(frames, ignore_index=True)


#: last words of metric names that improve downwards: losses, bits per character, error rates
LOWER_IS_BETTER = {"loss", "bpc", "per", "wer", "cer", "ppl"}
#: metrics stored as columns; any other is a key of a row's ``metrics`` JSON
COLUMN_METRICS = {"loss", "token_acc", "seq_acc"}


def lower_is_better(metric: str) -> bool:
    """Whether a metric improves downwards, by its last word: best_valid_loss, best_valid_bpc, best_valid_per.
    Any other metric (accuracies, bleu, a plugin's own) counts as higher-is-better."""
    return metric.rsplit("_", 1)[-1] in LOWER_IS_BETTER


def metric_range(metric: str) -> tuple[float, float]:
    """The values a metric can take, by its last word: accuracies [0, 1], BLEU [0, 100], losses,
    error rates and speeds [0, inf); anything else unbounded. Confidence intervals are clipped to it."""
    last = metric.rsplit("_", 1)[-1]
    if last == "acc":
        return 0.0, 1.0
    if last == "bleu":
        return 0.0, 100.0
    if last in LOWER_IS_BETTER or metric.endswith("per_s"):
        return 0.0, np.inf
    return -np.inf, np.inf


def metric_values(rows: pd.DataFrame, base: str) -> pd.Series:
    """A metric per row, from its column or the row's ``metrics`` JSON (NaN where absent)."""
    if base in COLUMN_METRICS:
        return rows[base].astype(float)

    def get(text):
        v = json.loads(text).get(base) if isinstance(text, str) else None
        return float(v) if isinstance(v, (int, float)) else np.nan

    return rows["metrics"].map(get).astype(float)


def settings_of(rows: pd.DataFrame) -> dict[str, object]:
    """A run's identity but the seed, flat: task, model, pattern, backend and ``model.X``, ``task.X``,
    ``train.X`` from its stored configuration (``{}`` in files that stored none)."""
    first = rows.iloc[0]
    out: dict[str, object] = {c: first[c] for c in ("task", "model", "pattern", "backend")}
    config = json.loads(first.config) if isinstance(first.config, str) else {}
    for part in CONFIG_PARTS:
        for k, v in sorted((config.get(part) or {}).items()):
            out[f"{part.removesuffix('_config')}.{k}"] = json.dumps(v) if isinstance(v, (list, dict)) else v
    return out


def differing(settings: list[dict[str, object]], peers: list[dict[str, str]] | None = None) -> list[dict[str, object]]:
    """Per run, only the settings whose value is not the same in all its peers' (a key some lack
    counts as differing). ``peers``: per run, the scope each prefix is compared in (``{"model": "lm",
    "task": "text"}``: a model's settings among runs of that model, a task's among that task's; a
    prefix left out, among all runs). Keys lose their prefix (``epochs``) unless two groups share the name."""
    peers = peers or [{} for _ in settings]
    buckets: dict[tuple, list[int]] = {}
    for i, (s, scope) in enumerate(zip(settings, peers)):
        for prefix in {k.partition(".")[0] for k in s}:
            buckets.setdefault((prefix, scope.get(prefix)), []).append(i)
    varying = set()  # (prefix, scope, key)
    for (prefix, scope), members in buckets.items():
        keys = {k for i in members for k in settings[i] if k.startswith(f"{prefix}.")}
        # json compares lists, nested dicts and NaN as written
        varying |= {
            (prefix, scope, k)
            for k in keys
            if len({json.dumps(settings[i].get(k, "<absent>"), sort_keys=True) for i in members}) > 1
        }
    leaves = pd.Series([k.partition(".")[2] for k in {k for s in settings for k in s}], dtype=str).value_counts()
    name = {k: k.partition(".")[2] if leaves[k.partition(".")[2]] == 1 else k for _, _, k in varying}
    return [
        {
            name[k]: v
            for k, v in sorted(s.items())
            if (k.partition(".")[0], scope.get(k.partition(".")[0]), k) in varying
        }
        for s, scope in zip(settings, peers)
    ]


def value_text(v: object) -> str:
    """A setting's value as ``--set`` and TOML write it."""
    return v if isinstance(v, str) else json.dumps(v)  # true, 0.1, [1, 2]: as --set and TOML write them


def settings_text(settings: dict[str, object]) -> str:
    return " ".join(f"{k}={value_text(v)}" for k, v in settings.items())


def finished(df: pd.DataFrame) -> pd.Series:
    """Per row: whether its run is finished. A run writes its test rows last; one still training,
    or stopped before the end, has none and no final word yet."""
    return df.run_id.isin(df.run_id[df.split == "test"])


def training_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the runs a comparison counts: no ``gtx eval`` rows (they re-score a run), and of
    runs sharing a cell (same configuration and seed: a repeat is no new seed) the latest finished."""
    df = df[df.eval_of.isna()]
    runs = (
        df.assign(finished=finished(df))
        .groupby("run_id", sort=False)
        .agg(cell=("cell", "first"), started=("started_at", "first"), finished=("finished", "first"))
    )
    runs = runs.sort_values(["finished", "started"], kind="stable")
    return df[df.run_id.isin(runs.index[runs.cell.isna() | ~runs.duplicated("cell", keep="last")])]


def format_table(df: pd.DataFrame, fmt: str = "table") -> str:
    """Render a table as aligned text, GitHub markdown, or CSV (numbers by ``cell_text``)."""
    if fmt == "csv":
        return df.to_csv(index=False)
    cells = [[cell_text(v) for v in row] for row in df.itertuples(index=False)]
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


def cell_text(v) -> str:
    """A number for a table: 4 decimals below 10, thousands separated below 1e12, else 4 significant
    digits (1.000e+308); NaN as '-'."""
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return "-"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.0f}" if abs(v) < 1e12 else f"{v:.3e}"
    return str(v)


#: numbers a phase's metrics hold that judge nothing: timing, and the keys generated tokens read
NOT_METRICS = ("decode_s", "generate_s", "decode_edges_per_query")


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """A phase's single-number metrics (bpc, query_acc, bleu, seq_acc, ...), ``NOT_METRICS`` left out."""
    return {k: v for k, v in metrics.items() if isinstance(v, float) and k not in NOT_METRICS}


def metrics_json(d: dict) -> str:
    return json.dumps(d, sort_keys=True)
