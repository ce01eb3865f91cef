"""Files gtx writes: folders checked before the work whose output would otherwise be lost, atomic
writes, the data cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gtx.errors import GtxError


def check_writable(path: str | Path, what: str = "--results") -> Path:
    """``path`` is a writable folder, or one could be created there (its nearest existing ancestor
    is a writable folder); else one GtxError line naming it (``what``). Creates nothing."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        reason = "it is a file" if existing == path else f"{existing} is not a folder"
        raise GtxError(f"{what} {path}: cannot create the folder ({reason}); choose another --results folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GtxError(f"{what} {path}: not writable; choose another --results folder")
    return path


def writable_dir(path: str | Path, what: str = "--results") -> Path:
    """``path``, created if missing, as a writable folder; else one GtxError line naming it (``what``)."""
    path = check_writable(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GtxError(f"{what} {path}: cannot create the folder ({e.strerror}); choose another --results folder") from None
    return path


def cache_dir() -> Path:
    """Where generated task data is cached: ``GTX_CACHE_DIR``, else ``~/.cache/gtx``."""
    return Path(os.environ.get("GTX_CACHE_DIR") or Path.home() / ".cache" / "gtx")


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write through a temporary file in the same folder and rename: readers never see a partial
    file, and a kill leaves the previous one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
