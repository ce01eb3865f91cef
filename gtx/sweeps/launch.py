"""How a sweep's cells run: here, ``jobs`` at a time (``sweep.execute``), or one cluster job each
through submitit (``cluster.submit``), with each launcher's logs where the results folder's layout
puts them (``ResultsFolder.sweep_logs``, ``sweep_jobs``).

    cells = SweepCells(sweep_name(None, planned), planned, "results", jobs=2)
    failures = cells.run(cells.counts(), on_change, on_failure)

Knows nothing of click: ``gtx sweep`` and ``gtx frontier`` build one ``SweepCells`` and hand it on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gtx.errors import GtxError
from gtx.files import writable_dir
from gtx.records.layout import ResultsFolder
from gtx.run.config import resolve_device
from gtx.sweeps import sweep as sw

LAUNCHERS = ("local", "submitit")


@dataclass(frozen=True)
class SweepCells:
    """A sweep's cells and how they run: ``jobs`` at once here (``local``), or one submitit job each
    (``submitit``, ``executor_opts`` its ``KEY=VALUE`` options); ``nproc`` processes per cell (above
    1, a torchrun of one data-parallel run); ``plugins_dirs`` loaded by every run."""

    name: str
    cells: list[sw.Cell]
    results_dir: str | Path
    jobs: int = 1
    launcher: str = "local"
    executor_opts: tuple[str, ...] = ()
    nproc: int = 1
    plugins_dirs: tuple[str | Path, ...] = field(default=())

    def __post_init__(self):
        if self.launcher not in LAUNCHERS:
            raise GtxError(f"--launcher {self.launcher}: choose {' or '.join(LAUNCHERS)}")
        if self.executor_opts and self.launcher != "submitit":
            raise GtxError("--executor-opt is for --launcher submitit; with the local launcher use -j N")

    def counts(self) -> sw.Counts:
        return sw.Counts(self.name, len(self.cells), sum(c.action == "skip" for c in self.cells))

    def rekeyed(self) -> int:
        """The complete cells matched by keys recomputed from settings written before results schema 4."""
        return sum(c.rekeyed for c in self.cells)

    def dry_run_lines(self) -> list[str]:
        """One shell command per cell still to run (``sweep.dry_run_lines``)."""
        return sw.dry_run_lines(self.cells, self.results_dir, self.plugins_dirs, self.nproc)

    def log_dir(self) -> Path:
        """Where the launcher keeps the cells' output: a log per cell, or submitit's job files."""
        folder = ResultsFolder(self.results_dir)
        return folder.sweep_jobs(self.name) if self.launcher == "submitit" else folder.sweep_logs(self.name)

    def run(
        self,
        counts: sw.Counts,
        on_change: Callable[[sw.Counts], None] = lambda c: None,
        on_failure: Callable[[sw.Failure], None] = lambda f: None,
    ) -> list[sw.Failure]:
        """Run the cells not marked skip; the failures. What would stop every cell is refused before
        the first starts: submitit's options (before its folder is made), or here the devices the
        cells name and the log folder."""
        if self.launcher == "submitit":
            from gtx.sweeps import cluster

            executor = cluster.make_executor(self.log_dir(), cluster.executor_options(self.executor_opts))
            on_change(counts)
            return cluster.submit(
                self.cells,
                counts,
                executor,
                self.results_dir,
                self.plugins_dirs,
                on_change,
                on_failure,
                nproc=self.nproc,
            )
        for device in sorted({c.config.device for c in self.cells if c.action != "skip"}):
            resolve_device(device)  # here, where the cells run
        writable_dir(self.results_dir)
        log_dir = writable_dir(self.log_dir(), "sweep log folder")
        on_change(counts)
        return sw.execute(
            self.cells,
            counts,
            log_dir,
            self.results_dir,
            self.jobs,
            self.plugins_dirs,
            on_change,
            on_failure,
            nproc=self.nproc,
        )
