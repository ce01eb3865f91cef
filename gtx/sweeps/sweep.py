"""Sweeps: the cross product of lists of run options, each cell an ordinary ``gtx run`` in its own process.

    grid = make_grid(task=["copy"], pattern=["full", "local:w=4"], seeds="0-2", settings={"epochs": ["4"]})  # .grid
    cells = plan(grid, "results")                 # checked and keyed; complete cells marked skip
    counts = Counts(sweep_name(None, cells), len(cells), sum(c.action == "skip" for c in cells))
    failures = execute(cells, counts, Path("results/sweeps/NAME/logs"), "results", jobs=2)

Resumable by construction: a cell's identity is ``runner.cell_key`` (the results' ``cell`` column). A cell
with a complete run (a ``test`` row) is skipped; one whose latest run is incomplete but left
``<results>/checkpoints/<run_id>/last.pt`` is continued with ``gtx run --resume``; any other runs afresh.
The sweep never writes a results row itself. Knows nothing of click.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from gtx.errors import GtxError
from gtx.records import checkpoint, claims
from gtx.sweeps.grid import MAX_CELLS, Grid


@dataclass
class Cell:
    """One run of the grid: ``action`` is ``skip`` (a complete run exists), ``resume`` (``run_id``) or ``run``;
    ``rekeyed``: skipped for a run written before schema 4, matched by the key recomputed from its settings."""

    index: int
    config: object  # runner.RunConfig
    key: str
    label: str
    action: str = "run"
    run_id: str | None = None
    rekeyed: bool = False


def _label(config, swept: Iterable[str]) -> str:
    settings = " ".join(f"{k}={config.settings[k]}" for k in swept)
    return f"task={config.task} model={config.model} pattern={config.pattern} backend={config.backend} seed={config.seed} {settings}".strip()


def cell_states(results_dir: str | Path) -> dict[str, tuple[bool, str, bool]]:
    """cell key -> (has a complete run, run id of its latest run, its complete runs predate schema 4),
    from the training rows under ``results_dir`` (``results.load`` recomputes the older files' keys)."""
    from gtx.records.results import KEYED_SINCE, load

    df = load(results_dir)
    df = df[df.eval_of.isna() & df.cell.notna()]
    states = {}
    for cell, rows in df.groupby("cell", sort=False):
        latest = rows.sort_values(["started_at", "run_id"]).run_id.iloc[-1]
        complete = rows[rows.run_id.isin(rows.run_id[rows.split == "test"])]
        states[cell] = (
            len(complete) > 0,
            latest,
            len(complete) > 0 and bool((complete.schema_version < KEYED_SINCE).all()),
        )
    return states


def last_checkpoint(results_dir: str | Path, run_id: str) -> Path:
    return checkpoint.checkpoint_dir(results_dir, run_id) / checkpoint.LAST


def plan(grid: Grid, results_dir: str | Path) -> list[Cell]:
    """Every distinct cell, checked and keyed (seed varies slowest, so an interrupted sweep leaves whole seeds);
    raises GtxError naming the first bad cell before anything runs."""
    from gtx.plugins.registry import BACKENDS
    from gtx.run.runner import RunConfig, cell_key

    for name in grid.backend:
        BACKENDS.get(name)  # cell_key does not look at the backend; availability is the run's business
    size = math.prod(
        len(v) for v in (grid.seeds, grid.task, grid.model, grid.pattern, grid.backend, *grid.settings.values())
    )
    if size > MAX_CELLS:
        raise GtxError(f"the grid has {size:,} cells, more than {MAX_CELLS:,}; split the sweep into several")
    swept = [k for k, v in grid.settings.items() if len(v) > 1]
    cells: list[Cell] = []
    seen: set[str] = set()
    for seed, task, model, pattern, backend, *values in itertools.product(
        grid.seeds, grid.task, grid.model, grid.pattern, grid.backend, *grid.settings.values()
    ):
        config = RunConfig(
            task=task,
            model=model,
            pattern=pattern,
            backend=backend,
            device=grid.device,
            seed=seed,
            results_dir=str(results_dir),
            settings=dict(zip(grid.settings, values)),
        )
        label = _label(config, swept)
        try:
            key = cell_key(config)
        except GtxError as e:
            raise GtxError(f"cell {label}: {e}") from None
        if key not in seen:  # two spellings of one experiment (local, local:w=4) run once
            seen.add(key)
            cells.append(Cell(len(cells), config, key, label))
    states = cell_states(results_dir)
    return [as_results_stand(cell, states, results_dir) for cell in cells]


def as_results_stand(cell: Cell, states: dict[str, tuple[bool, str, bool]], results_dir: str | Path) -> Cell:
    """``cell`` with the action the results call for (``states``: ``cell_states``): ``skip`` a complete
    cell, ``resume`` its latest run where that run left a checkpoint, else ``run``."""
    complete, latest, rekeyed = states.get(cell.key, (False, None, False))
    resume = not complete and latest is not None and last_checkpoint(results_dir, latest).is_file()
    return replace(
        cell,
        action="skip" if complete else "resume" if resume else "run",
        run_id=latest if resume else None,
        rekeyed=rekeyed,
    )


def run_args(cell: Cell, results_dir: str | Path, plugins_dirs: Iterable[str | Path] = ()) -> list[str]:
    """The ``gtx run`` arguments (after the program) that run, or resume, one cell."""
    c = cell.config
    if cell.action == "resume":
        args = ["run", "--resume", cell.run_id, "--results", str(results_dir)]
    else:
        args = [
            "run",
            "--task",
            c.task,
            "--model",
            c.model,
            "--pattern",
            c.pattern,
            "--backend",
            c.backend,
            "--seed",
            str(c.seed),
        ]
        args += ["--device", c.device] if c.device != "auto" else []
        args += ["--results", str(results_dir), *(a for k, v in c.settings.items() for a in ("--set", f"{k}={v}"))]
    return [*args, *(a for d in plugins_dirs for a in ("--plugins-dir", str(d))), "--quiet"]


def launcher_argv(nproc: int = 1, program: str | None = None) -> list[str]:
    """What starts ``gtx`` for a cell: the Python running this (``program``: that command instead),
    or torchrun with ``nproc`` processes of one data-parallel run (rank 0 writes)."""
    if nproc == 1:
        return [program] if program else [sys.executable, "-m", "gtx.cli"]
    torchrun = ["torchrun"] if program else [sys.executable, "-m", "torch.distributed.run"]
    return [*torchrun, "--standalone", "--nproc-per-node", str(nproc), "-m", "gtx.cli"]


def dry_run_lines(
    cells: list[Cell], results_dir: str | Path, plugins_dirs: Iterable[str | Path] = (), nproc: int = 1
) -> list[str]:
    """One shell command per cell still to run, for any scheduler sharing the results folder."""
    return [
        shlex.join([*launcher_argv(nproc, "gtx"), *run_args(c, results_dir, plugins_dirs)])
        for c in cells
        if c.action != "skip"
    ]


def sweep_name(grid_file: str | Path | None, cells: list[Cell]) -> str:
    """The grid file's stem, else a hash of the cells: the same grid keeps its logs in one folder."""
    if grid_file:
        return Path(grid_file).stem
    return "grid-" + hashlib.sha1(" ".join(sorted(c.key for c in cells)).encode()).hexdigest()[:8]


def child_env(jobs: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The children's environment: the cores shared out as OpenMP threads unless the user chose
    (N runs each spinning every core's threads ran 30x slower on 2 cores); with more than one job,
    the cells do not look at the machine's load (``GTX_BUSY_CHECK=0``): their siblings keep the cores
    busy by design, and the cores are shared out for it."""
    env = dict(os.environ if environ is None else environ)
    if jobs > 1:
        env.setdefault("GTX_BUSY_CHECK", "0")
    if "OMP_NUM_THREADS" not in env:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cpus // jobs))
    return env


@dataclass
class Counts:
    name: str
    total: int
    skipped: int
    done: int = 0
    running: int = 0
    failed: int = 0
    elsewhere: int = 0  # cells another sweep on the same results folder had claimed

    def line(self) -> str:
        other = f", {self.elsewhere} run by another sweep" if self.elsewhere else ""
        return (
            f"sweep {self.name}: {self.done}/{self.total - self.skipped} done, {self.running} running, "
            f"{self.failed} failed, {self.skipped} skipped{other}"
        )


@dataclass
class Failure:
    cell: Cell
    returncode: int
    log: Path
    message: str  # the log's last line: gtx's one-line error, or a traceback's last line


def last_line(log: Path, offset: int) -> str:
    with open(log, "rb") as f:
        f.seek(offset)
        lines = [s for s in f.read().decode(errors="replace").splitlines() if s.strip()]
    return lines[-1].strip() if lines else "(no output)"


def execute(
    cells: list[Cell],
    counts: Counts,
    log_dir: Path,
    results_dir: str | Path,
    jobs: int = 1,
    plugins_dirs: Iterable[str | Path] = (),
    on_change: Callable[[Counts], None] = lambda c: None,
    on_failure: Callable[[Failure], None] = lambda f: None,
    poll_s: float = 0.1,
    nproc: int = 1,
) -> list[Failure]:
    """Run the cells not marked skip, ``jobs`` at a time, each as ``python -m gtx.cli run ...`` (under
    torchrun with ``nproc`` processes when ``nproc`` > 1) with its
    output appended to ``log_dir/<index>.log``; a failing cell is reported and the others go on. A
    cell is claimed first (``gtx.records.claims``): one that another sweep holds is counted, not run."""
    queue = [c for c in cells if c.action != "skip"]
    env = child_env(jobs * nproc)
    log_dir.mkdir(parents=True, exist_ok=True)
    running: list[tuple[Cell, subprocess.Popen, Path, int]] = []
    failures: list[Failure] = []
    try:
        while queue or running:
            while queue and len(running) < jobs:
                cell = queue.pop(0)
                # another sweep runs it: its run lands in the same folder
                if claims.claim(results_dir, cell.key) is not None:
                    counts.elsewhere += 1
                    on_change(counts)
                    continue
                argv = [*launcher_argv(nproc), *run_args(cell, results_dir, plugins_dirs)]
                log = log_dir / f"{cell.index}.log"
                with open(log, "a") as f:  # appended: an earlier attempt's output stays readable
                    blank = "\n" if f.tell() else ""  # a blank line between attempts
                    f.write(f"{blank}==> {dt.datetime.now().isoformat(timespec='seconds')} {shlex.join(argv)}\n")
                    f.flush()
                    offset = f.tell()  # before the child shares the file: where this attempt's output starts
                    proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
                running.append((cell, proc, log, offset))
                counts.running += 1
                on_change(counts)
            time.sleep(poll_s)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                cell, proc, log, offset = item
                claims.release(results_dir, cell.key)
                counts.running -= 1
                if proc.returncode == 0:
                    counts.done += 1
                else:
                    counts.failed += 1
                    failures.append(Failure(cell, proc.returncode, log, last_line(log, offset)))
                    on_failure(failures[-1])
                on_change(counts)
    finally:  # interrupted (Ctrl-C): stop the children rather than orphan them
        for _, proc, _, _ in running:
            proc.terminate()
        for cell, proc, _, _ in running:
            proc.wait()
            claims.release(results_dir, cell.key)
    return failures
