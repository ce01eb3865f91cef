"""The results schema, atomic writes, concurrent writers, and the comparison table."""

import multiprocessing as mp
import os
import re

import numpy as np
import pandas as pd
import pytest
from rows import row

from gtx.records.compare import compare
from gtx.records.results import COLUMNS, SCHEMA_VERSION, load, validate, write_run


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
    with pytest.raises(ValueError, match="column config of row 1 is not JSON"):
        validate(pd.DataFrame([row(config="{}"), row(config='{"a": ')]))


def test_load_skips_a_file_with_broken_json_and_a_folder_named_like_a_run(tmp_path):
    """A hand-edited ``config`` or ``metrics`` cell, or a folder ``x.csv``, is skipped with a warning:
    every command that reads runs (runs, compare, show, report, plot) goes on with the others."""
    write_run(tmp_path, "good", [row(run_id="good")])
    (tmp_path / "runs" / "x.csv").mkdir()
    broken = tmp_path / "runs" / "edited.csv"
    pd.DataFrame([row(run_id="edited")]).assign(metrics="{oops").to_csv(broken, index=False)
    with pytest.warns(UserWarning) as caught:
        df = load(tmp_path)
    assert list(df.run_id) == ["good"]
    assert sorted(str(w.message).split(":")[0] for w in caught) == [
        f"skipping {broken}",
        f"skipping {tmp_path / 'runs' / 'x.csv'}",
    ]


@pytest.mark.parametrize(
    "kw, column, said",
    [
        ({"acc": 7.5}, "token_acc", "holds 7.5, which it cannot: a finite number in [0, 1]"),
        ({"seq": -0.5}, "seq_acc", "holds -0.5, which it cannot: a finite number in [0, 1]"),
        ({"tps": np.inf}, "tokens_per_s", "holds inf, which it cannot: a finite number in [0, inf)"),
        ({"density": 2.0}, "density", "holds 2.0"),
        ({"loss": -np.inf}, "loss", "holds -inf"),
    ],
)
def test_a_number_a_column_cannot_hold_is_refused_on_write_and_skipped_on_load(tmp_path, kw, column, said):
    """An accuracy past 1, an infinite speed (a hand-edited or foreign file): never written, and a
    file holding one is skipped with a warning naming it and the column (runs, compare, show printed it)."""
    with pytest.raises(ValueError, match=re.escape(f"column {column} of row 1 {said}")):
        write_run(tmp_path, "r1", [row(), row(**kw)])
    write_run(tmp_path, "good", [row(run_id="good")])
    bad = tmp_path / "runs" / "edited.csv"
    pd.DataFrame([row(run_id="edited"), row(run_id="edited", **kw)]).to_csv(bad, index=False)
    with pytest.warns(UserWarning, match=f"skipping {bad}: results: column {column} of row 1 holds"):
        df = load(tmp_path)
    assert list(df.run_id) == ["good"]


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


def test_older_files_load_with_the_added_columns_missing(tmp_path):
    write_run(tmp_path, "new", [row(run_id="new", cell="abc", split=split) for split in ("valid", "test")])
    old = pd.DataFrame([row(run_id="old", schema_version=1, split=split) for split in ("valid", "test")])
    old.drop(columns=["context_len", "density", "cell", "eval_of", "definitions"]).to_csv(
        tmp_path / "runs" / "old.csv", index=False
    )
    two = pd.DataFrame([row(run_id="two", schema_version=2, split=split) for split in ("valid", "test")])
    two.drop(columns=["cell", "eval_of"]).to_csv(tmp_path / "runs" / "two.csv", index=False)
    df = load(tmp_path).drop_duplicates("run_id").set_index("run_id")  # a valid and a test row each: one is enough here
    assert df.context_len["new"] == 16 and df.density["new"] == 0.5 and df.cell["new"] == "abc"
    assert (
        pd.isna(df.context_len["old"])
        and np.isnan(df.density["old"])
        and pd.isna(df.cell["two"])
        and pd.isna(df.eval_of["old"])
        and pd.isna(df.definitions["old"])
    )
    assert compare(load(tmp_path), ["task", "context_len"]).runs.sum() == 3


def test_a_file_of_a_newer_schema_is_refused_in_one_line_never_rewritten(tmp_path, cli):
    from gtx.errors import GtxError

    write_run(tmp_path, "ok", [row(run_id="ok", split=split) for split in ("valid", "test")])
    newer = tmp_path / "runs" / "newer.csv"
    pd.DataFrame([row(run_id="newer", schema_version=999, split=split) for split in ("valid", "test")]).to_csv(
        newer, index=False
    )
    before = newer.read_bytes()
    with pytest.raises(
        GtxError, match=rf"newer.csv has schema version 999, newer than this gtx reads \({SCHEMA_VERSION}\)"
    ):
        load(tmp_path)
    with pytest.raises(GtxError, match="schema version 999"):
        write_run(tmp_path, "newer", [row(run_id="newer")])
    for command in ("runs", "compare"):
        result = cli(command, "--results", tmp_path)
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert "schema version 999" in result.output and "move it out of" in result.output
    assert newer.read_bytes() == before
