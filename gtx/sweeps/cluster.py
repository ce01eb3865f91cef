"""Sweep cells as cluster jobs through submitit: Slurm, or its local executor (real processes, no Slurm).

    executor = make_executor(Path("results/sweeps/NAME/submitit"), {"cluster": "slurm", "slurm_partition": "dev", "timeout_min": 60})
    failures = submit(cells, counts, executor, "results")

Each cell is one job running ``gtx run`` in a child process. The job decides what to do when it
starts, not when it was submitted: skip a cell already complete, resume its latest run from the
checkpoint, or run it afresh, so a job requeued after preemption or a time-out (submitit's
``checkpoint``: the child is stopped, the job resubmitted) continues from the last epoch it saved.
The sweep's claims (``gtx.records.claims``) are not used here: the scheduler runs each job once,
and a claim left by a node that died would block its requeued job on another.
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from gtx.errors import GtxError
from gtx.files import writable_dir
from gtx.sweeps.sweep import (
    Cell,
    Counts,
    Failure,
    as_results_stand,
    cell_states,
    child_env,
    last_line,
    launcher_argv,
    run_args,
)

INSTALL = "pip install 'gtx[cluster]' (or pip install submitit)"


def _submitit():
    try:
        import submitit
    except ModuleNotFoundError:
        raise GtxError(f"--launcher submitit needs the submitit package; install it: {INSTALL}") from None
    return submitit


def executor_options(items: Iterable[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings as submitit parameters: integers, floats and true/false parsed, the rest text."""
    out: dict[str, object] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise GtxError(
                f"--executor-opt {item!r}: write key=value, e.g. --executor-opt slurm_partition=dev or timeout_min=60"
            )
        raw = raw.strip()
        value: object = raw
        for typ in (int, float):
            try:
                value = typ(raw)
                break
            except ValueError:
                continue
        out[key.strip()] = {"true": True, "false": False}.get(raw.lower(), value)
    return out


def make_executor(folder: Path, options: dict[str, object]):
    """submitit's AutoExecutor in ``folder`` (``options["cluster"]``: slurm, local or debug; default:
    slurm where there is one, else local), its other options checked by submitit: one GtxError line.
    submitit makes its folder at once, so the options are tried in a temporary folder first: refused
    ones leave nothing under ``folder``, which is then made (``writable_dir``)."""
    submitit = _submitit()
    options = dict(options)
    cluster = options.pop("cluster", None)

    def executor(where: Path):
        try:
            made = submitit.AutoExecutor(folder=where, cluster=cluster)
            made.update_parameters(**options)
        except (NameError, ValueError, TypeError, AssertionError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GtxError(
                f"--executor-opt: submitit refused the options {options or {'cluster': cluster}}: {first}"
            ) from None
        return made

    with tempfile.TemporaryDirectory() as scratch:
        executor(Path(scratch))
    return executor(writable_dir(folder, "submitit folder"))


class CellJob:
    """One cell as a submitit job: ``job()`` runs (or resumes, or skips) the cell and returns the
    ``gtx run`` exit status, raising on a failure so that the job fails; ``checkpoint()`` (called by
    submitit on preemption or time-out) stops the child and resubmits the job, which resumes."""

    def __init__(self, cell: Cell, results_dir: str | Path, plugins_dirs: Iterable[str | Path] = (), nproc: int = 1):
        self.cell, self.results_dir, self.plugins_dirs, self.nproc = (
            cell,
            str(results_dir),
            [str(d) for d in plugins_dirs],
            nproc,
        )
        self._child: subprocess.Popen | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_child": None}  # a process does not travel with the job

    def __call__(self) -> int:
        # as they stand now, requeued or not
        cell = as_results_stand(self.cell, cell_states(self.results_dir), self.results_dir)
        if cell.action == "skip":
            return 0
        argv = [*launcher_argv(self.nproc), *run_args(cell, self.results_dir, self.plugins_dirs)]
        print(f"==> {' '.join(argv)}", flush=True)
        # one log: the job's stdout
        self._child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=child_env(self.nproc)
        )
        while (
            code := self._child.poll()
        ) is None:  # not wait(): it holds a lock that checkpoint()'s poll, in a signal handler, would need
            time.sleep(0.2)
        if code:
            raise RuntimeError(f"gtx run exited with status {code}")
        return code

    def checkpoint(self):
        if self._child is not None and self._child.poll() is None:
            # its last epoch's checkpoint is on disk: the requeued job resumes from it
            self._child.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while self._child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._child.poll() is None:
                self._child.kill()
        return _submitit().helpers.DelayedSubmission(self)


def submit(
    cells: list[Cell],
    counts: Counts,
    executor,
    results_dir: str | Path,
    plugins_dirs: Iterable[str | Path] = (),
    on_change: Callable[[Counts], None] = lambda c: None,
    on_failure: Callable[[Failure], None] = lambda f: None,
    poll_s: float = 0.5,
    nproc: int = 1,
) -> list[Failure]:
    """Submit every cell not marked skip as one job (``nproc`` > 1: a torchrun of that many processes
    inside it), then wait for them all (as ``sweep.execute``)."""
    queue = [c for c in cells if c.action != "skip"]
    jobs = [(cell, executor.submit(CellJob(cell, results_dir, plugins_dirs, nproc))) for cell in queue]
    counts.running = len(jobs)
    on_change(counts)
    failures: list[Failure] = []
    pending = list(jobs)
    try:
        while pending:
            time.sleep(poll_s)
            for item in [j for j in pending if j[1].done()]:
                pending.remove(item)
                cell, job = item
                counts.running -= 1
                if job.exception() is None:
                    counts.done += 1
                else:
                    counts.failed += 1
                    log = Path(job.paths.stdout)
                    failures.append(Failure(cell, 1, log, last_line(log, 0) if log.is_file() else "(no output)"))
                    on_failure(failures[-1])
                on_change(counts)
    finally:  # interrupted (Ctrl-C): the scheduler would run them on; cancel what is still queued or running
        for _, job in pending:
            job.cancel(check=False)
    return failures
