"""The frontier: accuracy against attention budget, per task, length and model size, from one sweep.

    families = [parse_family("local:w=16,32,64"), parse_family("moba:b=16,k=2,4")]
    study = Study(families, lengths=["256", "512"], grid=make_grid(task=["recall"], model=["lm"], seeds="0-2"))
    cells, points = plan_study(study, "results")      # sweep cells: full and every budget at every length
    ...run them as a sweep (gtx.sweeps.sweep.execute)...
    table = frontier_table(cells, points, load("results"), margin=0.01)
    smallest = equivalent_budgets(table)             # gtx.sweeps.frontier_tables: reading a table

The axes (``Family``, ``parse_family``, ``Study``) are ``gtx.sweeps.study``'s. A *family* is a
pattern with one budget parameter given several values (``moba:b=16,k=2,4,8``:
``k`` is the budget). Its cells are ordinary sweep cells (``gtx.sweeps.sweep``), so they resume,
run in parallel and are reused by any later sweep or frontier that asks for the same experiment. A
budget that attends to every candidate at a length is dropped there with a note: it would measure
full attention under another name. Equivalence with ``full`` is a TOST (``stats.tost_p``) at a stated
margin, never a non-significant difference. Knows nothing of click.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.records.compare import FALLBACK_METRIC, SPEED, run_table
from gtx.records.results import finished, metric_range
from gtx.records.stats import summarize, tost_p
from gtx.sweeps.frontier_paired import PAIRED_COLUMNS, against_full, mark_largest, run_sides
from gtx.sweeps.grid import Grid
from gtx.sweeps.study import ALL, DECODE, DECODE_SETTING, FULL, PHASES, PREFILL, Study
from gtx.sweeps.sweep import Cell, plan, sweep_name

ALPHA = 0.05
NEARLY_FULL = 1 - 1e-9  # a fixed pattern's density at or above this attends to everything it may


@dataclass(frozen=True)
class Point:
    """What a cell is on the frontier: its family (None: the full baseline) and budget, its length
    (the value of its task's setting ``length_key``), where its pattern applies (``phase``:
    ``study.PHASES``) and that pattern (``spec``: the run's pattern, or for ``decode`` its decode
    pattern)."""

    family: str | None
    budget: str
    length: str
    length_key: str
    rank: int  # where the spec stands in the study: full first, then the families' budgets as given
    phase: str = ALL
    spec: str = FULL


def _arms(study: Study) -> list[tuple[str, str | None, Point]]:
    """The study's runs at one length, as (pattern, decode pattern or None, its Point without length):
    full first, then every family's budgets; a phase's family sets the other phase to full."""
    arms = [(FULL, None, Point(None, "-", "", "", 0))]
    for f in study.families:
        for budget, spec in zip(f.budgets, f.specs):
            pattern, decode = {ALL: (spec, None), PREFILL: (spec, FULL), DECODE: (FULL, spec)}[f.phase]
            arms.append((pattern, decode, Point(f.name, budget, "", "", len(arms), f.phase, spec)))
    return arms


def plan_study(study: Study, results_dir) -> tuple[list[Cell], dict[str, Point]]:
    """The study's sweep cells (``sweep.plan``: complete ones marked skip) and each cell key's ``Point``.
    A budget that attends to every candidate at a length is left out there, with a line in
    ``study.notes``; any other bad cell raises GtxError naming it, before anything runs. A family of
    one phase (``Family.phase``) sets the cells' decode pattern (the ``decode_pattern`` setting)."""
    arms = _arms(study)
    specs = list(dict.fromkeys(s for f in study.families for s in f.specs))
    cells: list[Cell] = []
    points: dict[str, Point] = {}
    for task in study.grid.task:
        key = f"task.{study.key(task)}"
        for length in study.lengths:
            base = dataclasses.replace(
                study.grid, task=[task], pattern=[FULL], settings={**study.grid.settings, key: [length]}
            )
            # with a phase's family, checked as its runs are: a decode pattern needs a task scored by generation
            phased = [f.specs[0] for f in study.families if f.phase != ALL]
            probe = (
                base
                if not phased
                else dataclasses.replace(base, settings={**base.settings, DECODE_SETTING: phased[:1]})
            )
            full_at = _full_budgets(probe, specs, length)
            for f in study.families:
                if set(f.specs) <= set(full_at):
                    raise GtxError(
                        f"family {f.specs[0] if len(f.specs) == 1 else f.name}: every budget attends to every "
                        f"candidate at {task}'s {key.partition('.')[2]}={length} ({full_at[f.specs[0]]}); give smaller budgets or longer lengths"
                    )
            kept = [a for a in arms if a[2].family is None or a[2].spec not in full_at]
            for phase in PHASES:  # one sweep plan per phase: its patterns, or its decode patterns, vary
                group = [a for a in kept if a[2].phase == phase]
                if not group:
                    continue
                settings = dict(base.settings)
                if phase != ALL:
                    settings[DECODE_SETTING] = list(dict.fromkeys(decode for _, decode, _ in group))
                where = {(pattern, decode): point for pattern, decode, point in group}
                grid = dataclasses.replace(base, pattern=list(dict.fromkeys(a[0] for a in group)), settings=settings)
                for cell in plan(grid, results_dir):
                    decode = cell.config.settings[DECODE_SETTING] if phase != ALL else None
                    cells.append(dataclasses.replace(cell, index=len(cells)))
                    points[cell.key] = dataclasses.replace(
                        where[cell.config.pattern, decode], length=length, length_key=key
                    )
            study.notes += [
                f"{task} at {key.partition('.')[2]}={length}: {why}; left out"
                for why in dict.fromkeys(full_at.values())
            ]
    return cells, points


def _full_budgets(grid: Grid, specs: list[str], length: str) -> dict[str, str]:
    """The specs that attend to every candidate at this length, with why; checks every other cell of
    ``grid``'s first seed, model and settings as ``gtx run`` would (data, positions, the edges)."""
    from gtx.attention.module import full_budget
    from gtx.data.batch import make_batch
    from gtx.run.config import resolve
    from gtx.run.runner import RunConfig
    from gtx.run.train import PhaseStats

    out = {}
    for model in grid.model:
        for values in _settings_product(grid.settings):
            config = RunConfig(
                task=grid.task[0],
                model=model,
                pattern=FULL,
                backend=grid.backend[0],
                device=grid.device,
                seed=grid.seeds[0],
                settings=values,
            )
            where = f"task {config.task!r} model {model!r} at length {length}"
            try:
                r = resolve(config)
            except GtxError as e:
                raise GtxError(f"frontier {where}: {e}") from None
            for spec in specs:
                pattern = parse_pattern(spec)
                probe = PhaseStats()
                try:
                    probe.graph_only(make_batch(r.task, "train", [0], pattern))
                except GtxError as e:
                    raise GtxError(f"frontier {where}: {e}") from None
                stages, n = list(probe.edges), r.task.context_len()
                why = full_budget(pattern, stages, n)
                fixed = pattern.select is None and not pattern.heads and pattern.trainable is None
                # at the longest sequence, not a short one
                if fixed and all(_density(pattern, stage, n) >= NEARLY_FULL for stage in stages):
                    why = f"pattern {spec!r} attends to every candidate at {n} tokens (density 1.0)"
                if why:
                    out.setdefault(spec, why)
    return out


def _density(pattern, stage: str, n: int) -> float:
    """A fixed pattern's edges over the stage's possible ones on one sequence of ``n`` tokens."""
    from gtx.graph.tokens import EdgeSet, possible_edges

    src, dst = pattern.edges(stage, n, n)
    return len(src) / possible_edges(EdgeSet(src, dst, n, n, stage))


def _settings_product(settings: dict[str, list[str]]):
    for values in itertools.product(*settings.values()):
        yield dict(zip(settings, values))


def check_margin(margin: float, metrics: Iterable[str] = ()) -> None:
    """A margin is finite, > 0 and narrower than each metric's range (``metric_range``): a margin as
    wide as the range calls every budget equivalent. GtxError naming the fix otherwise."""
    if not (math.isfinite(margin) and margin > 0):
        raise GtxError(
            f"--margin {margin}: an equivalence margin must be a finite number > 0 (in the metric's units, e.g. 0.01 for one point of accuracy)"
        )
    for metric in dict.fromkeys(metrics):
        lo, hi = metric_range(metric)
        if margin >= hi - lo:
            raise GtxError(
                f"--margin {margin:g}: {metric.removeprefix('best_valid_')} lies in [{lo:g}, {hi:g}], so a margin of {hi - lo:g} or more "
                "calls every budget equivalent; give a margin well inside that range (e.g. 0.01)"
            )


def check_metric(tasks: Iterable[str], metric: str | None) -> None:
    """One line, before anything runs, where ``metric`` is none that runs of a task record: the
    results' own (token_acc, seq_acc, loss, test_seq_acc) or the task's (``Task.metric``, and what its
    ``phase_metrics`` and, for seq2seq, ``metrics`` return, asked of a task made with its defaults;
    a task that cannot answer without its data is not judged)."""
    from gtx.plugins.registry import TASKS
    from gtx.records.compare import RUN_METRICS
    from gtx.records.results import scalar_metrics

    if metric is None:
        return
    for name in dict.fromkeys(tasks):
        entry = TASKS.get(name)
        known = {m.removeprefix("best_valid_") for m in RUN_METRICS} | {getattr(entry.obj, "metric", FALLBACK_METRIC)}
        try:
            task = entry.obj(name, entry.config())
            known |= set(scalar_metrics(task.phase_metrics(1.0, {}, "valid")))
            if task.form == "seq2seq":
                known |= set(scalar_metrics(task.metrics([["a"]], [["a"]])))
        except Exception:  # a plugin's task that needs its data to say: not judged here
            continue
        if metric.removeprefix("best_valid_") not in known:
            raise GtxError(
                f"--metric {metric}: runs of task {name!r} do not record it; they record {', '.join(sorted(known))}"
            )


def study_metrics(tasks: Iterable[str], metric: str | None) -> list[str]:
    """The metric each task's frontier is judged by: ``metric`` for all, else each task's own (``Task.metric``)."""
    from gtx.plugins.registry import task_metrics

    own = task_metrics()
    return [metric or own.get(task, FALLBACK_METRIC) for task in tasks]


def missing_cells(cells: list[Cell], df: pd.DataFrame) -> list[Cell]:
    """The study's cells without a finished training run in ``df``: still to run, failed, or running elsewhere."""
    done = set(df.cell[finished(df) & df.eval_of.isna()]) if len(df) else set()
    return [c for c in cells if c.key not in done]


def describe_missing(missing: list[Cell], cells: list[Cell], points: dict[str, Point], results_dir) -> list[str]:
    """One line per budget (task, model, length, the study's swept settings, family and budget) with
    cells in ``missing``: their seeds, and which of them another sweep or frontier on ``results_dir``
    is running now (``claims``)."""
    from gtx.records.claims import holder
    from gtx.records.layout import ResultsFolder

    swept = _swept(cells, {p.length_key for p in points.values()})
    groups: dict[str, list[str]] = {}
    for cell in missing:
        point = points[cell.key]
        c = cell.config
        settings = " ".join(f"{k}={c.settings[k]}" for k in swept)
        where = " ".join(f"{c.task} {c.model} {point.length_key.partition('.')[2]}={point.length} {settings}".split())
        who = holder(ResultsFolder(results_dir).claims() / cell.key)
        groups.setdefault(f"{where}: {point.family or FULL} {point.budget}", []).append(
            f"{c.seed}" + (f" (running in {who})" if who else "")
        )
    return [f"{budget}, seed{'s' * (len(seeds) > 1)} {', '.join(seeds)}" for budget, seeds in groups.items()]


def reading_name(cells: list[Cell], table: pd.DataFrame, margin: float) -> str:
    """A saved table's file stem: the study (a hash of its cells) and what it was read with, its
    metrics and margin (``frontier-1a2b3c4d-query_acc-margin0.01``): two readings never share a file."""
    metrics = "+".join(sorted(table.metric.unique()))
    return f"{sweep_name(None, cells).replace('grid-', 'frontier-')}-{metrics}-margin{margin:g}"


def frontier_table(
    cells: list[Cell], points: dict[str, Point], df: pd.DataFrame, margin: float, metric: str | None = None
) -> pd.DataFrame:
    """One row per experiment of the study that has runs (seeds pooled), numbers only.

    Columns: ``task``, ``model``, ``length``, the study's other swept settings, ``family`` (``full``
    for the baseline), ``phase`` (where the budget applies: ``study.PHASES``), ``budget``,
    ``pattern`` (the budget's: a decode family's decode pattern), ``runs``, ``metric`` and its
    ``mean``, ``std``, ``ci_low``, ``ci_high`` (95%, clipped to the metric's range), ``density`` and
    ``edges_per_query`` (measured: what the pattern kept; for a decode family, the keys each generated
    token's query read, and their share of full's), ``compression`` (full's keys per query over the
    row's, ``frontier_paired``), ``tokens_per_s``, ``speed_vs_full``, the cost (``train_flops``,
    ``train_attn_flops``, ``train_s``: per run, means), ``tost_p`` against ``full`` of the same task,
    model, length and settings (TOST at ``margin``, in the metric's units, kept as the ``margin`` column
    so that a saved table still says it) and ``equivalent`` (tost_p < 0.05; NaN/False with fewer than
    2 runs a side); for tasks scored by generation, the paired test of the row's per-sample outcomes
    against full's (``frontier_paired.PAIRED_COLUMNS``; NaN where the runs hold no outcomes). Only
    the study's own cells count: runs of other experiments in the folder never mix in, and only
    finished runs (with test rows) count."""
    check_margin(margin)
    swept = _swept(cells, {p.length_key for p in points.values()})
    keyed = {c.key: c for c in cells}
    runs = run_table(df[df.cell.isin(list(keyed))], ("pattern",), metric)
    columns = [
        *("task", "model", "length", *swept, "family", "phase", "budget", "pattern", "runs", "metric"),
        *("mean", "std", "ci_low", "ci_high", "density", "edges_per_query", "compression", "tokens_per_s"),
        *("speed_vs_full", "train_flops", "train_attn_flops", "train_s", "tost_p", "margin", "equivalent"),
        *PAIRED_COLUMNS,
    ]
    if runs.empty:
        return pd.DataFrame(columns=columns)
    check_margin(margin, runs.metric)
    runs["value"] = [r[r["metric"]] for _, r in runs.iterrows()]
    rows_by_run = dict(iter(df[df.run_id.isin(runs.run_id)].groupby("run_id", sort=False)))
    rows, samples, sides = [], {}, {}
    for _, group in runs.groupby("experiment", sort=False):
        cell = keyed[group.cell.iloc[0]]
        point = points[cell.key]
        name = group.metric.iloc[0]
        s = summarize(group.value)
        lo, hi = metric_range(name)
        where = {
            "task": cell.config.task,
            "model": cell.config.model,
            "length": point.length,
            **{k: cell.config.settings[k] for k in swept},
        }
        outcomes, decode_read = run_sides(rows_by_run, group.run_id, name)
        decode = point.phase == DECODE
        rows.append(
            {
                **where,
                "family": point.family or FULL,
                "phase": point.phase,
                "budget": point.budget,
                "_order": point.rank,
                "pattern": point.spec,
                "runs": s.n,
                "metric": name.removeprefix("best_valid_"),
                "mean": s.mean,
                "std": s.std,
                "ci_low": max(s.ci_low, lo),
                "ci_high": min(s.ci_high, hi),
                "density": math.nan if decode else group.density.mean(),
                "edges_per_query": decode_read if decode else group.edges_per_query.mean(),
                "tokens_per_s": group[SPEED].mean(),
                **{c: group[c].mean() for c in ("train_flops", "train_attn_flops", "train_s")},
                "_where": tuple(where.values()),
                "_what": " ".join(
                    [
                        *(str(v) for k, v in where.items() if k in ("task", "model")),
                        *(f"{k.rpartition('.')[2]}={cell.config.settings[k]}" for k in swept),
                        f"{point.length_key.partition('.')[2]}={point.length}:",
                        f"{point.family or FULL} {point.budget}",
                    ]
                ),
                "_decode_read": decode_read,
            }
        )
        samples[len(rows) - 1] = group.value.to_numpy(dtype=float)
        sides[len(rows) - 1] = outcomes
    table = pd.DataFrame(rows)
    table["speed_vs_full"], table["tost_p"], table["margin"], table["equivalent"] = np.nan, np.nan, margin, False
    table["compression"] = np.nan
    for c in PAIRED_COLUMNS:
        table[c] = False if c in ("sig_worse", "largest_not_worse") else np.nan
    table["paired_test"] = table.paired_test.astype(object)
    for _, idx in table.groupby("_where", sort=False).groups.items():
        full = [i for i in idx if table.at[i, "family"] == FULL]
        if not full:
            continue
        f = full[0]
        table.loc[idx, "speed_vs_full"] = table.loc[idx, "tokens_per_s"] / table.at[f, "tokens_per_s"]
        table.at[f, "compression"] = 1.0
        for i in idx:
            if i == f:
                continue
            p = tost_p(samples[i], samples[f], margin)
            table.loc[i, ["tost_p", "equivalent"]] = p, bool(p < ALPHA)
            if table.at[i, "phase"] == DECODE:  # generated tokens' keys, against full's generated tokens'
                table.at[i, "density"] = table.at[i, "edges_per_query"] / table.at[f, "_decode_read"]
                table.at[i, "compression"] = table.at[f, "_decode_read"] / table.at[i, "edges_per_query"]
            else:
                table.at[i, "compression"] = table.at[f, "edges_per_query"] / table.at[i, "edges_per_query"]
            for c, v in against_full(sides[i], sides[f], table.at[i, "_what"]).items():
                table.at[i, c] = v
    table["largest_not_worse"] = mark_largest(table, ["_where"])
    table = table.assign(_len=pd.to_numeric(table.length, errors="coerce"))
    table = table.sort_values(["task", "model", *swept, "_len", "_order"], kind="stable")
    drop = ["_where", "_what", "_decode_read", "_order", "_len"]
    return table.drop(columns=drop).reset_index(drop=True)[columns]


def _swept(cells: list[Cell], length_keys: set[str]) -> list[str]:
    """Settings other than the length (a ``task.`` setting each cell sets to its point's length) and
    the decode pattern (a family's phase sets it) that take several values among the cells: model
    sizes and the like."""
    keys = dict.fromkeys(k for c in cells for k in c.config.settings)
    return [
        k
        for k in keys
        if len({c.config.settings.get(k) for c in cells}) > 1
        and k not in length_keys
        and k.rpartition(".")[2] != DECODE_SETTING
    ]
