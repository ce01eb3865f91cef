"""Results rows for tests: one schema row, finished runs over seeds."""

import numpy as np
import pandas as pd

from gtx.records.results import COLUMNS, SCHEMA_VERSION, validate

#: what a row holds unless told otherwise: a finished epoch of a transformer on copy
FIXED = {
    "schema_version": SCHEMA_VERSION,
    "started_at": "2026-01-01T00:00:00+00:00",
    "task": "copy",
    "model": "transformer",
    "backend": "dgl",
    "device": "cpu",
    "seed": 0,
    "loss": 1.0,
    "wall_s": 1.0,
    "peak_mem_mb": 10.0,
    "context_len": 16,
    "density": 0.5,
    "edges_per_query_ee": 3.0,
    "edges_per_query_dd": 2.0,
    "edges_per_query_ed": 3.0,
    "act_mean_steps": np.nan,
    "n_params": 10,
    **dict.fromkeys(["metrics", "backend_plan", "config"], "{}"),
    **dict.fromkeys(["gtx_version", "torch_version", "dgl_version"], "0"),
}


def row(run_id="r1", pattern="full", split="valid", epoch=1, acc=0.5, seq=0.25, tps=1000.0, **kw):
    """One row of every schema column (None where FIXED and the arguments say nothing); ``kw``: any column."""
    given = dict(run_id=run_id, pattern=pattern, split=split, epoch=epoch, token_acc=acc, seq_acc=seq, tokens_per_s=tps)
    return {**dict.fromkeys(COLUMNS), **FIXED, **given, **kw}


def seeds(pattern, accs, tps, **kw):
    """One finished run per accuracy: a train, a valid and a test row each."""
    return [
        r
        for seed, (acc, speed) in enumerate(zip(accs, tps))
        for r in (
            row(f"{pattern}{seed}", pattern, "train", tps=speed, seed=seed, cell=f"{pattern}/{seed}", **kw),
            row(f"{pattern}{seed}", pattern, "valid", acc=acc, seed=seed, cell=f"{pattern}/{seed}", **kw),
            row(f"{pattern}{seed}", pattern, "test", acc=acc, seed=seed, cell=f"{pattern}/{seed}", **kw),
        )
    ]


def three_seeds():
    return validate(
        pd.DataFrame(
            [
                *seeds("full", [0.99, 0.98, 0.97], [1000.0, 1100.0, 900.0]),
                *seeds("local:w=4", [0.80, 0.82, 0.81], [3000.0, 3300.0, 2700.0]),
                *seeds("local:w=1", [0.70, 0.74, 0.72], [2000.0, 2000.0, 2000.0]),  # slower and less accurate than w=4
                *seeds("strided", [0.965, 0.975, 0.97], [1500.0, 1500.0, 1500.0]),
            ]
        )
    )
