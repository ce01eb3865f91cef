"""One sweep at a time per cell: before a sweep starts a cell it claims it with a file under
``<results>/sweeps/claims/<cell key>``, created exclusively (``O_EXCL``), so two sweeps sharing a
results folder never run one cell twice. The file names the claiming process; a claim whose process
has ended on this machine is stale and taken over, one from another machine is left alone."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from gtx.records.layout import ResultsFolder


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
    folder = ResultsFolder(results_dir).claims()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / key
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
    return holder(path) or "another sweep"


def release(results_dir: str | Path, key: str) -> None:
    (ResultsFolder(results_dir).claims() / key).unlink(missing_ok=True)
