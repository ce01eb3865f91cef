"""The C kernels and their torch paths, run side by side: for choices (key sets, compared exactly on
inputs whose scores float32 holds exactly) and for values, each path against float64 within the
bound float32 holds on the input (``gtx.testing.float32``), never against the other path: the order
a CPU sums in decides their last bits, not whether either is right."""

import pytest

from gtx import native
from gtx.testing.float32 import float64_reference


def torch_path(fn, *inputs):
    """fn(*inputs) with the C kernels hidden: their torch paths run."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "kernel", lambda *_: None)
        return fn(*inputs)


def both_paths(fn, *inputs):
    """fn(*inputs) on the C kernels, then on the torch path."""
    return fn(*inputs), torch_path(fn, *inputs)


def both_hold(fn, *inputs, **options):
    """fn(*inputs) (float32) on the C kernels and on the torch path, each within the float32 bound of
    fn in float64 on the same inputs (``options``: ``gtx.testing.float32.float64_reference``'s); the two
    results."""
    want = float64_reference(fn, *inputs, **options)
    got = both_paths(fn, *inputs)
    want.check(got[0], "the C kernel")
    want.check(got[1], "the torch path")
    return got
