"""Folders gtx writes into, checked before the work whose output would otherwise be lost."""

from __future__ import annotations

import os
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
