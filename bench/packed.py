"""Where plain attention over unequal short samples runs on the packed kernel instead of SDPA.

    python bench/packed.py [--tokens 2730] [--rounds 12]

For batches of samples of L/2..L tokens (random lengths, about ``--tokens`` tokens in all), complete
(``full``'s ``ee``) and causal (``dd``), times one forward + backward of ``gtx.backends.flash`` on
SDPA's padded buckets and on the packed C kernel (``gtx.backends.packed``), at 4 heads of 32 and 1
head of 128 dimensions, and prints the median of ``--rounds`` calls each, the ratio packed / SDPA and
the batch's mean keys per query: what ``gtx.backends.flash.SHORT`` is set from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch

from gtx.backends import flash
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph


def seconds(q, k, v, edges, structure, grad, rounds: int, short: int) -> float:
    """Median seconds of ``rounds`` forward + backward calls of ``flash_attention`` with ``flash.SHORT = short``."""
    old, flash.SHORT = flash.SHORT, short
    try:
        edges = type(edges)(edges.src, edges.dst, edges.n_src, edges.n_dst, edges.stage, edges.q_lens, edges.k_lens)
        times = []
        for _ in range(rounds + 1):  # the first call plans
            t0 = time.perf_counter()
            flash.flash_attention(q, k, v, edges, structure).backward(grad)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        flash.SHORT = old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2730)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for heads, dim in ((4, 32), (1, 128)):
        for top in (24, 48, 96, 192, 256, 384, 512):
            lens = torch.randint(top // 2, top + 1, (max(2, args.tokens // (3 * top // 4)),)).tolist()
            graph = build_graph(parse_pattern("full"), lens, lens)
            for stage in ("ee", "dd"):
                edges = graph.edges[stage]
                structure = flash.flash_structure(edges)
                q, k, v = (torch.randn(sum(lens), heads, dim, requires_grad=True) for _ in range(3))
                grad = torch.randn(sum(lens), heads, dim)
                sdpa, packed = (seconds(q, k, v, edges, structure, grad, args.rounds, s) for s in (0, 10**9))
                rows.append(
                    {
                        "heads x dim": f"{heads} x {dim}",
                        "L": top,
                        "structure": structure,
                        "keys_per_query": edges.num_edges / edges.n_dst,
                        "sdpa_ms": 1000 * sdpa,
                        "packed_ms": 1000 * packed,
                        "packed / sdpa": packed / sdpa,
                    }
                )
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.2f}"))


if __name__ == "__main__":
    main()
