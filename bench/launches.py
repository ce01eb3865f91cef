"""How many operations one attention layer's training step dispatches on a GPU's paths, counted on the CPU.

    python bench/launches.py [--pattern dsa:dense=0] [--tokens 16384] [--kernels torch|triton]

A GPU step of a content-chosen pattern is bound by its launches rather than its arithmetic, and
each dispatched op is about one launch. This builds one layer (4 heads of 32, as the GPU tables'
model), runs its forward and backward (the output's loss and the pattern's own losses) on one
sequence of ``--tokens`` tokens in float32, and counts the ops torch dispatches: all of them, those
that launch a kernel on a GPU (not views, not allocations), and those that read a value back (a
sync). The GPU's paths stand in on the CPU: the C kernels hidden (``native.kernel``), the key
attention's GPU blocks (``keys._ACCELERATOR_CHUNK``), the GPU's tie rule of the top-k (every row
decided by keys). ``--kernels triton``: the selection's Triton kernels are counted, not run (their
outputs' values change nothing that is dispatched; the choice's key ids are made valid, as the
steps after it check them).
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from gtx import native
from gtx.attention.module import Attention
from gtx.attention.selection import choice
from gtx.attention.selection import keys as key_attention
from gtx.backends import get_backend
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph

READS = ("_local_scalar_dense", "item", "nonzero")
NOT_LAUNCHED = ("lift_fresh", "detach", "alias", "set_")


class Dispatched(TorchDispatchMode):
    """Counts the ops dispatched under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops, self.launching, self.reads = Counter(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        self.ops[name] += 1
        if name in READS:
            self.reads += 1
        elif not (func.is_view or name.startswith(("empty", "new_empty")) or name in NOT_LAUNCHED):
            self.launching += 1
        return func(*args, **(kwargs or {}))


class Counted:
    """Stands for a Triton kernel: ``kernel[grid](*args)`` adds one to ``launches`` and runs nothing."""

    def __init__(self, name: str, launches: Counter, ids: tuple[int, int] | None = None):
        self.name, self.launches, self.ids = name, launches, ids

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1
            if self.ids is not None:  # the choice's (keys, valid) arguments: valid ids, every slot kept
                with _disable_current_modes():
                    args[self.ids[0]].zero_()
                    args[self.ids[1]].fill_(True)

        return launch


def gpu_paths(kernels: str, launches: Counter) -> None:
    """The GPU's paths on the CPU (see the module's docstring)."""
    os.environ["GTX_KERNELS"] = kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
    native.kernel = lambda *_: None
    key_attention._CHUNK = key_attention._ACCELERATOR_CHUNK
    top = choice.top_later_first
    choice.top_later_first = lambda score, count, every_row=True: top(score, count, every_row)
    if kernels == "triton":
        from gtx.attention.selection import triton_index, triton_keys

        for module, name, ids in (
            (triton_keys, "_forward_kernel", None),
            (triton_keys, "_backward_kernel", None),
            (triton_index, "_top_kernel", (5, 6)),
            (triton_index, "_kl_kernel", None),
        ):
            setattr(module, name, Counted(name, launches, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", default="dsa:dense=0")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--kernels", choices=("torch", "triton"), default="torch")
    args = parser.parse_args()
    launches: Counter = Counter()
    gpu_paths(args.kernels, launches)
    torch.manual_seed(0)
    heads, dim = 4, 32
    pattern = parse_pattern(args.pattern)
    attention = Attention(get_backend("auto"), pattern, heads, dim)
    edges = build_graph(pattern, None, [args.tokens]).edges["dd"]
    q, k, v = (torch.randn(args.tokens, heads, dim, requires_grad=True) for _ in range(3))
    inputs = torch.randn(args.tokens, heads * dim)
    attention.begin_step(0)
    with Dispatched() as counted:
        out = attention(q * dim**-0.5, k, v, edges, inputs=inputs)
        loss = out.pow(2).mean() + sum(attention.pending)
        loss.backward()
    print(
        f"{args.pattern} at {args.tokens} tokens, GTX_KERNELS={args.kernels}: {sum(counted.ops.values())} ops dispatched, "
        f"{counted.launching} launching a kernel, {counted.reads} reading a value back; Triton kernels "
        f"{sum(launches.values())} ({', '.join(f'{n} {c}' for n, c in launches.items()) or 'none'})"
    )
    print("most dispatched:", ", ".join(f"{name} {c}" for name, c in counted.ops.most_common(12)))


if __name__ == "__main__":
    main()
