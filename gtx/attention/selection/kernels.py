"""Which kernels run a selection, and the record of those that ran.

``GTX_KERNELS`` chooses: ``auto`` (the default) runs the fused Triton kernels on CUDA where
``triton`` imports, and the C kernels (float32 on the CPU) or torch ops elsewhere; ``triton`` runs
the Triton kernels on any device (on the CPU only under ``TRITON_INTERPRET=1``, Triton's
interpreter: slow, for tests); ``torch`` never runs them. Every call that attends over a selection
adds the name of the kernel that ran to ``ran`` under its stage, which a run's ``backend_plan``
reports beside the backend's choices.
"""

from __future__ import annotations

import functools
import os
from collections import Counter, defaultdict

import torch

from gtx.errors import GtxError

VARIABLE = "GTX_KERNELS"
CHOICES = ("auto", "triton", "torch")

#: stage -> kernel name -> calls, since the last ``take_ran``
ran: defaultdict[str, Counter] = defaultdict(Counter)


def record(stage: str, kernel: str) -> None:
    ran[stage][kernel] += 1


def take_ran() -> dict[str, dict[str, int]]:
    """The kernels counted since the last call, per stage; then cleared."""
    out = {stage: dict(c) for stage, c in ran.items()}
    ran.clear()
    return out


def choice() -> str:
    value = os.environ.get(VARIABLE, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise GtxError(f"{VARIABLE}={value!r}: choose one of {', '.join(CHOICES)}")
    return value


@functools.cache
def triton_error() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can (``triton`` imports)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e}): pip install triton"
    return None


def use_triton(device: torch.device) -> bool:
    """Whether selections on ``device`` run on the Triton kernels (``GTX_KERNELS``)."""
    wanted = choice()
    if wanted == "torch":
        return False
    if wanted == "auto":
        return torch.device(device).type == "cuda" and triton_error() is None
    why = triton_error()
    if why is None and torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        why = "on the CPU they run only under Triton's interpreter: set TRITON_INTERPRET=1"
    if why:
        raise GtxError(f"{VARIABLE}=triton: {why}; or unset {VARIABLE}")
    return True
