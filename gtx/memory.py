"""Peak memory, measured one way everywhere: CUDA, the allocator's peak; CPU, the process's peak
resident set (Linux's VmHWM, which can be reset, so that a measurement's peak is its own rather
than an earlier import's)."""

from __future__ import annotations

import ctypes
import gc
import resource

import torch


def peak_mb(device: torch.device | str = "cpu") -> float:
    """The peak (MB) since the process started or since the last ``reset_peak``."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux: ru_maxrss, which never resets
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak(device: torch.device | str = "cpu") -> float:
    """Start a measurement: garbage collected, freed heap handed back (glibc), the peak reset to what
    is in use now, which is returned (MB): ``peak_mb(device) - reset_peak(device)`` taken around some
    work is that work's growth. Where the CPU peak cannot be reset, the peak so far is the baseline."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    try:  # glibc: hand freed heap back, so that new allocations show as growth, not as reuse
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: peak RSS := current RSS
    except OSError:
        pass
    return peak_mb(device)
