"""Sweeps: the cross product of lists of run options, each cell an ordinary ``gtx run`` in its own process.

    grid = make_grid(task=["copy"], pattern=["full", "local:w=4"], seeds="0-2", settings={"epochs": ["4"]})
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
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gtx.errors import GtxError
from gtx.experiments import checkpoint, claims

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

AXES = ("task", "model", "pattern", "backend")
DEFAULTS = {"task": "copy", "model": "transformer", "pattern": "full", "backend": "auto", "seeds": "0"}
FILE_KEYS = {*AXES, "seeds", "set", "device", "results", "jobs"}
SEEDS_RE = re.compile(r"(\d+)(?:-(\d+))?\Z")
MAX_CELLS = 10_000  # a grid past this is a typo (--seeds 0-100000000), not a study: refused before it is expanded


def parse_seeds(text: str) -> list[int]:
    """``0-4`` (inclusive), ``0,2,5`` or a mix (``0-2,7``) -> seeds in order, duplicates dropped."""
    seeds: dict[int, None] = {}  # ordered, without duplicates
    for item in (s.strip() for s in str(text).split(",")):
        m = SEEDS_RE.match(item)
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            raise GtxError(f"--seeds {text}: {item!r} is not a seed or a range; write 0-4, 0,2,5 or 0-2,7")
        first, last = int(m[1]), int(m[2] or m[1])
        if len(seeds) + last - first + 1 > MAX_CELLS:
            raise GtxError(f"--seeds {text}: more than {MAX_CELLS:,} seeds; a sweep that large is split into several")
        seeds.update(dict.fromkeys(range(first, last + 1)))
    return list(seeds)


def split_list(text: str, what: str = "value") -> list[str]:
    """``a,b`` -> ``["a", "b"]``; an empty item (``1,,2``, ``1,``) is an error naming ``what``."""
    items = [v.strip() for v in text.split(",")]
    if not all(items):
        raise GtxError(f"{what} {text!r}: an empty item between commas; write a,b")
    return items


def split_patterns(text: str, names: Iterable[str]) -> list[str]:
    """Pattern specs from one ``--pattern``: a comma outside parentheses followed by a registered
    pattern name (not ``name=``) starts a new spec (``full,local:w=4``); other commas separate a
    pattern's parameters (``bigbird:b=2,r=1``) or sit inside ``heads(...)``."""
    names, specs, depth, start = set(names), [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            m = re.match(r"\s*([A-Za-z_][\w-]*)\s*(=?)", text[i + 1 :])
            if m and m[1] in names and not m[2]:
                specs.append(text[start:i].strip())
                start = i + 1
    return [*specs, text[start:].strip()]


@dataclass
class Grid:
    """The lists a sweep crosses; ``settings`` maps a ``--set`` key to its values (one value: a constant)."""

    task: list[str]
    model: list[str]
    pattern: list[str]
    backend: list[str]
    seeds: list[int]
    settings: dict[str, list[str]] = field(default_factory=dict)
    device: str = "auto"


def make_grid(
    seeds: str | None = None, settings: dict[str, list[str]] | None = None, device: str | None = None, **axes
) -> Grid:
    """A grid from lists (``task=[...]``, ...); a missing axis takes ``gtx run``'s default. Raises GtxError when empty."""
    lists = {a: list(axes[a]) if axes.get(a) is not None else [DEFAULTS[a]] for a in AXES}
    grid = Grid(
        **lists,
        seeds=parse_seeds(DEFAULTS["seeds"] if seeds is None else seeds),
        settings=dict(settings or {}),
        device=device or "auto",
    )
    for key, values in [*lists.items(), *grid.settings.items()]:
        if not values:
            raise GtxError(f"empty grid: {key} has no values")
    return grid


def _as_list(path: Path, key: str, value) -> list[str]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, (str, int, float)) for v in values):
        raise GtxError(f"{path}: {key} must be a value or a non-empty list of values, not {value!r}")
    return [str(v).lower() if isinstance(v, bool) else str(v) for v in values]


def _flat(table: dict, prefix: str = ""):
    """``[set]`` items with dotted keys: ``model.dim = 16`` is a nested table in TOML, a prefixed setting here."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def read_grid_file(path: str | Path) -> dict:
    """A TOML grid as ``make_grid`` keywords plus ``results``/``jobs`` where given; every error is one line naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise GtxError(f"{path}: cannot read the grid file ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise GtxError(f"{path}: not valid TOML: {e}") from None
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        raise GtxError(f"{path}: unknown key {unknown[0]!r}; a grid file has {', '.join(sorted(FILE_KEYS))}")
    out: dict = {a: _as_list(path, a, data[a]) for a in AXES if a in data}
    if "seeds" in data:
        out["seeds"] = ",".join(_as_list(path, "seeds", data["seeds"]))
        try:
            parse_seeds(out["seeds"])
        except GtxError as e:
            raise GtxError(f"{path}: {e}") from None
    if not isinstance(data.get("set", {}), dict):
        raise GtxError(f"{path}: set must be a table, [set] with key = value lines")
    out["settings"] = {k: _as_list(path, f"set.{k}", v) for k, v in _flat(data.get("set", {}))}
    checks = {
        "device": (lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda"),
        "results": (lambda v: isinstance(v, str), "a string"),
        "jobs": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
    }
    for key, (ok, what) in checks.items():
        if key in data:
            if not ok(data[key]):
                raise GtxError(f"{path}: {key} must be {what}, not {data[key]!r}")
            out[key] = data[key]
    return out


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
    from gtx.experiments.results import KEYED_SINCE, load

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
    from gtx.experiments.runner import RunConfig, cell_key
    from gtx.plugins.registry import BACKENDS

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
    (N runs each spinning every core's threads ran 30x slower on 2 cores)."""
    env = dict(os.environ if environ is None else environ)
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
    cell is claimed first (``gtx.experiments.claims``): one that another sweep holds is counted, not run."""
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
