"""Files gtx writes: folders checked before the work whose output would otherwise be lost, atomic
writes, the data cache."""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path

from gtx.errors import GtxError

log = logging.getLogger(__name__)
#: what a write refused for want of room sets as its errno: a full device, a user's quota spent
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
CACHE_VARIABLE = "GTX_CACHE"
OLD_CACHE_VARIABLE = "GTX_CACHE_DIR"  # its earlier name, still read where GTX_CACHE is unset


def check_writable(path: str | Path, what: str = "--results") -> Path:
    """``path`` is a writable folder, or one could be created there (its nearest existing ancestor
    is a writable folder); else one GtxError line naming it (``what``). Creates nothing."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        reason = "it is a file" if existing == path else f"{existing} is not a folder"
        raise GtxError(f"{what} {path}: cannot create the folder ({reason}); {_another(what)}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GtxError(f"{what} {path}: not writable; {_another(what)}")
    return path


def _another(what: str) -> str:
    return f"choose another {what} folder" if what.startswith("--") else f"choose another {what}"


def writable_dir(path: str | Path, what: str = "--results") -> Path:
    """``path``, created if missing, as a writable folder; else one GtxError line naming it (``what``)."""
    path = check_writable(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GtxError(f"{what} {path}: cannot create the folder ({e.strerror}); {_another(what)}") from None
    return path


def cache_dir() -> Path:
    """Where gtx caches what it generates and builds (task data, cost calibrations, the C kernels):
    ``$GTX_CACHE`` (or ``$GTX_CACHE_DIR``, its earlier name, where ``GTX_CACHE`` is unset), else
    ``~/.cache/gtx``; created if missing. A folder that cannot be used (an empty value, a file, below
    a file, not writable) gives this process a temporary folder instead, with one warning line naming
    the variable."""
    return _usable_cache(*_cache_variable())


def lasting_cache(command: str) -> Path:
    """``cache_dir()`` for a command whose product is what it saves there (``gtx bench calibrate``),
    checked before its work: one GtxError line where the folder cannot be used or written in (the
    temporary stand-in ``cache_dir`` would take is deleted when the process ends)."""
    path, what, reason = _cache_place(*_cache_variable())
    if reason is None:
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:  # what os.access cannot tell: a read-only file system under root, a full device
            reason = f"cannot write in it: {e.strerror or e}"
    if reason:
        raise GtxError(
            f"{command} saves into gtx's cache, and {what} cannot be used ({reason}); set {CACHE_VARIABLE} to a writable folder"
        )
    return path


def _cache_variable() -> tuple[str | None, str | None]:
    name = next((v for v in (CACHE_VARIABLE, OLD_CACHE_VARIABLE) if v in os.environ), None)
    return name, os.environ.get(name) if name else None


def _cache_place(name: str | None, value: str | None) -> tuple[Path, str, str | None]:
    """(the cache folder, how to name it, why it cannot be used or None), created where it can be."""
    path = Path(value).expanduser().absolute() if value else Path.home() / ".cache" / "gtx"
    what = f"{name}={value}" if name else f"the default cache {path} (no {CACHE_VARIABLE} set)"
    if name and not value:
        return path, what, "it is empty"
    try:
        existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
        if not existing.is_dir():
            return path, what, "it is not a folder" if existing == path else f"{existing} is not a folder"
        if not os.access(existing, os.W_OK | os.X_OK):
            return path, what, "it is not writable"
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return path, what, f"cannot create it: {e.strerror or e}"
    return path, what, None


@functools.cache
def _usable_cache(name: str | None, value: str | None) -> Path:
    path, what, reason = _cache_place(name, value)
    if reason is None:
        return path
    tmp = Path(tempfile.mkdtemp(prefix="gtx-cache-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    log.warning(
        "%s cannot be used as gtx's cache (%s): caching in %s for this process; set %s to a writable folder",
        what,
        reason,
        tmp,
        CACHE_VARIABLE,
    )
    return tmp


def replace_durably(tmp: str | Path, path: Path) -> None:
    """Move the written file ``tmp`` onto ``path`` (same folder) once its bytes are on disk: a crash or
    a full disk then leaves the old file or the new one, never one cut short."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:  # the rename itself, where the platform can sync a folder
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class NoSpace(GtxError):
    """A write the device refused for want of room (``NO_SPACE``): ``folder`` is where it went; the
    file it would have replaced is whole (``atomic_write``)."""

    def __init__(self, path: Path):
        self.folder = path.parent
        super().__init__(
            f"no space left on the device of {self.folder} (writing {path.name}; any earlier {path.name} is kept whole); "
            "free space there, or choose another folder"
        )


def check_space(folder: Path, need: int, what: str = "--results") -> None:
    """One GtxError line, before any work, where the device of ``folder`` (an existing folder) has
    fewer than ``need`` bytes free: what the work would write first would not fit."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise GtxError(
            f"{what} {folder}: {free / 2**20:,.1f} MiB free on its device, and the run writes about "
            f"{need / 2**20:,.1f} MiB a checkpoint; free space, or {_another(what)}"
        )


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write through a temporary file in the same folder, synced, and rename: readers never see a
    partial file, and a kill or a crash leaves the previous one whole. A full device is ``NoSpace``."""
    try:
        _write_then_rename(path, data)
    except OSError as e:
        if e.errno in NO_SPACE:
            raise NoSpace(path) from None
        raise


def _write_then_rename(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        replace_durably(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
