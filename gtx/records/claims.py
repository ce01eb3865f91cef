"""One process at a time: before a sweep starts a cell it claims it with a file under
``<results>/sweeps/claims/<cell key>``, and a run (new or resumed) claims its checkpoint folder
(``<results>/checkpoints/<run_id>/lock``), each created exclusively (``O_EXCL``), so two sweeps
sharing a results folder never run one cell twice, and a run is never trained by two processes at
once. The file names the claiming process; a claim whose process has ended on this machine is
stale and taken over, one from another machine is left alone."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gtx.errors import GtxError
from gtx.records.layout import ResultsFolder

LOCK = "lock"  # in a run's checkpoint folder while a process trains it: pid@host


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def holder(path: Path) -> str | None:
    """Who holds the claim ``path`` (``pid@host``), or None when it is free or stale."""
    try:
        pid, _, host = path.read_text().strip().partition("@")
    except OSError:
        return None
    if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
        return None
    return f"{pid}@{host}"


def claim(results_dir: str | Path, key: str) -> str | None:
    """Claim cell ``key`` for this process: None when claimed, else who holds it."""
    return claim_file(ResultsFolder(results_dir).claims() / key)


def claim_file(path: Path) -> str | None:
    """Create the claim ``path`` for this process (its folder too): None when claimed, else who
    holds it (``holder``); a stale one is taken over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):  # a stale claim is removed once, then claimed afresh
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            who = holder(path)
            if who is not None:
                return who
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}@{socket.gethostname()}\n")
        return None
    return holder(path) or "another process"


def release(results_dir: str | Path, key: str) -> None:
    (ResultsFolder(results_dir).claims() / key).unlink(missing_ok=True)


@contextmanager
def run_lock(folder: Path, run_id: str, results_dir: Path) -> Iterator[None]:
    """Hold run ``run_id``'s lock (``folder / LOCK``, its checkpoint folder) while it trains: a second
    process training it (``gtx run --resume`` while the run, or another resume, goes on) is one line;
    a lock whose process has ended (killed) is taken over."""
    path = folder / LOCK
    made = not folder.exists()
    try:
        who = claim_file(path)
    except OSError as e:
        raise GtxError(f"run {run_id}: cannot write its lock {path} ({e.strerror or e}); check that folder") from None
    if who is not None:
        raise GtxError(
            f"run {run_id} is being trained by process {who} (its lock {path}); wait for that process to end, or "
            f"stop it, then continue with: gtx run --resume {run_id} --results {results_dir}"
        )
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        if made and not any(folder.iterdir()):  # a run that wrote no checkpoint (--epochs 0) leaves no folder
            folder.rmdir()
