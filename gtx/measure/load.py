"""What else keeps this machine's cores busy: a run or benchmark timed while other processes spin
does not compare with a quiet one (torch's threads in several processes spin against each other,
measured 30-40x slower). ``busy_cores`` reads it, ``busy_note`` decides whether to say so;
``GTX_BUSY_CHECK=0`` looks at nothing (a test suite, a scheduler's dedicated nodes)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

CHECK_VARIABLE = "GTX_BUSY_CHECK"


def cpu_ticks(path: str = "/proc/stat") -> tuple[int, int]:
    """(this machine's CPU ticks since boot, the idle ones among them), from Linux's ``/proc/stat``:
    user nice system idle iowait irq softirq (steal left out: another guest's). OSError, ValueError
    or IndexError where it cannot be read."""
    with open(path) as f:
        values = [int(x) for x in f.readline().split()[1:8]]
    return sum(values), values[3] + values[4]


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_cores(
    window_s: float = 0.5,
    ticks: Callable[[], tuple[int, int]] = cpu_ticks,
    sleep: Callable[[float], None] = time.sleep,
    cores: int | None = None,
) -> float | None:
    """How many cores other processes keep busy now: the busy share of the machine's ticks (``ticks``)
    over ``window_s`` seconds while this process sleeps, times its cores (``cores``: os.cpu_count());
    None where the ticks cannot be read or none passed. Unlike the load average, which lags by a minute, a benchmark
    that just finished does not count."""
    try:
        total0, idle0 = ticks()
        sleep(window_s)
        total1, idle1 = ticks()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:  # no tick passed: nothing to tell
        return None
    return (1 - (idle1 - idle0) / (total1 - total0)) * (cores or os.cpu_count() or 1)


def busy_note(measured: str, busy: float | None = None, cores: int | None = None) -> str | None:
    """A warning when other processes keep more than a quarter of the cores (and more than half of
    one) busy, naming what they make incomparable (``measured``); None on a quiet machine, where the
    load cannot be read, or with ``GTX_BUSY_CHECK=0``. ``busy``: how many cores are busy (None:
    ``busy_cores()`` measures it now, half a second); ``cores``: how many this process may use."""
    if busy is None:
        if os.environ.get(CHECK_VARIABLE, "1") == "0":
            return None
        busy = busy_cores()
    cores = usable_cores() if cores is None else cores
    if busy is None or busy <= max(0.5, 0.25 * cores):
        return None
    advice = (
        "quote only ratios measured side by side in one run"
        if os.environ.get("OMP_NUM_THREADS") == "1"
        else "set OMP_NUM_THREADS=1 and quote only ratios measured side by side"
    )
    return (
        f"other processes keep {busy:.1f} of {cores} cores busy: they share this machine, so {measured} do not "
        f"compare with a quiet run's; {advice}"
    )
