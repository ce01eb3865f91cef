"""The results schema, atomic writes, concurrent writers, and the comparison table."""

import multiprocessing as mp
import os

import numpy as np
import pandas as pd
import pytest

from gtx import results
from gtx.results import COLUMNS, compare, load, validate, write_run


def row(run_id="r1", pattern="full", split="valid", epoch=1, acc=0.5, seq=0.25, tps=1000.0, **kw):
    base = {c: None for c in COLUMNS}
    base.update(
        schema_version=3, run_id=run_id, started_at="2026-01-01T00:00:00+00:00", task="copy", model="transformer",
        pattern=pattern, backend="dgl", device="cpu", seed=0, epoch=epoch, split=split, loss=1.0, token_acc=acc,
        seq_acc=seq, tokens_per_s=tps, wall_s=1.0, peak_mem_mb=10.0, context_len=16, density=0.5, edges_per_query_ee=3.0, edges_per_query_dd=2.0,
        edges_per_query_ed=3.0, act_mean_steps=np.nan, n_params=10, metrics="{}", backend_plan="{}", config="{}",
        gtx_version="0", torch_version="0", dgl_version="0",
    )
    base.update(kw)
    return base


def test_schema_is_enforced():
    df = validate(pd.DataFrame([row()]))
    assert list(df.columns) == list(COLUMNS) and str(df.epoch.dtype) == "int64"
    with pytest.raises(ValueError, match=r"missing \['loss'\]"):
        validate(pd.DataFrame([row()]).drop(columns="loss"))
    with pytest.raises(ValueError, match=r"unexpected \['bogus'\]"):
        validate(pd.DataFrame([row(bogus=1)]))
    with pytest.raises(ValueError, match="split must be one of"):
        validate(pd.DataFrame([row(split="dev")]))
    with pytest.raises(ValueError, match=r"required columns hold missing values: \['token_acc'\]"):
        validate(pd.DataFrame([row(acc=None)]))
    with pytest.raises(ValueError, match="dtypes"):
        validate(pd.DataFrame([row(epoch="one")]))


def test_write_and_load_round_trip(tmp_path):
    write_run(tmp_path, "r1", [row(), row(split="train", seq=np.nan)])
    df = load(tmp_path)
    assert len(df) == 2 and df.seq_acc.isna().sum() == 1
    assert load(tmp_path / "empty").empty


def test_a_failed_write_leaves_the_earlier_file_intact(tmp_path, monkeypatch):
    write_run(tmp_path, "r1", [row()])
    before = (tmp_path / "runs" / "r1.csv").read_text()

    def crash(*a):
        raise KeyboardInterrupt  # killed between writing the temporary file and renaming it

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_run(tmp_path, "r1", [row(), row(epoch=2)])
    monkeypatch.undo()
    assert (tmp_path / "runs" / "r1.csv").read_text() == before
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["r1.csv"]  # no temporary file left behind
    assert len(load(tmp_path)) == 1


def _writer(args):
    folder, worker = args
    for epoch in range(1, 21):
        write_run(folder, f"run{worker}", [row(run_id=f"run{worker}", epoch=e) for e in range(1, epoch + 1)])


def test_concurrent_writers_lose_nothing(tmp_path):
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), w) for w in range(4)])
    df = load(tmp_path)
    assert len(df) == 4 * 20 and set(df.run_id) == {f"run{w}" for w in range(4)}


def test_compare_pivots_runs_and_relates_speed_to_full(tmp_path):
    rows = [
        row("a", "full", "train", 1, tps=1000.0), row("a", "full", "valid", 1, acc=0.9, seq=0.5),
        row("a", "full", "train", 2, tps=2000.0), row("a", "full", "valid", 2, acc=0.95, seq=0.7),
        row("a", "full", "test", 2, acc=0.9, seq=0.6),
        row("b", "local:w=4", "train", 1, tps=3000.0), row("b", "local:w=4", "valid", 1, acc=0.8, seq=0.4),
    ]
    table = compare(validate(pd.DataFrame(rows)))
    assert list(table.columns) == ["task", "model", "pattern", "backend", "runs", "best_valid_token_acc", "best_valid_seq_acc",
                                   "best_valid_loss", "test_seq_acc", "train_tokens_per_s", "density", "speed_vs_full"]
    full = table[table.pattern == "full"].iloc[0]
    local = table[table.pattern == "local:w=4"].iloc[0]
    assert full.best_valid_token_acc == 0.95 and full.train_tokens_per_s == 2000.0 and full.speed_vs_full == 1.0
    assert local.speed_vs_full == 1.5 and np.isnan(local.test_seq_acc)
    assert "| pattern" in results.format_table(table, "markdown")
    assert results.format_table(table, "csv").splitlines()[0].startswith("task,model,pattern")
    with pytest.raises(Exception, match="cannot group by"):
        compare(validate(pd.DataFrame(rows)), ["nope"])


def test_older_files_load_with_the_added_columns_missing(tmp_path):
    write_run(tmp_path, "new", [row(run_id="new", cell="abc")])
    old = pd.DataFrame([row(run_id="old", schema_version=1)]).drop(columns=["context_len", "density", "cell", "eval_of"])
    old.to_csv(tmp_path / "runs" / "old.csv", index=False)
    pd.DataFrame([row(run_id="two", schema_version=2)]).drop(columns=["cell", "eval_of"]).to_csv(tmp_path / "runs" / "two.csv", index=False)
    df = load(tmp_path).set_index("run_id")
    assert df.context_len["new"] == 16 and df.density["new"] == 0.5 and df.cell["new"] == "abc"
    assert pd.isna(df.context_len["old"]) and np.isnan(df.density["old"]) and pd.isna(df.cell["two"]) and pd.isna(df.eval_of["old"])
    assert compare(df.reset_index(), ["task", "context_len"]).runs.sum() == 3
