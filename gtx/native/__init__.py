"""C kernels for the CPU, built on first use with the system's C compiler and loaded through ctypes.

Every kernel's source sits beside this module (``<name>.c``, and the headers it includes: the
attention kernels of ``gtx.backends`` and ``gtx.attention``, the model's dropout). The compiler
is ``$CC``, split as a shell would (``CC='ccache gcc'``), else ``cc`` or ``gcc``. Its library is
cached under ``<cache>/native`` (``gtx.files.cache_dir``: ``$GTX_CACHE``, else ``~/.cache/gtx``)
by the hash of the sources, the toolchain (the compiler's path and ``--version``), the flags and
the CPU's features, so a machine builds each version once. The build tries ``-march=native`` with
OpenMP, then without OpenMP, then the baseline architecture (for compilers that refuse
``-march=native``) with and without OpenMP, each under its own key. ``GTX_NATIVE_ARCH`` names
another target for ``-march`` (``x86-64-v3``: AVX2 without AVX-512, as on many servers; ``x86-64``:
SSE2 alone), so that one machine builds and tests what another's CPU runs; ``build_flags()`` says
which flags this process builds with. A built library is synced to
disk before it is moved into place, with its size and SHA-256 beside it, and checked against them
before it is loaded: one cut short (a crash, a full disk) is rebuilt, never loaded. Before it is
moved into place, a new library is loaded by a child process: one whose loading ends the process
(``CC='gcc -fsanitize=address'``: the sanitizer's runtime must come first) counts as a failed build.
A build that fails is remembered beside it (``<name>-<key>.failed``, for a day), not retried by
every process.
Without a usable compiler or cache, or with ``GTX_NATIVE=0``, ``load`` returns None and the callers
use their torch path; each reason is logged once per process, on one line.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gtx.files import CACHE_VARIABLE, atomic_write, cache_dir, replace_durably

log = logging.getLogger(__name__)

# associative math: dot products vectorize
FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
]
# this CPU's vector instructions; some compilers refuse it (clang <= 14 on AArch64, older Apple clang)
ARCH_VARIABLE = "GTX_NATIVE_ARCH"  # -march's target instead of native: another CPU's build on this one
OPENMP = ["-fopenmp"]  # a kernel's parts on the OpenMP team torch's threads form (the kernels' ON_PARTS)
RETRY_AFTER = 24 * 3600  # seconds a failed build is remembered
# in every cache key: libraries built before their loading was tried in a child process are built again
PROBED = "loaded by a child first"
SLOWER = "topk, dsa and dropout run on their torch path, several times slower on the CPU"
HERE = Path(__file__).parent

_said: set[str] = set()
_flags: dict[str, list[str]] = {}  # kernel name -> the flags its loaded library was built with


def _say(level: int, message: str, about: str | None = None) -> None:
    """Log ``message`` once per process, and once per ``about`` where given (the same trouble with
    both kernels: one line)."""
    if (about or message) not in _said:
        _said.add(about or message)
        log.log(level, message)


def arch() -> list[str]:
    """The ``-march`` flag the kernels build with first: ``$GTX_NATIVE_ARCH``'s target, else native."""
    return [f"-march={os.environ.get(ARCH_VARIABLE, '').strip() or 'native'}"]


def _variants() -> list[tuple[list[str], str]]:
    """The builds tried, best first: (flags, what the build lacks; empty for the best)."""
    march = arch()
    return [
        ([*march, *OPENMP], ""),
        (march, "without OpenMP: their parts run one after another"),
        (OPENMP, f"for the baseline CPU (the compiler refused {march[0]})"),
        ([], "for the baseline CPU and without OpenMP"),
    ]


@functools.cache
def _cpu_features() -> str:
    """What ``-march=native`` builds for: Linux's CPU flags line; elsewhere (macOS) the CPU's model and
    feature lists from sysctl, not only the architecture's name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        try:
            sysctl = subprocess.run(
                ["sysctl", "machdep.cpu", "hw.optional"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.SubprocessError):
            sysctl = ""
        return "\n".join([platform.machine(), platform.processor(), sysctl])
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), text[:200])


@functools.cache
def toolchain(cc: str | None) -> tuple[list[str], str] | str:
    """For ``$CC`` (None: unset): the compiler's command, split as a shell would (else ``cc`` or
    ``gcc`` on the PATH), and what identifies it (its path and ``--version``); or why there is none,
    one line naming CC."""
    if not cc or not cc.strip():
        found = shutil.which("cc") or shutil.which("gcc")
        if found is None:
            return "no C compiler (no cc or gcc on the PATH)"
        argv = [found]
    else:
        try:
            argv = shlex.split(cc)
        except ValueError as e:
            return f"CC={cc!r} cannot be split as a shell would ({e})"
        found = shutil.which(argv[0])
        if found is None:
            return f"CC={cc!r}: no program {argv[0]!r} found"
    try:
        version = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"CC={cc!r} does not run ({e})"
    return argv, f"{os.path.realpath(found)}\n{version}"


def _first_error(stderr: str) -> str:
    """The line of a compiler's output that says what failed, cut to 200 characters."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    # the linker's own line says why
    causes = [x for x in lines if "ld returned" not in x and "linker command failed" not in x]
    line = next((x for x in causes if "error" in x.lower() or "cannot find" in x), lines[-1] if lines else "no output")
    return line[:200]


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _verified(target: Path) -> bool:
    """``target`` is whole: its size and SHA-256 are those written beside it when it was built."""
    try:
        size, digest = _sidecar(target).read_text().split()
        data = target.read_bytes()
        return len(data) == int(size) and hashlib.sha256(data).hexdigest() == digest
    except (OSError, ValueError):
        return False


def _build(argv: list[str], flags: list[str], source: Path, target: Path) -> str | None:
    """Build into a folder beside ``target``, sync and move into place, then write its size and hash
    beside it (concurrent processes see the old file or a whole new one); None, or what failed."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        try:
            proc = subprocess.run(
                [*argv, *FLAGS, *flags, str(source), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
                timeout=600,
            )
        except (OSError, subprocess.SubprocessError) as e:
            return str(e)
        if proc.returncode != 0 or not built.is_file():
            return proc.stderr or proc.stdout or f"exit status {proc.returncode}"
        if (error := _ends_its_loader(built)) is not None:
            return error
        data = built.read_bytes()
        replace_durably(built, target)
    atomic_write(_sidecar(target), f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    return None


def _ends_its_loader(path: Path) -> str | None:
    """None where a child process loads the library at ``path`` and goes on; else, in one line, what
    ended it. A library can end the process that loads it (a sanitizer's runtime that must be loaded
    first aborts it): tried here, such a build is remembered as failed instead of ending every run."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"built, but loading it could not be tried ({e})"
    if proc.returncode == 0:
        return None
    said = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return f"built, but loading it ends the process: {said[-1][:200] if said else f'exit status {proc.returncode}'}"


def _failed_recently(marker: Path) -> str | None:
    """What a remembered build failure said, while it is remembered."""
    try:
        if time.time() - marker.stat().st_mtime < RETRY_AFTER:
            return marker.read_text()
    except OSError:
        pass
    return None


def library(name: str) -> Path | None:
    """The path of kernel ``name``'s library (its source ``<name>.c`` beside this module), built if this machine
    has none yet and checked whole; None (logged once) where it cannot be built."""
    if os.environ.get("GTX_NATIVE", "1") == "0":
        _say(logging.WARNING, f"GTX_NATIVE=0: {SLOWER}")
        return None
    tool = toolchain(os.environ.get("CC"))
    if isinstance(tool, str):
        _say(logging.WARNING, f"{tool}: {SLOWER}; set CC to a C compiler's command")
        return None
    argv, identity = tool
    source = HERE / f"{name}.c"
    # what the sources include
    texts = [
        source.read_text(),
        *(h.read_text() for h in sorted(source.parent.glob("*.h"))),
    ]
    folder = cache_dir() / "native"
    cc = f"CC={shlex.join(argv)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        errors = []

        def chosen(flags: list[str], lacks: str, level: int) -> None:
            """The variant built with ``flags`` serves ``name``; where it lacks a feature (the first
            variant failed), say so once at ``level``."""
            _flags[name] = [*FLAGS, *flags]
            if lacks:
                _say(level, f"the C kernels are built {lacks} ({cc}: {_first_error(errors[0])})", f"{lacks} {cc}")

        for flags, lacks in _variants():
            key = hashlib.sha256(
                "\0".join([*texts, *argv, identity, *FLAGS, *flags, _cpu_features(), PROBED]).encode()
            ).hexdigest()[:16]
            target, marker = folder / f"{name}-{key}.so", folder / f"{name}-{key}.failed"
            if _verified(target):
                chosen(flags, lacks, logging.INFO)
                return target
            error = _failed_recently(marker)
            if error is None:
                error = _build(argv, flags, source, target)
                if error is None:
                    chosen(flags, lacks, logging.WARNING)
                    return target
                atomic_write(marker, error)
            errors.append(error)
    except OSError as e:
        _say(
            logging.WARNING,
            f"the C kernels' cache {folder} cannot be used ({e.strerror or e}): {SLOWER}; set {CACHE_VARIABLE} to a writable folder",
        )
        return None
    _say(
        logging.WARNING,
        f"C kernel {name} does not build with {cc} ({_first_error(errors[0])}): {SLOWER}; "
        f"set CC to another compiler, or remove {folder}/*.failed to retry ({CACHE_VARIABLE} sets where it is)",
        f"fails {cc}",
    )
    return None


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The kernel ``name`` as a loaded library (``library``); None (logged once) where it cannot be
    built or loaded."""
    path = library(name)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        _say(
            logging.WARNING,
            f"C kernel {name} does not load ({e}): {SLOWER}; set {CACHE_VARIABLE} to another folder, or CC to another "
            "compiler, to build it afresh",
            "does not load",
        )
        return None


VECTORS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "neon", "asimd", "sve")  # what the kernels use


def machine() -> str:
    """One line: this CPU's model, cores and vector instructions (those the kernels' builds use), and
    torch's version, threads and the vector code its own kernels picked."""
    model = platform.processor() or platform.machine()
    try:
        found = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        model = found[0].split(":", 1)[1].strip() if found else model
    except OSError:
        pass
    have = set(_cpu_features().split())
    vectors = " ".join(v for v in VECTORS if v in have) or "none listed"
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"{model}, {os.cpu_count()} cores ({vectors}); torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"its kernels for {capability}"
    )


def build_flags(name: str = "dense_kernel") -> str:
    """One line: the compiler and flags kernel ``name`` is built with on this machine (building it if
    it is not yet), or why it runs as torch ops."""
    path = library(name)
    tool = toolchain(os.environ.get("CC"))
    if path is None or isinstance(tool, str):
        reason = "GTX_NATIVE=0" if os.environ.get("GTX_NATIVE", "1") == "0" else "not built: see the warning above"
        return f"none ({tool if isinstance(tool, str) else reason}): their torch ops run instead"
    version = tool[1].splitlines()[1] if len(tool[1].splitlines()) > 1 else tool[1]
    return f"{shlex.join(tool[0])} ({version.strip()}) {shlex.join(_flags[name])}"


def kernel(name: str, *tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel ``name`` where it serves these tensors (float32, on the CPU) and could be built."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return None
    return load(name)


def check_ids(keys: torch.Tensor, count: int, what: str = "key") -> None:
    """Every id in ``keys`` (valid slots or not: the kernels read each slot's row) lies in [0, count);
    else an IndexError, as the torch path's indexing raises, where a kernel would read out of bounds.
    A selection shared by the heads (head stride 0) is checked once."""
    if keys.dim() == 3 and keys.stride(1) == 0:
        keys = keys[:, :1]
    if keys.numel() == 0:
        return
    low, high = (int(x) for x in torch.aminmax(keys))
    if low < 0 or high >= count:
        raise IndexError(f"{what} ids out of range: {low}..{high} selected among {count} {what}s")


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
