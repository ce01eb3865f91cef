"""Data-parallel training under torchrun (CPU, gloo): the same steps as one process."""

import os
import subprocess
import sys

import pandas as pd
import pytest
from kit import TINY_COPY, TINY_MODEL, TINY_TRAIN, sets

from gtx.records.results import load
from gtx.run.distributed import World
from gtx.run.train import PhaseStats

#: the tiny copy run, 60 examples in batches of 8, without dropout: the same steps however many processes
SETTINGS = {**TINY_MODEL, **TINY_TRAIN, **TINY_COPY, "n_train": 60, "n_valid": 16, "n_test": 16, "dropout": 0}
ARGS = ["run", "--seed", "1", *sets({**SETTINGS, "epochs": 2}), "--quiet"]


def test_two_processes_match_one_on_the_same_global_batches(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, "-m", "gtx.cli", *ARGS, "--results", str(tmp_path / "one")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "gtx.cli",
            *ARGS,
            "--results",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("results: ") == 1  # rank 0 alone prints and writes
    a, b = (load(tmp_path / d).sort_values(["epoch", "split"]).reset_index(drop=True) for d in ("one", "two"))
    assert len(list((tmp_path / "two" / "runs").glob("*.csv"))) == 1
    # 60 examples in batches of 8: the last batch of 4 is split 2 + 2; losses and accuracies match step for step
    cols = ["epoch", "split", "loss", "token_acc", "seq_acc"]
    pd.testing.assert_frame_equal(a[cols], b[cols], rtol=1e-5)
    assert (a.split == "train").sum() == 2


def test_world_shards_and_merges():
    assert World(1, 3).shard(list(range(8))) == [1, 4, 7]
    parts = []
    for processed in (10, 30):
        p = PhaseStats(loss_sum=2.0, tokens=4, processed=processed, wall_s=processed / 10, peak_mem_mb=processed)
        p.edges["ee"] = [5, 2, 10]
        parts.append(p)
    merged = PhaseStats.merged(parts)
    assert merged.tokens == 8 and merged.processed == 40 and merged.wall_s == 3.0 and merged.edges["ee"] == [10, 4, 20]
    assert merged.row()["tokens_per_s"] == pytest.approx(40 / 3)  # the global figure: all tokens over the slowest rank


def test_a_sweep_runs_its_cells_data_parallel(tmp_path, cli):
    grid = ["sweep", "--seeds", "1", *sets(SETTINGS), "--nproc-per-node", "2", "--results", tmp_path, "--quiet"]
    dry = cli(*grid, "--dry-run")
    assert dry.output.startswith("torchrun --standalone --nproc-per-node 2 -m gtx.cli run --task copy"), dry.output
    result = cli(*grid)
    assert result.exit_code == 0, result.output
    df = load(tmp_path)
    assert df.run_id.nunique() == 1 and set(df.split) == {"train", "valid", "test"}  # one run, written by rank 0
    (log,) = (tmp_path / "sweeps").glob("*/logs/0.log")
    assert "-m torch.distributed.run --standalone --nproc-per-node 2 -m gtx.cli run" in log.read_text()
