"""C kernels for the CPU, built on first use with the system's C compiler and loaded through ctypes.

A kernel's source sits beside this module (``<name>.c``, and the headers it includes); the shared
library is cached under ``$GTX_CACHE`` (default ``~/.cache/gtx``) by the hash of the sources, the
compiler flags and the CPU's features (it is built with ``-march=native``), so a machine builds
each version once. Without a compiler, or with ``GTX_NATIVE=0``, ``load`` returns None and the
callers use their torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC"]  # associative math: dot products vectorize
OPENMP = ["-fopenmp"]  # a kernel's parts on the OpenMP team torch's threads form (the kernels' ON_PARTS)


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), text[:200])


def cache_dir() -> Path:
    return Path(os.environ.get("GTX_CACHE", Path.home() / ".cache" / "gtx"))


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The kernel ``name`` as a loaded library, built if this machine has no copy yet; None (logged
    once) where it cannot be built."""
    if os.environ.get("GTX_NATIVE", "1") == "0":
        return None
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc): %s runs on its torch path, several times slower on the CPU", name)
        return None
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, *FLAGS, *OPENMP, _cpu_features()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then moved: concurrent runs never see half a file
            built = Path(tmp) / target.name
            proc = subprocess.run([compiler, *FLAGS, *OPENMP, str(source), "-o", str(built), "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                log.warning("building %s with OpenMP failed (%s): its parts run one after another", name, compiler)
                proc = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                log.warning("building %s failed (%s): it runs on its torch path\n%s", name, compiler, proc.stderr[-2000:])
                return None
            os.replace(built, target)
    return ctypes.CDLL(str(target))


def kernel(name: str, *tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel ``name`` where it serves these tensors (float32, on the CPU) and could be built."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return None
    return load(name)


def pointer(x: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(x.data_ptr())


def ints(*values: int) -> list[ctypes.c_int64]:
    return [ctypes.c_int64(x) for x in values]


def parts(n: int) -> int:
    """How many parts a kernel splits n units of work into: torch's threads, at most n, at least 1."""
    return max(1, min(torch.get_num_threads(), n))


def check(code: int) -> None:
    """A kernel returns nonzero when one of its parts could not allocate its buffers."""
    if code:
        raise MemoryError("a native kernel could not allocate its buffers")
