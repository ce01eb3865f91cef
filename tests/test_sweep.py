"""gtx sweep: grid parsing, planning (skip, resume, restart), dry runs, bad input, and tiny sweeps end to end."""

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kit import TINY_COPY, TINY_MODEL, TINY_TRAIN, sets

from gtx.errors import GtxError
from gtx.records.results import COLUMNS, JSON_COLUMNS, SCHEMA_VERSION, load, write_run
from gtx.run.config import RunConfig, resolve_configs
from gtx.sweeps import grid as gr
from gtx.sweeps import sweep as sw

TINY = {**TINY_MODEL, **TINY_TRAIN, **TINY_COPY}  # --set values of a tiny sweep: a tiny model, copy, one epoch
SWEEP = [sys.executable, "-m", "gtx.cli", "sweep"]


def complete_files(results) -> dict[str, bytes]:
    df = load(results)
    done = set(df[df.split == "test"].run_id)
    return {p.name: p.read_bytes() for p in (Path(results) / "runs").glob("*.csv") if p.stem in done}


@pytest.mark.parametrize(
    "text, seeds",
    [("0-4", [0, 1, 2, 3, 4]), ("0,2,5", [0, 2, 5]), ("0-2,7", [0, 1, 2, 7]), ("3", [3]), ("1,1-2", [1, 2])],
)
def test_parse_seeds(text, seeds):
    assert gr.parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["5-2", "a-b", "", "1,,2", "-1", "0-"])
def test_parse_seeds_rejects(text):
    with pytest.raises(GtxError, match="not a seed or a range"):
        gr.parse_seeds(text)


def test_children_share_the_cores_unless_told():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert sw.child_env(2, {})["OMP_NUM_THREADS"] == str(max(1, cpus // 2))
    assert sw.child_env(64, {})["OMP_NUM_THREADS"] == "1"
    assert sw.child_env(2, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    # cells side by side do not warn of each other's load; one cell at a time looks
    assert sw.child_env(2, {})["GTX_BUSY_CHECK"] == "0" and "GTX_BUSY_CHECK" not in sw.child_env(1, {})
    assert sw.child_env(2, {"GTX_BUSY_CHECK": "1"})["GTX_BUSY_CHECK"] == "1"


def fake_run(results, run_id, cell, splits, started, eval_of=None, **kw):
    """A run file with the given splits, without training anything."""
    base = {
        c: 0 if t == "int64" else 0.0 if t == "float64" else None if t == "Int64" else "x" for c, t in COLUMNS.items()
    } | dict.fromkeys(JSON_COLUMNS, "{}")
    write_run(
        results,
        run_id,
        [
            {
                **base,
                "schema_version": SCHEMA_VERSION,
                "run_id": run_id,
                "started_at": started,
                "cell": cell,
                "eval_of": eval_of,
                "split": s,
                "epoch": 1,
                **kw,
            }
            for s in splits
        ],
    )


def checkpoint(results, run_id):
    path = sw.last_checkpoint(results, run_id)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")


def test_plan_skips_complete_cells_resumes_checkpointed_ones_restarts_the_rest(tmp_path):
    res = tmp_path / "res"
    grid = gr.make_grid(seeds="0-5")
    k = [c.key for c in sw.plan(grid, res)]
    assert len(set(k)) == 6
    fake_run(res, "a", k[0], ["train", "valid", "test"], "2026-01-01T00:00:00")  # complete: skip
    fake_run(res, "b", k[1], ["train", "valid"], "2026-01-01T00:00:00")  # incomplete, checkpoint: resume
    checkpoint(res, "b")
    fake_run(res, "c", k[2], ["train", "valid"], "2026-01-01T00:00:00")  # incomplete, no checkpoint: run afresh
    # complete once, then started again: skip
    fake_run(res, "d1", k[3], ["train", "valid", "test"], "2026-01-01T00:00:00")
    fake_run(res, "d2", k[3], ["train"], "2026-01-02T00:00:00")
    checkpoint(res, "d2")
    fake_run(res, "e1", k[4], ["train"], "2026-01-01T00:00:00")  # only the latest run is resumed: it has no checkpoint
    checkpoint(res, "e1")
    fake_run(res, "e2", k[4], ["train"], "2026-01-02T00:00:00")
    fake_run(res, "f", k[5], ["test"], "2026-01-01T00:00:00", eval_of="a")  # gtx eval rows do not complete a cell
    cells = sw.plan(grid, res)
    assert [(c.action, c.run_id) for c in cells] == [
        ("skip", None),
        ("resume", "b"),
        ("run", None),
        ("skip", None),
        ("run", None),
        ("run", None),
    ]
    assert sw.run_args(cells[1], res, ["plug"]) == [
        "run",
        "--resume",
        "b",
        "--results",
        str(res),
        "--plugins-dir",
        "plug",
        "--quiet",
    ]
    lines = sw.dry_run_lines(cells, res)
    assert len(lines) == 4 and lines[0] == f"gtx run --resume b --results {res} --quiet"
    assert "--seed 2" in lines[1] and "--seed 4" in lines[2] and "--seed 5" in lines[3]


def test_dry_run_prints_one_quoted_command_per_cell_and_writes_nothing(tmp_path, cli):
    res = tmp_path / "res"
    result = cli(
        "sweep",
        "--pattern",
        "full",
        "--pattern",
        "bigbird:b=2,r=1",
        "--pattern",
        "local|strided:l=4",
        "--task",
        "copy,reverse",
        "--seeds",
        "0-1",
        "--set",
        "epochs=1,2",
        "--dim",
        "16",
        "--results",
        res,
        "--dry-run",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 3 * 2 * 2 * 2
    argvs = [shlex.split(line) for line in lines]
    assert all(a[:2] == ["gtx", "run"] and a[-1] == "--quiet" and "dim=16" in a for a in argvs)
    assert {a[a.index("--pattern") + 1] for a in argvs} == {"full", "bigbird:b=2,r=1", "local|strided:l=4"}
    assert {a[a.index("--seed") + 1] for a in argvs} == {"0", "1"} and {a[a.index("--task") + 1] for a in argvs} == {
        "copy",
        "reverse",
    }
    assert "'local|strided:l=4'" in result.output  # shell-quoted
    assert not res.exists()
    # a spelling of one experiment twice (local is local:w=4) is one cell
    twice = cli("sweep", "--pattern", "local", "--pattern", "local:w=4", "--results", res, "--dry-run", "--quiet")
    assert len(twice.output.splitlines()) == 1


def test_every_task_and_model_is_a_cell_of_its_own(tmp_path, cli):
    res = tmp_path / "res"
    result = cli(
        "sweep",
        "--task",
        "copy,sort",
        "--model",
        "transformer,ut",
        "--pattern",
        "full",
        "--pattern",
        "local:w=4",
        "--seeds",
        "0-1",
        "--results",
        res,
        "--dry-run",
        "--quiet",
    )
    argvs = [shlex.split(line) for line in result.output.splitlines()]
    cells = {tuple(a[a.index(f"--{o}") + 1] for o in ("task", "model", "pattern", "seed")) for a in argvs}
    assert len(argvs) == 16 and len(cells) == 16  # copy and sort have equal settings: their names keep them apart


def test_a_finished_run_of_one_task_is_never_taken_for_another_and_old_files_are_rekeyed(tmp_path, cli):
    res = tmp_path / "res"
    grid = gr.make_grid(task=["copy", "sort"])
    copy, sort = sw.plan(grid, res)
    fake_run(res, "c", copy.key, ["train", "valid", "test"], "2026-01-01T00:00:00", task="copy")
    assert [c.action for c in sw.plan(grid, res)] == ["skip", "run"]
    # a schema-3 file stored a key that task names could collide in: its key is recomputed from its stored settings
    c = resolve_configs(RunConfig(task="sort"))
    stored = {"model_config": c.model, "task_config": c.task, "train": c.train}
    settings = json.dumps({key: dataclasses.asdict(part) for key, part in stored.items()})
    fake_run(
        res,
        "old",
        copy.key,
        ["train", "valid", "test"],
        "2026-01-01T00:00:00",
        schema_version=3,
        task="sort",
        model="transformer",
        pattern="full",
        backend="auto",
        seed=0,
        config=settings,
    )
    assert load(res).drop_duplicates("run_id").set_index("run_id").cell.to_dict() == {"c": copy.key, "old": sort.key}
    assert [(c.action, c.rekeyed) for c in sw.plan(grid, res)] == [("skip", False), ("skip", True)]
    said = cli("sweep", "--task", "copy,sort", "--results", res, "--dry-run")
    assert said.exit_code == 0 and "1 of the complete cells are runs written before results schema 4" in said.output
    # no settings stored
    fake_run(res, "old", copy.key, ["train", "valid", "test"], "2026-01-01T00:00:00", schema_version=3, config="{}")
    assert [c.action for c in sw.plan(grid, res)] == ["skip", "run"]


GRID = """\
task = "copy"
model = ["transformer"]
pattern = ["full", "bigbird:b=2,r=1"]
seeds = "0-1"
jobs = 2
results = "{res}"

[set]
epochs = [1, 2]
dim = 16
share_embeddings = true
train.warmup = 10
"""


def test_grid_file_with_options_overriding_its_keys(tmp_path, cli):
    path = tmp_path / "grid.toml"
    path.write_text(GRID.format(res=tmp_path / "res"))
    grid = gr.read_grid_file(path)
    assert grid["pattern"] == ["full", "bigbird:b=2,r=1"] and grid["seeds"] == "0-1" and grid["jobs"] == 2
    assert grid["settings"] == {
        "epochs": ["1", "2"],
        "dim": ["16"],
        "share_embeddings": ["true"],
        "train.warmup": ["10"],
    }
    lines = cli("sweep", path, "--dry-run", "--quiet").output.splitlines()
    assert len(lines) == 8 and all(
        f"--results {tmp_path / 'res'}" in line and "--set share_embeddings=true" in line for line in lines
    )
    lines = cli(
        "sweep", path, "--seeds", "3", "--set", "epochs=5", "--results", tmp_path / "other", "--dry-run", "--quiet"
    ).output.splitlines()
    assert len(lines) == 2 and all(
        "--seed 3" in line and "epochs=5" in line and "--set dim=16" in line and "other" in line for line in lines
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ('task = "copy"\npattern = [full]\n', "grid.toml: not valid TOML: Invalid value (at line 2"),
        ('patterns = ["full"]\n', "grid.toml: unknown key 'patterns'"),
        ("task = []\n", "grid.toml: task must be a value or a non-empty list"),
        ("jobs = 0\n", "grid.toml: jobs must be a positive integer"),
        ("set = 3\n", "grid.toml: set must be a table"),
        ('seeds = "2-1"\n', "grid.toml: --seeds 2-1: '2-1' is not a seed or a range"),
        ('device = "tpu"\n', "grid.toml: device must be auto, cpu or cuda"),
    ],
)
def test_bad_grid_file_is_one_line_naming_the_file(tmp_path, text, message, cli):
    (tmp_path / "grid.toml").write_text(text)
    result = cli("sweep", tmp_path / "grid.toml", "--results", tmp_path / "res")
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1, (
        result.output
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--pattern", "full", "--pattern", "lokal"],
            "cell task=copy model=transformer pattern=lokal backend=auto seed=0: unknown pattern 'lokal'",
        ),
        (["--task", "copy,nope"], "cell task=nope model=transformer pattern=full"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--backend", "auto,nope"], "unknown backend 'nope'"),
        (["--set", "nope=1,2"], "seed=0 nope=1: --set nope: no such setting"),
        (["--seeds", "5-2"], "--seeds 5-2: '5-2' is not a seed or a range"),
        (["--task", ","], "--task ',': an empty item between commas"),
        (["--set", "dim"], "write key=value"),
        (["--set", "epochs=1,,2"], "--set epochs= '1,,2': an empty item between commas"),
        (["--seeds", "0-100000000"], "--seeds 0-100000000: more than 10,000 seeds"),
        (
            ["--seeds", "0-999", "--set", "epochs=1,2,3,4,5,6,7,8,9,10,11"],
            "the grid has 11,000 cells, more than 10,000",
        ),
        (["--results", "/dev/null"], "--results /dev/null: cannot create the folder"),
    ],
)
def test_bad_input_fails_before_any_cell_runs(tmp_path, args, message, cli):
    res = tmp_path / "res"
    result = cli("sweep", "--results", res, *args)  # a later --results wins
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    # click's own: usage too
    assert (
        message in lines[-1] and lines[-1].startswith("Error: ") and (len(lines) == 1 or lines[0].startswith("Usage:"))
    )
    assert not res.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has the GPU the sweep asks for")
def test_a_sweep_on_a_device_this_machine_lacks_fails_before_any_cell_runs(tmp_path, cli):
    """Each cell failed on its own, one per seed, with exit status 2 in its log."""
    res = tmp_path / "res"
    result = cli("sweep", "--device", "cuda", "--seeds", "0-1", "--results", res)
    assert result.exit_code == 2 and result.output.strip() == (
        "Error: --device cuda: no CUDA GPU is visible to torch here; use --device cpu (or auto)"
    )
    assert not res.exists()


def test_a_comma_before_a_pattern_name_starts_a_new_pattern(cli):
    names = ["full", "local", "strided", "bigbird", "heads"]
    assert gr.split_patterns("full,local:w=4", names) == ["full", "local:w=4"]
    assert gr.split_patterns("bigbird:b=2,r=1", names) == ["bigbird:b=2,r=1"]
    assert gr.split_patterns("heads(local:w=2,strided:l=4),full", names) == ["heads(local:w=2,strided:l=4)", "full"]
    assert gr.split_patterns("local:w=2|strided:l=4, full", names) == ["local:w=2|strided:l=4", "full"]
    result = cli("sweep", "--pattern", "full,local:w=4", "--pattern", "bigbird:b=2,r=1", "--dry-run", "--quiet")
    assert [shlex.split(line)[shlex.split(line).index("--pattern") + 1] for line in result.output.splitlines()] == [
        "full",
        "local:w=4",
        "bigbird:b=2,r=1",
    ]


def test_a_cell_another_sweep_holds_is_not_run_twice_and_a_stale_claim_is_taken_over(tmp_path, cli):
    from gtx.records import claims
    from gtx.records.layout import ResultsFolder

    res = tmp_path / "res"
    args = [*sets(TINY), "--results", res]
    (cell,) = sw.plan(gr.make_grid(settings={k: [str(v)] for k, v in TINY.items()}), res)
    assert claims.claim(res, cell.key) is None  # held by this (living) process
    result = cli("sweep", *args)
    assert result.exit_code == 0 and "0 done, 0 skipped, 0 failed, 1 run by another sweep" in result.output, (
        result.output
    )
    assert not (res / "runs").exists() or not list((res / "runs").iterdir())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # its sweep was killed
    (ResultsFolder(res).claims() / cell.key).write_text(f"{dead.pid}@{__import__('socket').gethostname()}\n")
    result = cli("sweep", *args)
    assert (
        result.exit_code == 0 and "1 done" in result.output and not (ResultsFolder(res).claims() / cell.key).exists()
    ), result.output


def test_sweep_runs_every_cell_once_then_skips_them(tmp_path, cli):
    res = tmp_path / "res"
    args = [
        "--pattern",
        "full",
        "--pattern",
        "local:w=1",
        "--seeds",
        "0,1",
        *sets(TINY),
        "-j",
        "2",
        "--results",
        res,
    ]
    result = cli("sweep", *args)
    assert result.exit_code == 0, result.output
    assert "4 cells: 4 done, 0 skipped, 0 failed" in result.output
    assert "0/4 done, 2 running" in result.output  # a log's progress lines count the cells running (-j 2)
    df = load(res)
    test = df[df.split == "test"]
    assert len(test) == 4 and test.cell.nunique() == 4 and df.run_id.nunique() == 4
    assert set(zip(test.pattern, test.seed)) == {("full", 0), ("full", 1), ("local:w=1", 0), ("local:w=1", 1)}
    logs = sorted(p.name for p in (res / "sweeps").glob("grid-*/logs/*.log"))
    assert logs == ["0.log", "1.log", "2.log", "3.log"]
    before = {p: p.read_bytes() for p in (res / "runs").iterdir()}
    again = cli("sweep", *args)
    assert again.exit_code == 0 and "4 cells: 0 done, 4 skipped, 0 failed" in again.output, again.output
    assert {p: p.read_bytes() for p in (res / "runs").iterdir()} == before
    assert cli("sweep", *args, "--dry-run", "--quiet").output == ""


def test_a_failing_cell_is_reported_and_the_others_complete(tmp_path, cli):
    res = tmp_path / "res"
    # heads=3 passes planning (the settings parse) but the model rejects dim 16 at run time
    result = cli("sweep", *sets({**TINY, "heads": "2,3"}), "-j", "2", "--results", res)
    assert result.exit_code == 1, result.output
    log = next((res / "sweeps").glob("grid-*/logs/1.log"))
    assert (
        f"cell 1 (task=copy model=transformer pattern=full backend=auto seed=0 heads=3) failed with exit status 2: "
        f"Error: bad settings for model 'transformer': d_model=16 must be divisible by heads=3; log: {log}"
    ) in result.output
    assert "2 cells: 1 done, 0 skipped, 1 failed" in result.output
    df = load(res)
    assert (df.split == "test").sum() == 1 and df.run_id.nunique() == 1


def test_killed_sweep_finishes_when_run_again_without_losing_or_repeating_a_run(tmp_path, cli):
    res = tmp_path / "res"
    args = ["--seeds", "0-2", *sets({**TINY, "epochs": 30}), "-j", "1", "--results", str(res), "--quiet"]
    proc = subprocess.Popen(
        [*SWEEP, *args], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # generous: a loaded machine takes minutes for a first run; the loop leaves as soon as one is done
        deadline, first_done = (
            time.monotonic() + 600,
            None,
        )
        while time.monotonic() < deadline and proc.poll() is None:
            files = list((res / "runs").glob("*.csv"))
            done = complete_files(res) if files else {}
            if done and first_done is None:
                first_done = time.monotonic()
            # kill in the middle of a later run if we catch one, else soon after the first completes
            if done and (len(files) > len(done) or time.monotonic() - first_done > 15):
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    complete = complete_files(res)
    assert 1 <= len(complete) < 3
    earlier = {run_id: set(zip(rows.epoch, rows.split)) for run_id, rows in load(res).groupby("run_id")}

    result = cli("sweep", *args)
    assert result.exit_code == 0, result.output
    assert f"3 cells: {3 - len(complete)} done, {len(complete)} skipped, 0 failed" in result.output
    df = load(res)
    test = df[df.split == "test"]
    assert len(test) == 3 and test.cell.nunique() == 3 and set(test.seed) == {0, 1, 2}  # one complete run per cell
    assert {name: data for name, data in complete_files(res).items() if name in complete} == complete  # byte for byte
    after = {run_id: set(zip(rows.epoch, rows.split)) for run_id, rows in df.groupby("run_id")}
    # a killed run's rows stay (resumed: kept in its file)
    assert all(rows <= after[run_id] for run_id, rows in earlier.items())


@pytest.mark.parametrize(
    "args, message",
    [
        (["sweep", *sets(TINY)], "with 0 of the 1 cells of sweep grid-"),
        (
            [
                "frontier",
                "--task",
                "recall",
                "--model",
                "lm",
                "--family",
                "local:w=4,8",
                "--lengths",
                "64",
                *sets({**TINY, "mean_len": None}),  # recall has no mean_len
            ],
            "with 0 of the 3 cells of sweep grid-",
        ),
    ],
)
def test_ctrl_c_exits_130_in_one_line_saying_how_to_finish(tmp_path, monkeypatch, args, message, cli):
    """As gtx run does (exit 130, the shell's code for SIGINT), not click's "Aborted!" and exit 1."""

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(sw, "execute", interrupted)
    result = cli(*args, "--results", tmp_path, "--quiet")
    assert result.exit_code == 130, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("Error: interrupted (Ctrl-C)") and message in result.output
    assert "run the same command again to finish" in result.output


def test_ctrl_c_in_any_command_exits_130_in_one_line(tmp_path, monkeypatch, cli):
    from gtx.records import results

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(results, "load", interrupted)
    result = cli("runs", "--results", tmp_path)
    assert result.exit_code == 130 and result.output.strip() == "Error: gtx runs interrupted (Ctrl-C)", result.output


def test_a_sweeps_cells_keep_their_logs_where_the_layout_says_and_refuse_submitit_options_run_here(tmp_path):
    """``SweepCells``: the local launcher's logs under ``sweeps/<name>/logs``, submitit's under
    ``sweeps/<name>/submitit``; --executor-opt without --launcher submitit is one line, before anything runs."""
    from gtx.records.layout import ResultsFolder
    from gtx.sweeps.launch import SweepCells

    here, jobs = SweepCells("g", [], tmp_path), SweepCells("g", [], tmp_path, launcher="submitit")
    assert here.log_dir() == ResultsFolder(tmp_path).sweep_logs("g") == tmp_path / "sweeps" / "g" / "logs"
    assert jobs.log_dir() == ResultsFolder(tmp_path).sweep_jobs("g")
    with pytest.raises(GtxError, match="--executor-opt is for --launcher submitit"):
        SweepCells("g", [], tmp_path, executor_opts=("timeout_min=5",))
    with pytest.raises(GtxError, match="--launcher slurm: choose local or submitit"):
        SweepCells("g", [], tmp_path, launcher="slurm")
    assert not (tmp_path / "sweeps").exists()
