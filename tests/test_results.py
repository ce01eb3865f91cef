"""The results schema, atomic writes, concurrent writers, and the comparison table."""

import multiprocessing as mp
import os

import numpy as np
import pandas as pd
import pytest

from gtx import results
from gtx.errors import GtxError
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
    stats = [f"{m}_{s}" for m in ("best_valid_token_acc", "best_valid_seq_acc", "best_valid_loss", "test_seq_acc", "train_tokens_per_s")
             for s in ("mean", "std", "ci_low", "ci_high")]
    assert list(table.columns) == ["task", "model", "pattern", "backend", "runs", *stats, "density", "speed_vs_full", "p_vs_full", "vs_full", "pareto"]
    full = table[table.pattern == "full"].iloc[0]
    local = table[table.pattern == "local:w=4"].iloc[0]
    assert full.best_valid_token_acc_mean == 0.95 and full.train_tokens_per_s_mean == 2000.0 and full.speed_vs_full == 1.0
    assert local.speed_vs_full == 1.5 and np.isnan(local.test_seq_acc_mean)
    assert full.runs == 1 and np.isnan(full.best_valid_token_acc_std) and local.vs_full == "-" and np.isnan(local.p_vs_full)
    assert full.pareto and local.pareto  # one more accurate, the other faster
    assert "| pattern" in results.format_compare(table, "markdown")
    assert results.format_compare(table, "csv").splitlines()[0].startswith("task,model,pattern,backend,runs,best_valid_token_acc_mean")
    with pytest.raises(Exception, match="cannot group by"):
        compare(validate(pd.DataFrame(rows)), ["nope"])


def seeds(pattern, accs, tps, **kw):
    """One finished run per accuracy: a train, a valid and a test row each."""
    return [r for seed, (acc, speed) in enumerate(zip(accs, tps)) for r in (
        row(f"{pattern}{seed}", pattern, "train", tps=speed, seed=seed, cell=f"{pattern}/{seed}", **kw),
        row(f"{pattern}{seed}", pattern, "valid", acc=acc, seed=seed, cell=f"{pattern}/{seed}", **kw),
        row(f"{pattern}{seed}", pattern, "test", acc=acc, seed=seed, cell=f"{pattern}/{seed}", **kw),
    )]


def three_seeds():
    return validate(pd.DataFrame([
        *seeds("full", [0.99, 0.98, 0.97], [1000.0, 1100.0, 900.0]),
        *seeds("local:w=4", [0.80, 0.82, 0.81], [3000.0, 3300.0, 2700.0]),
        *seeds("local:w=1", [0.70, 0.74, 0.72], [2000.0, 2000.0, 2000.0]),  # slower and less accurate than w=4
        *seeds("strided", [0.965, 0.975, 0.97], [1500.0, 1500.0, 1500.0]),
    ]))


def test_compare_summarises_seeds_tests_against_full_and_marks_the_front():
    table = compare(three_seeds()).set_index("pattern")
    full, w4, w1, strided = (table.loc[p] for p in ("full", "local:w=4", "local:w=1", "strided"))
    assert (table.runs == 3).all()
    assert full.best_valid_token_acc_mean == pytest.approx(0.98) and full.best_valid_token_acc_std == pytest.approx(0.01)
    # t_{0.975,2} * 0.01 / sqrt(3), by hand
    assert full.best_valid_token_acc_ci_high - 0.98 == pytest.approx(4.302653 * 0.01 / 3 ** 0.5)
    assert (w4.vs_full, w1.vs_full, strided.vs_full, full.vs_full) == ("worse", "worse", "same", "-")
    assert w4.p_vs_full < 0.05 and strided.p_vs_full > 0.05 and np.isnan(full.p_vs_full)
    assert w4.speed_vs_full == pytest.approx(3.0)
    assert table.pareto.to_dict() == {"full": True, "local:w=1": False, "local:w=4": True, "strided": True}
    assert table.attrs["metric"] == "best_valid_token_acc"
    text = results.format_compare(compare(three_seeds()))
    header, *lines = text.splitlines()
    assert header.split()[:7] == ["task", "model", "pattern", "backend", "runs", "best_valid_token_acc", "ci95"]
    assert "best_valid_loss" not in header and "welch_p" in header
    w4_line = next(line for line in lines if "local:w=4" in line)
    assert "0.8100 ± 0.0100" in w4_line and "3,000 ± 300" in w4_line and "worse" in w4_line and w4_line.rstrip().endswith("*")
    csv = results.format_compare(compare(three_seeds()), "csv")
    assert "±" not in csv and "p_vs_full" in csv.splitlines()[0]


def test_compare_metric_choice_direction_and_errors():
    df = three_seeds()
    # the task's own metrics: lower bpc is better, so w=4 (higher bpc) is worse and w=1 (lower) better
    bpc = {"full": 1.0, "local:w=4": 1.5, "local:w=1": 0.5, "strided": 1.0}
    df["metrics"] = [results.metrics_json({"bpc": bpc[p] + 0.01 * s}) for p, s in zip(df.pattern, df.seed)]
    table = compare(df, metric="bpc").set_index("pattern")
    assert table.attrs["metric"] == "best_valid_bpc" and table.best_valid_bpc_mean["local:w=1"] == pytest.approx(0.51)
    assert table.vs_full.to_dict() == {"full": "-", "local:w=1": "better", "local:w=4": "worse", "strided": "same"}
    assert table.pareto.to_dict() == {"full": False, "local:w=1": True, "local:w=4": True, "strided": False}  # w=1 now beats both
    assert compare(df, metric="test_seq_acc").attrs["metric"] == "test_seq_acc"
    with pytest.raises(GtxError, match=r"unknown metric 'nope'; metrics of these runs: best_valid_token_acc, .*best_valid_bpc"):
        compare(df, metric="nope")


def test_compare_leaves_out_eval_rows_and_counts_a_cell_once():
    df = three_seeds()
    evals = df[df.pattern == "full"].assign(run_id="e", eval_of="full0", token_acc=0.1)
    rerun = df[df.run_id == "full0"].assign(run_id="again", started_at="2026-02-01T00:00:00+00:00", token_acc=0.5)
    unfinished = rerun[rerun.split != "test"].assign(run_id="killed", started_at="2026-03-01T00:00:00+00:00", token_acc=0.0)
    table = compare(pd.concat([df, evals, rerun, unfinished], ignore_index=True)).set_index("pattern")
    assert table.runs["full"] == 3  # the repeat of seed 0 replaces it: the latest finished one
    assert table.best_valid_token_acc_mean["full"] == pytest.approx((0.5 + 0.98 + 0.97) / 3)


def test_compare_renders_single_runs_without_spread():
    table = compare(validate(pd.DataFrame(seeds("full", [0.9], [1000.0]) + seeds("local:w=4", [0.8], [2000.0]))))
    header, _, full, local = ([c.strip() for c in line.strip("|").split("|")] for line in results.format_compare(table, "markdown").splitlines())
    cells = dict(zip(header, full))
    assert cells["runs"] == "1" and cells["best_valid_token_acc"] == "0.9000" and cells["ci95"] == "-" and cells["train_tokens_per_s"] == "1,000"
    assert dict(zip(header, local))["vs_full"] == "-"  # one run each: nothing to test


def test_older_files_load_with_the_added_columns_missing(tmp_path):
    write_run(tmp_path, "new", [row(run_id="new", cell="abc")])
    old = pd.DataFrame([row(run_id="old", schema_version=1)]).drop(columns=["context_len", "density", "cell", "eval_of"])
    old.to_csv(tmp_path / "runs" / "old.csv", index=False)
    pd.DataFrame([row(run_id="two", schema_version=2)]).drop(columns=["cell", "eval_of"]).to_csv(tmp_path / "runs" / "two.csv", index=False)
    df = load(tmp_path).set_index("run_id")
    assert df.context_len["new"] == 16 and df.density["new"] == 0.5 and df.cell["new"] == "abc"
    assert pd.isna(df.context_len["old"]) and np.isnan(df.density["old"]) and pd.isna(df.cell["two"]) and pd.isna(df.eval_of["old"])
    assert compare(df.reset_index(), ["task", "context_len"]).runs.sum() == 3
