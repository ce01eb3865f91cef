"""Paired tests of runs scored by generation: a run's per-sample outcomes against a baseline's on the
same samples (``gtx.run.generation`` keeps each sample's outcome, in the split's order, beside the
seed that drew the samples).

    mine, full = run_outcomes(rows_a, "answer_acc"), run_outcomes(rows_b, "answer_acc")
    test = paired_against([mine], [full], "budget local:w=64")   # stats.Paired, or None: nothing to pair

Two runs hold the same samples when their task settings (the sampling seed among them) are equal
and they scored the same count; runs are paired by seed. Anything else is refused in one line: a
paired test over different samples would test nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from gtx.errors import GtxError
from gtx.records.results import lower_is_better, metric_values, settings_of
from gtx.records.stats import Paired, paired_test

SPLIT = "valid"  # the split a frontier's metric is read from (best valid epoch)


@dataclass(frozen=True)
class Outcomes:
    """One run's outcomes of the samples it generated after, in order, and what drew them."""

    run_id: str
    seed: int  # the run's seed: runs are paired by it
    sample_seed: object  # the task's seed that drew the samples (None where the task has none)
    outcomes: tuple[float, ...]
    task_settings: str  # the run's task settings, as JSON: equal for runs over the same samples


def run_outcomes(rows: pd.DataFrame, metric: str) -> Outcomes | None:
    """The outcomes a run's ``valid`` row holds at its best epoch by ``metric`` (the epoch its
    best_valid value comes from; ties: the first), or None where no valid row holds outcomes
    (a task not scored by generation, a model that does not generate, a run written before)."""
    valid = rows[rows.split == SPLIT]
    held = [json.loads(m) if isinstance(m, str) else {} for m in valid.metrics]
    keep = [i for i, m in enumerate(held) if isinstance(m.get("outcomes"), list)]
    if not keep:
        return None
    base = metric.removeprefix("best_valid_")
    values = metric_values(valid.iloc[keep], base).to_numpy(dtype=float)
    best = 0
    if not np.isnan(values).all():
        best = int(np.nanargmin(values) if lower_is_better(base) else np.nanargmax(values))
    metrics = held[keep[best]]
    settings = {k: v for k, v in settings_of(rows).items() if k.startswith("task.")}
    return Outcomes(
        str(rows.run_id.iloc[0]),
        int(rows.seed.iloc[0]),
        metrics.get("sample_seed"),
        tuple(float(x) for x in metrics["outcomes"]),
        json.dumps(settings, sort_keys=True, default=str),
    )


def paired_against(runs: list[Outcomes | None], base: list[Outcomes | None], what: str) -> Paired | None:
    """``runs`` against ``base`` (the baseline's runs), run by run of the same seed, their pairs
    pooled into one test (``stats.paired_test``); None where no seed has outcomes on both sides.
    GtxError naming ``what`` where two runs of a seed hold different samples (another count, another
    sampling seed or other task settings)."""
    by_seed = {b.seed: b for b in base if b is not None}
    mine, theirs = [], []
    for run in runs:
        other = by_seed.get(run.seed) if run is not None else None
        if other is None:
            continue
        if (len(run.outcomes), run.sample_seed, run.task_settings) != (
            len(other.outcomes),
            other.sample_seed,
            other.task_settings,
        ):
            why = (
                "other task settings"
                if run.task_settings != other.task_settings
                else f"{len(run.outcomes)} samples drawn by seed {run.sample_seed} against "
                f"{len(other.outcomes)} drawn by seed {other.sample_seed}"
            )
            raise GtxError(
                f"{what}: run {run.run_id} and full's run {other.run_id} (seed {run.seed}) did not score the same samples "
                f"({why}); a paired test needs both over the same samples: run them with the same task settings"
            )
        mine += run.outcomes
        theirs += other.outcomes
    return paired_test(mine, theirs) if mine else None
