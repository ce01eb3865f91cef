"""--launcher submitit: options, a missing install, the same frontier as the local launcher, and a preempted cell resuming."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from kit import TINY_MODEL, TINY_TRAIN
from test_frontier import RECALL, TINY_RECALL, science

from gtx.errors import GtxError
from gtx.records.results import load
from gtx.sweeps import cluster
from gtx.sweeps import grid as gr
from gtx.sweeps import sweep as sw

submitit = pytest.importorskip("submitit")  # the test extra installs it; CI always runs these


def test_executor_options_parse_numbers_and_flags():
    assert cluster.executor_options(
        ["timeout_min=60", "mem_gb=1.5", "slurm_partition=dev", "stderr_to_stdout=true"]
    ) == {"timeout_min": 60, "mem_gb": 1.5, "slurm_partition": "dev", "stderr_to_stdout": True}
    with pytest.raises(GtxError, match="write key=value"):
        cluster.executor_options(["timeout_min"])


def test_without_submitit_one_line_says_how_to_install(monkeypatch, tmp_path, cli):
    monkeypatch.setitem(sys.modules, "submitit", None)  # import submitit now raises ModuleNotFoundError
    result = cli("sweep", "--task", "copy", "--epochs", "1", "--launcher", "submitit", "--results", tmp_path / "r")
    assert (
        result.exit_code == 2
        and "pip install 'gtx[cluster]'" in result.output
        and len(result.output.strip().splitlines()) == 1
    )
    assert not (tmp_path / "r" / "runs").exists()


@pytest.mark.parametrize(
    "opt, match",
    [
        ("bogus=1", "need to be prefixed by an executor name"),
        ("timeout_min=soon", "timeout_min"),
        ("cluster=nowhere", "nowhere"),
    ],
)
def test_refused_executor_options_start_nothing(tmp_path, opt, match, cli):
    submitit = ["--launcher", "submitit", "--executor-opt", "cluster=local", "--executor-opt", opt]
    result = cli("sweep", "--task", "copy", "--epochs", "1", *submitit, "--results", tmp_path / "r")
    assert result.exit_code == 2 and match in result.output and len(result.output.strip().splitlines()) == 1, (
        result.output
    )
    assert not (tmp_path / "r").exists()  # not even the empty sweeps/<name>/submitit/ folder


def test_a_submitit_frontier_gives_the_local_frontiers_table(tmp_path, cli):
    study = [
        *RECALL,
        "--family",
        "local:w=4",
        "--lengths",
        "16,32",
        "--seeds",
        "0",
        "--quiet",
    ]  # 2 patterns x 2 lengths
    local = cli("frontier", *study, "-j", "2", "--results", tmp_path / "local")
    submitit = ["--launcher", "submitit", "--executor-opt", "cluster=local", "--executor-opt", "timeout_min=10"]
    jobs = cli("frontier", *study, *submitit, "--results", tmp_path / "jobs")
    assert local.exit_code == 0 and jobs.exit_code == 0, local.output + jobs.output
    assert "4 cells: 4 done" in jobs.output and list((tmp_path / "jobs" / "sweeps").glob("*/submitit/*_log.out"))
    tables = [science(r.output.split("sweep ")[-1].split("\n", 1)[1]) for r in (local, jobs)]
    assert len(tables[0]) == 5 and tables[0] == tables[1]  # a header and 4 rows


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_preempted_cell_is_requeued_and_resumes_from_its_checkpoint(tmp_path):
    res = tmp_path / "res"
    sizes = {"epochs": 20, "n_train": 400, "n_valid": 8, "n_test": 8, "seq_len": 32}
    settings = {**TINY_MODEL, **TINY_TRAIN, **TINY_RECALL, **sizes}
    grid = gr.make_grid(task=["recall"], model=["lm"], settings={k: [str(v)] for k, v in settings.items()})
    (cell,) = sw.plan(grid, res)
    executor = cluster.make_executor(tmp_path / "jobs", {"cluster": "local", "timeout_min": 10})
    job = executor.submit(cluster.CellJob(cell, res))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((res / "checkpoints").glob("*/last.pt")):
        time.sleep(0.1)
    time.sleep(0.5)  # into a later epoch: the checkpoint is behind the run
    # the job's task (its controller's child) gets Slurm's preemption signal, USR2
    for task in children(job._process.pid):
        os.kill(task, signal.SIGUSR2)  # submitit calls CellJob.checkpoint and requeues the job
    assert job.result() == 0
    df = load(res)
    assert df.run_id.nunique() == 1 and (df.split == "test").sum() == 1  # one run, finished once
    train = df[df.split == "train"]
    assert sorted(train.epoch) == list(range(1, 21))  # every epoch once: resumed, not restarted
    logs = "\n".join(p.read_text() for p in (tmp_path / "jobs").glob("*_log.*"))
    assert "Requeued" in logs and "run --resume" in logs
