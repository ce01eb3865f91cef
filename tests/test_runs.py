"""`gtx runs` and `gtx show`: statuses, the key metric per task, differing settings, finding a run."""

import io
import json

import numpy as np
import pandas as pd
import pytest
from kit import invoke
from rows import row as schema_row

from gtx.errors import GtxError
from gtx.records import checkpoint, results, runs


def config(task="copy", epochs=2, n_train=300, **train):
    return json.dumps(
        {
            "task": task,
            "model_config": {"dim": 16, "max_len": 64},
            "task_config": {"n_train": n_train, "max_len": 64},
            "train": {"epochs": epochs, "lr_factor": 0.5, **train},
            "settings": {"dim": "16"},
        }
    )


def row(run_id, split, epoch, task="copy", acc=0.5, pattern="full", cfg=None, **kw):
    """rows.row of a run on ``task`` that records no seq_acc, configured as config(task) unless ``cfg``."""
    return schema_row(
        run_id, pattern, split, epoch, acc, np.nan, 100.0, task=task, backend="auto", config=cfg or config(task), **kw
    )


def epochs(run_id, n, test=False, **kw):
    out = [row(run_id, s, e, **kw) for e in range(1, n + 1) for s in ("train", "valid")]
    return out + ([row(run_id, "test", n, **kw)] if test else [])


@pytest.fixture
def folder(tmp_path):
    """Five runs: finished, killed with a last.pt, killed without, an eval of the first, and a text run."""
    done, killed, lost = (
        "20260101-000000-copy-transformer-aaa111",
        "20260102-000000-copy-transformer-bbb222",
        "20260103-000000-copy-transformer-ccc333",
    )
    results.write_run(tmp_path, done, epochs(done, 2, test=True, acc=0.9))
    results.write_run(tmp_path, killed, epochs(killed, 1, started_at="2026-01-02T00:00:00+00:00", cfg=config(epochs=4)))
    (checkpoint.checkpoint_dir(tmp_path, killed) / checkpoint.LAST).parent.mkdir(parents=True)
    (checkpoint.checkpoint_dir(tmp_path, killed) / checkpoint.LAST).write_bytes(b"")  # only its presence counts
    results.write_run(tmp_path, lost, epochs(lost, 1, started_at="2026-01-03T00:00:00+00:00", cfg=config(n_train=600)))
    ev = "20260104-000000-copy-transformer-eval-ddd444"
    results.write_run(
        tmp_path,
        ev,
        [row(ev, "test", 2, acc=0.7, eval_of=done, pattern="local:w=2", started_at="2026-01-04T00:00:00+00:00")],
    )
    text = "20260105-000000-text-lm-eee555"
    bpc = [
        row(text, "train", 1, task="text"),
        row(text, "valid", 1, task="text", metrics='{"bpc": 2.5}'),
        row(text, "train", 2, task="text"),
        row(text, "valid", 2, task="text", metrics='{"bpc": 2.1, "decode_s": 0.5}'),
    ]
    results.write_run(tmp_path, text, [{**r, "started_at": "2026-01-05T00:00:00+00:00", "model": "lm"} for r in bpc])
    return tmp_path


def listed(folder, *args) -> pd.DataFrame:
    result = invoke("runs", "--results", folder, "--format", "csv", *args)
    assert result.exit_code == 0, result.output
    return pd.read_csv(io.StringIO(result.output), keep_default_na=False).set_index("run_id")


def test_runs_lists_status_epochs_key_metric_and_differing_settings(folder):
    table = listed(folder)
    assert [i[-6:] for i in table.index] == ["aaa111", "bbb222", "ccc333", "ddd444", "eee555"]  # newest last
    assert list(table.status) == ["finished", "incomplete, resumable", "incomplete", "eval of aaa111", "incomplete"]
    assert list(table.epochs) == ["2/2", "1/4", "1/2", "2", "2/2"]
    assert list(table.metric) == ["token_acc"] * 4 + ["bpc"]
    assert list(table.best) == [0.9, 0.5, 0.5, 0.7, 2.1]  # the eval run: its own (test) row; bpc: lower is better
    # only what differs, model's then task's then train's: dim, max_len (in two groups) and lr_factor are the same in every run;
    # the text run's task and training settings are compared with no other run's (it is the only text run)
    assert list(table.settings) == [
        "n_train=300 epochs=2",
        "n_train=300 epochs=4",
        "n_train=600 epochs=2",
        "n_train=300 epochs=2",
        "",
    ]
    assert list(listed(folder, "--task", "text").index) == ["20260105-000000-text-lm-eee555"]
    assert list(listed(folder, "--pattern", "local:w=2").status) == ["eval of aaa111"]
    assert listed(folder, "--task", "copy", "--model", "transformer").settings.iloc[0] == "n_train=300 epochs=2"


def test_differing_keeps_a_prefix_where_two_groups_share_a_name():
    a = {"model.max_len": 64, "task.max_len": 64, "train.epochs": 1, "train.sizes": [1, 2]}
    b = {"model.max_len": 32, "task.max_len": 64, "train.epochs": 1, "train.sizes": [1, 3], "task.extra": True}
    assert runs.differing([a, b]) == [
        {"model.max_len": 64, "sizes": [1, 2]},
        {"model.max_len": 32, "sizes": [1, 3], "extra": True},
    ]
    assert results.settings_text(results.differing([a, b])[1]) == "model.max_len=32 extra=true sizes=[1, 3]"
    assert runs.differing([a]) == [{}]
    # a model's settings are compared among runs of that model only: an lm and a transformer share none to differ in
    lm, ut = {"model.dim": 16, "train.epochs": 1}, {"model.dim": 64, "model.act": True, "train.epochs": 2}
    assert runs.differing([lm, ut, ut], [{"model": "lm"}, {"model": "ut"}, {"model": "ut"}]) == [
        {"epochs": 1},
        {"epochs": 2},
        {"epochs": 2},
    ]
    assert runs.differing([lm, ut]) == [{"dim": 16, "epochs": 1}, {"act": True, "dim": 64, "epochs": 2}]


def test_runs_errors_are_one_line(folder, tmp_path_factory, cli):
    empty = tmp_path_factory.mktemp("empty")
    result = cli("runs", "--results", empty)
    assert (
        result.exit_code == 2
        and result.output == f"Error: no runs under {empty / 'runs'}; run `gtx run` first, or pass --results DIR\n"
    )
    result = cli("runs", "--results", folder, "--task", "sort")
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "no runs match --task sort" in result.output
    assert cli("runs", "--results", folder, "--format", "markdown").output.startswith("| run_id ")


def test_show_finds_a_run_by_id_prefix_or_suffix(folder, cli):
    df = results.load(folder)
    done = "20260101-000000-copy-transformer-aaa111"
    assert runs.find_run(df, done) == runs.find_run(df, "aaa111") == runs.find_run(df, "20260101") == done
    with pytest.raises(GtxError, match=r"'2026' is ambiguous: it matches 5 runs .*give more of the id"):
        runs.find_run(df, "2026")
    with pytest.raises(
        GtxError, match=r"no run 'aaa112' among 5 runs; closest: 20260101-000000-copy-transformer-aaa111"
    ):
        runs.find_run(df, "aaa112")
    result = cli("show", "bbb", "--results", folder)
    assert result.exit_code == 2 and result.output.startswith("Error: no run 'bbb'") and result.output.count("\n") == 1
    shown = cli("show", "ddd444", "--results", folder).output
    assert "eval_of     20260101-000000-copy-transformer-aaa111" in shown and "status      eval of aaa111" in shown
    shown = cli("show", "bbb222", "--results", folder).output
    assert (
        "status      incomplete, resumable" in shown
        and "last.pt" in shown
        and "train              epochs=4 lr_factor=0.5" in shown
    )


def test_a_real_run_listed_and_shown(tmp_path, cli, tiny_run):
    run = tiny_run(tmp_path, pattern="local:w=2", n_train=32)
    folder, run_id = run.folder, run.rows.run_id.iloc[0]
    table = listed(folder)
    assert (
        table.loc[run_id, "status"] == "finished"
        and table.loc[run_id, "pattern"] == "local:w=2"
        and table.loc[run_id, "settings"] == ""
    )
    shown = cli("show", runs.short_id(run_id), "--results", folder)
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0] == f"run         {run_id}" and "n_train=32" in shown.output
    assert [ln.split()[0] for ln in lines if ln.startswith(("train ", "valid ", "test "))][-3:] == [
        "train",
        "valid",
        "test",
    ]
    ckpts = [ln.split() for ln in lines if ".pt " in ln]  # path, size, MiB, modified, epoch
    # the epoch each holds
    assert sorted((c[0].rsplit("/", 1)[1], c[-1]) for c in ckpts) == [
        ("best.pt", "1"),
        ("last.pt", "1"),
    ]
    config = json.loads(cli("show", run_id, "--results", folder, "--format", "json").output)
    assert config["train"]["epochs"] == 1 and config["task_config"]["n_train"] == 32
    assert cli("eval", run_id, "--results", folder, "--pattern", "local:w=1").exit_code == 0
    df = results.load(folder)
    # as if killed before its test
    results.write_run(folder, run_id, df[(df.run_id == run_id) & (df.split != "test")].to_dict("records"))
    table = listed(folder)
    assert list(table.status) == ["incomplete, resumable", f"eval of {runs.short_id(run_id)}"] and list(
        table.pattern
    ) == ["local:w=2", "local:w=1"]


def test_one_resolver_names_runs_by_id_prefix_or_tail_in_tables_and_checkpoints(tmp_path):
    from gtx.records import runref

    results.write_run(tmp_path, "20260101-000000-copy-lm-aaa111", [row("20260101-000000-copy-lm-aaa111", "train", 1)])
    (tmp_path / "checkpoints" / "20260102-000000-copy-lm-bbb222").mkdir(parents=True)  # killed before its first rows
    (tmp_path / "checkpoints" / "20260102-000000-copy-lm-bbb222" / checkpoint.LAST).write_bytes(b"")
    assert runref.run_ids(tmp_path) == ["20260101-000000-copy-lm-aaa111", "20260102-000000-copy-lm-bbb222"]
    assert (
        runref.resolve_run("aaa111", tmp_path)
        == runref.resolve_run("20260101", tmp_path)
        == "20260101-000000-copy-lm-aaa111"
    )
    assert (
        runref.find_checkpoint("bbb222", tmp_path)
        == tmp_path / "checkpoints" / "20260102-000000-copy-lm-bbb222" / checkpoint.LAST
    )
    with pytest.raises(
        GtxError,
        match=r"'2026' is ambiguous: it matches 2 runs \(20260101-000000-copy-lm-aaa111, 20260102-000000-copy-lm-bbb222\)",
    ):
        runref.resolve_run("2026", tmp_path)
    with pytest.raises(
        GtxError, match=r"no run 'bbb223' among 2 runs --results .*; closest: 20260102-000000-copy-lm-bbb222"
    ):
        runref.resolve_run("bbb223", tmp_path)
    with pytest.raises(GtxError, match=r"run 20260101-000000-copy-lm-aaa111 has no checkpoint \(best.pt or last.pt\)"):
        runref.find_checkpoint("aaa111", tmp_path)
