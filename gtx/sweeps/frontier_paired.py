"""A frontier's paired side, for tasks scored by generation: each budget's per-sample outcomes against
full's on the same samples (``gtx.records.paired``), its compression, and per family and length the
largest compression not significantly worse than full (``largest_not_worse``).

Compression is full's keys per query over the budget's, in the phase the budget applies to: the
prompt's (the teacher-forced pass: ``edges_per_query``) for a family of the whole run or of the
prefill, the generated tokens' (``decode_edges_per_query``) for a decode family. Knows nothing of click.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from gtx.records.paired import Outcomes, paired_against, run_outcomes
from gtx.records.results import metric_values

ALPHA = 0.05  # one-sided: a budget is significantly worse than full where worse_p < ALPHA
#: the table's columns of the paired test, in order
PAIRED_COLUMNS = [
    "paired_test",
    "pairs",
    "full_acc",
    "paired_acc",
    "worse_pairs",
    "better_pairs",
    "paired_p",
    "worse_p",
    "sig_worse",
    "largest_not_worse",
]


def run_sides(rows_by_run: dict[str, pd.DataFrame], run_ids, metric: str) -> tuple[list[Outcomes | None], float]:
    """An experiment's runs: their outcomes (``run_outcomes``; None for a run without) and the mean
    over them of the keys each generated token's query read (NaN where none was recorded)."""
    outcomes, read = [], []
    for run_id in run_ids:
        rows = rows_by_run[run_id]
        outcomes.append(run_outcomes(rows, metric))
        valid = rows[rows.split == "valid"]
        read += list(metric_values(valid, "decode_edges_per_query").dropna())
    return outcomes, float(np.mean(read)) if read else math.nan


def against_full(mine: list[Outcomes | None], full: list[Outcomes | None], what: str) -> dict[str, object]:
    """The paired columns of a budget's row against full's runs (NaN, or False, where nothing pairs)."""
    test = paired_against(mine, full, what)
    if test is None:
        return {c: math.nan for c in PAIRED_COLUMNS} | {"sig_worse": False, "largest_not_worse": False}
    return {
        "paired_test": test.test,
        "pairs": test.n,
        "full_acc": test.base_acc,
        "paired_acc": test.acc,
        "worse_pairs": test.worse,
        "better_pairs": test.better,
        "paired_p": test.p,
        "worse_p": test.p_worse,
        "sig_worse": bool(test.p_worse < ALPHA),
        "largest_not_worse": False,
    }


def mark_largest(table: pd.DataFrame, group_keys: list[str]) -> pd.Series:
    """Per ``group_keys`` and family: True on the budget of the largest compression among those a
    paired test found not significantly worse than full (the first of equal ones), False elsewhere."""
    out = pd.Series(False, index=table.index)
    tested = table[table.pairs.notna() & ~table.sig_worse.astype(bool) & table.compression.notna()]
    for _, rows in tested.groupby([*group_keys, "family"], sort=False, dropna=False):
        out[rows.compression.astype(float).idxmax()] = True
    return out
