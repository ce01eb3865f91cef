"""gtx compare: experiments pooled over seeds, never across settings; evals beside their training."""

import io
import json

import numpy as np
import pandas as pd
import pytest
from rows import row, seeds, three_seeds

from gtx.errors import GtxError
from gtx.records import results
from gtx.records.compare import compare, compare_evals, format_compare
from gtx.records.results import validate


def test_compare_pivots_runs_and_relates_speed_to_full(tmp_path):
    rows = [
        row("a", "full", "train", 1, tps=1000.0),
        row("a", "full", "valid", 1, acc=0.9, seq=0.5),
        row("a", "full", "train", 2, tps=2000.0),
        row("a", "full", "valid", 2, acc=0.95, seq=0.7),
        row("a", "full", "test", 2, acc=0.9, seq=0.6),
        row("b", "local:w=4", "train", 1, tps=3000.0),
        row("b", "local:w=4", "valid", 1, acc=0.8, seq=0.4),
        row("b", "local:w=4", "test", 1, acc=0.8, seq=0.3),
    ]
    table = compare(validate(pd.DataFrame(rows)))
    stats = [
        f"{m}_{s}"
        for m in ("best_valid_token_acc", "best_valid_seq_acc", "best_valid_loss", "test_seq_acc", "train_tokens_per_s")
        for s in ("mean", "std", "ci_low", "ci_high")
    ]
    assert list(table.columns) == [
        "task",
        "model",
        "pattern",
        "backend",
        "settings",
        "runs",
        "metric",
        *stats,
        "density",
        "speed_vs_full",
        "p_vs_full",
        "vs_full",
        "pareto",
    ]
    assert (table.settings == "").all() and (table.metric == "best_valid_token_acc").all()
    full = table[table.pattern == "full"].iloc[0]
    local = table[table.pattern == "local:w=4"].iloc[0]
    assert (
        full.best_valid_token_acc_mean == 0.95 and full.train_tokens_per_s_mean == 2000.0 and full.speed_vs_full == 1.0
    )
    assert local.speed_vs_full == 1.5 and local.test_seq_acc_mean == 0.3
    assert (
        full.runs == 1
        and np.isnan(full.best_valid_token_acc_std)
        and local.vs_full == "-"
        and np.isnan(local.p_vs_full)
    )
    assert full.pareto and local.pareto  # one more accurate, the other faster
    assert "| pattern" in format_compare(table, "markdown")
    assert (
        format_compare(table, "csv")
        .splitlines()[0]
        .startswith("task,model,pattern,backend,settings,runs,metric,best_valid_token_acc_mean")
    )
    with pytest.raises(Exception, match="cannot group by"):
        compare(validate(pd.DataFrame(rows)), ["nope"])
    with pytest.raises(Exception, match="--by names task more than once"):
        compare(validate(pd.DataFrame(rows)), ["task,task"])
    # a run has a split per row, not one of its own: every run grouped as its first row, "train"
    with pytest.raises(Exception, match=r"cannot group runs by split, loss: a run's rows differ there .* task, model"):
        compare(validate(pd.DataFrame(rows)), ["task,split,loss"])
    assert list(compare(validate(pd.DataFrame(rows)), ["task,context_len"]).columns[:2]) == ["task", "context_len"]


def test_compare_summarises_seeds_tests_against_full_and_marks_the_front():
    table = compare(three_seeds()).set_index("pattern")
    full, w4, w1, strided = (table.loc[p] for p in ("full", "local:w=4", "local:w=1", "strided"))
    assert (table.runs == 3).all()
    assert full.best_valid_token_acc_mean == pytest.approx(0.98) and full.best_valid_token_acc_std == pytest.approx(
        0.01
    )
    # t_{0.975,2} * 0.01 / sqrt(3), by hand; the upper end, 1.0048, is clipped to the accuracy's range
    assert (
        0.98 - full.best_valid_token_acc_ci_low == pytest.approx(4.302653 * 0.01 / 3**0.5)
        and full.best_valid_token_acc_ci_high == 1.0
    )
    assert (w4.vs_full, w1.vs_full, strided.vs_full, full.vs_full) == ("worse", "worse", "same", "-")
    assert w4.p_vs_full < 0.05 and strided.p_vs_full > 0.05 and np.isnan(full.p_vs_full)
    assert w4.speed_vs_full == pytest.approx(3.0)
    assert table.pareto.to_dict() == {"full": True, "local:w=1": False, "local:w=4": True, "strided": True}
    assert table.attrs["metric"] == "best_valid_token_acc"
    text = format_compare(compare(three_seeds()))
    header, *lines = text.splitlines()
    assert header.split()[:7] == ["task", "model", "pattern", "backend", "runs", "best_valid_token_acc", "ci95"]
    assert "best_valid_loss" not in header and "welch_p" in header
    w4_line = next(line for line in lines if "local:w=4" in line)
    assert (
        "0.8100 ± 0.0100" in w4_line
        and "3,000 ± 300" in w4_line
        and "worse" in w4_line
        and w4_line.rstrip().endswith("*")
    )
    csv = format_compare(compare(three_seeds()), "csv")
    assert "±" not in csv and "p_vs_full" in csv.splitlines()[0]


def test_compare_metric_choice_direction_and_errors():
    df = three_seeds()
    # the task's own metrics: lower bpc is better, so w=4 (higher bpc) is worse and w=1 (lower) better
    bpc = {"full": 1.0, "local:w=4": 1.5, "local:w=1": 0.5, "strided": 1.0}
    df["metrics"] = [results.metrics_json({"bpc": bpc[p] + 0.01 * s}) for p, s in zip(df.pattern, df.seed)]
    table = compare(df, metric="bpc").set_index("pattern")
    assert table.attrs["metric"] == "best_valid_bpc" and table.best_valid_bpc_mean["local:w=1"] == pytest.approx(0.51)
    assert table.vs_full.to_dict() == {"full": "-", "local:w=1": "better", "local:w=4": "worse", "strided": "same"}
    # w=1 now beats both
    assert table.pareto.to_dict() == {
        "full": False,
        "local:w=1": True,
        "local:w=4": True,
        "strided": False,
    }
    assert compare(df, metric="test_seq_acc").attrs["metric"] == "test_seq_acc"
    with pytest.raises(
        GtxError, match=r"unknown metric 'nope'; metrics of these runs: token_acc, seq_acc, loss, test_seq_acc, bpc"
    ):
        compare(df, metric="nope")


def test_compare_leaves_out_eval_rows_and_counts_a_cell_once():
    df = three_seeds()
    evals = df[df.pattern == "full"].assign(run_id="e", eval_of="full0", token_acc=0.1)
    rerun = df[df.run_id == "full0"].assign(run_id="again", started_at="2026-02-01T00:00:00+00:00", token_acc=0.5)
    unfinished = rerun[rerun.split != "test"].assign(
        run_id="killed", started_at="2026-03-01T00:00:00+00:00", token_acc=0.0
    )
    table = compare(pd.concat([df, evals, rerun, unfinished], ignore_index=True)).set_index("pattern")
    assert table.runs["full"] == 3  # the repeat of seed 0 replaces it: the latest finished one
    assert table.best_valid_token_acc_mean["full"] == pytest.approx((0.5 + 0.98 + 0.97) / 3)


def test_compare_counts_finished_runs_and_names_those_it_leaves_out(tmp_path, cli):
    """A run still training (or stopped) has no test rows: its best valid epoch so far is no seed's
    result, so it does not pool, and the command says which runs it left out."""
    df = three_seeds()
    training = df[(df.run_id == "full0") & (df.split != "test")].assign(
        run_id="live", seed=3, cell="full/3", token_acc=0.1
    )
    table = compare(pd.concat([df, training], ignore_index=True)).set_index("pattern")
    assert table.runs["full"] == 3 and table.best_valid_token_acc_mean["full"] == pytest.approx(0.98)
    assert table.attrs["unfinished"] == ["live"]
    assert compare(df).attrs["unfinished"] == []
    (tmp_path / "runs").mkdir()
    for run_id, rows in pd.concat([df, training], ignore_index=True).groupby("run_id"):
        rows.to_csv(tmp_path / "runs" / f"{run_id}.csv", index=False)
    result = cli("compare", "--results", tmp_path, "--format", "csv")
    assert result.exit_code == 0, result.output
    assert "left out 1 unfinished run(s), without test rows yet (still training, or stopped): live" in result.stderr
    # the table itself stays plain CSV
    assert pd.read_csv(io.StringIO(result.stdout)).set_index("pattern").runs["full"] == 3


def test_compare_renders_single_runs_without_spread():
    table = compare(validate(pd.DataFrame(seeds("full", [0.9], [1000.0]) + seeds("local:w=4", [0.8], [2000.0]))))
    header, _, full, local = (
        [c.strip() for c in line.strip("|").split("|")] for line in format_compare(table, "markdown").splitlines()
    )
    cells = dict(zip(header, full))
    assert (
        cells["runs"] == "1"
        and cells["best_valid_token_acc"] == "0.9000"
        and cells["ci95"] == "-"
        and cells["train_tokens_per_s"] == "1,000"
    )
    assert dict(zip(header, local))["vs_full"] == "-"  # one run each: nothing to test


def run(
    run_id,
    pattern="full",
    seed=0,
    acc=0.9,
    tps=1000.0,
    task="copy",
    model="transformer",
    epochs=4,
    n_train=1000,
    metrics="{}",
    **kw,
):
    """A finished run whose stored configuration holds its settings, as `gtx run` writes it."""
    config = json.dumps({"model_config": {"dim": 16}, "task_config": {"n_train": n_train}, "train": {"epochs": epochs}})
    common = dict(task=task, model=model, seed=seed, config=config, metrics=metrics, **kw)
    return [
        row(run_id, pattern, "train", tps=tps, **common),
        row(run_id, pattern, "valid", acc=acc, **common),
        row(run_id, pattern, "test", acc=acc, **common),
    ]


def test_runs_with_other_settings_never_pool_and_the_table_says_what_differs():
    df = validate(
        pd.DataFrame(
            [*run("a", acc=0.95, seed=0), *run("b", acc=0.97, seed=1), *run("c", acc=0.1, epochs=1, n_train=300)]
        )
    )
    table = compare(df)
    assert sorted(table.runs) == [1, 2]
    assert sorted(table.settings) == ["n_train=1000 epochs=4", "n_train=300 epochs=1"]
    pooled = table[table.runs == 2].iloc[0]
    assert (
        pooled.best_valid_token_acc_mean == pytest.approx(0.96)
        and 0.0 <= pooled.best_valid_token_acc_ci_low <= pooled.best_valid_token_acc_ci_high <= 1.0
    )
    assert "settings" in format_compare(table).splitlines()[0]
    # one experiment per group: no column
    assert "settings" not in format_compare(compare(df[df.run_id != "c"])).splitlines()[0]


def test_full_is_matched_within_the_same_model_never_another():
    df = validate(
        pd.DataFrame(
            [
                *run("t-full", "full", tps=1000.0),
                *run("t-local", "local:w=4", tps=2000.0),
                *run("u-full", "full", tps=500.0, model="ut"),
                *run("u-local", "local:w=4", tps=2000.0, model="ut"),
            ]
        )
    )
    table = compare(df, ["task", "pattern"])
    local = table[table.pattern == "local:w=4"].set_index("settings")
    assert local.speed_vs_full.to_dict() == {"model=transformer": 2.0, "model=ut": 4.0}
    alone = compare(df[df.run_id != "u-full"], ["task", "pattern"])
    # no full of its own model
    assert alone[(alone.pattern == "local:w=4") & (alone.settings == "model=ut")].speed_vs_full.isna().all()


def test_the_default_metric_is_the_tasks_own_and_mixed_tasks_name_theirs():
    bpc = [
        *run("t1", seed=0, task="text", metrics=results.metrics_json({"bpc": 2.0})),
        *run("t2", seed=1, task="text", metrics=results.metrics_json({"bpc": 2.2})),
    ]
    table = compare(validate(pd.DataFrame(bpc)), task_metrics={"text": "bpc"})
    # clipped at 0, bpc's floor
    assert table.attrs["metric"] == "best_valid_bpc" and table.best_valid_bpc_ci_low.iloc[0] >= 0.0
    assert format_compare(table).splitlines()[0].split()[4:6] == ["runs", "best_valid_bpc"]
    mixed = compare(validate(pd.DataFrame([*bpc, *run("c", acc=0.5)])), task_metrics={"text": "bpc"})
    assert mixed.attrs["metric"] is None and set(mixed.metric) == {"best_valid_bpc", "best_valid_token_acc"}
    header = format_compare(mixed).splitlines()[0].split()
    assert header[4:8] == ["runs", "metric", "score", "ci95"]


def test_grouping_by_eval_of_and_bad_by_columns():
    df = three_seeds()
    table = compare(df, ["task", "pattern", "eval_of"])
    assert len(table) == 4 and table.eval_of.isna().all()
    for by in ([","], [" "], []):
        with pytest.raises(GtxError, match="--by names no column"):
            compare(df, by)


def test_evals_are_set_beside_the_same_checkpoint_under_its_training_pattern():
    rows = []
    for seed, (own, other) in enumerate([(0.9, 0.5), (0.8, 0.5), (0.7, 0.4)]):
        trained = run(f"r{seed}", "full", seed=seed, acc=own)
        rows += trained
        config = json.dumps({**json.loads(trained[0]["config"]), "trained_pattern": "full"})
        rows.append(row(f"e{seed}", "local:w=2", "test", acc=other, seed=seed, eval_of=f"r{seed}", config=config))
    df = validate(pd.DataFrame(rows))
    table = compare_evals(df)
    assert len(table) == 1
    r = table.iloc[0]
    assert (r.pattern, r.trained_pattern, r.split, r.runs, r.metric) == ("local:w=2", "full", "test", 3, "token_acc")
    assert r.value_mean == pytest.approx(0.4667, abs=1e-4) and r.trained_mean == pytest.approx(0.8)
    assert r.delta_mean == pytest.approx(-1 / 3) and r.p_vs_trained < 0.05 and r.vs_trained == "worse"
    # an eval under the training pattern itself, where it exists, is the baseline (here: a lower score than the run's test row)
    again = [
        row(f"f{s}", "full", "test", acc=0.6, seed=s, eval_of=f"r{s}", config=df.config[df.run_id == f"e{s}"].iloc[0])
        for s in range(3)
    ]
    table = compare_evals(validate(pd.DataFrame([*rows, *again])))
    assert table.set_index("pattern").trained_mean["local:w=2"] == pytest.approx(0.6)
    text = format_compare(table)
    assert "vs_trained" in text.splitlines()[0] and "-0.1333 ± 0.0577" in text
    with pytest.raises(GtxError, match="no gtx eval runs"):
        compare_evals(three_seeds())
