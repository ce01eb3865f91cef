"""Folders gtx writes into, checked before the work whose output would otherwise be lost."""

from __future__ import annotations

import os
from pathlib import Path

from gtx.errors import GtxError


def writable_dir(path: str | Path, what: str = "--results") -> Path:
    """``path``, created if missing, as a writable folder; else one GtxError line naming it (``what``)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GtxError(f"{what} {path}: cannot create the folder ({e.strerror}); choose another --results folder") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise GtxError(f"{what} {path}: not writable; choose another --results folder")
    return path
