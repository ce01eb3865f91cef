"""Attention cells and training steps timed in one process, for a card lent for minutes.

    python bench/gpu_cells.py attention [--device cuda]
    python bench/gpu_cells.py train [--device cuda] [--context 16384] SPEC...

``gtx bench attention`` and ``gtx bench train`` run every row in a fresh process (so that each
row's peak memory is its own); on a GPU each such process compiles FlexAttention again, 5-15 s a
row. This script sets up the same cells (``prepare_attention_cell``, the training bench's
``_time_steps``) in one process, so a row costs its own time, and prints a line per row (with
``--csv FILE``, also writes the rows there).

``attention``: forward + backward of one sequence (4 heads of 32, float32) of ``causal``,
``local:w=256``, ``bigbird`` and a union (``UNION``) at 4096, 16384 and 65536 tokens (``ATTENTION``),
on FlexAttention called directly with flex's BlockMask, ``flex``, ``auto`` and SDPA; the backends of
one (pattern, n) are timed in turns (``attention``). A reference with ``-rows`` (``rows_cell``) is
called on gtx's layout, to tell what gtx's rows lose to the layout from what they lose to gtx.

``train``: the CPU tables' model (``lm``: 2 layers, 4 heads, dim 128, dim_ff 512, one sequence of
``--context`` tokens of ``text``), per SPEC ``PATTERN/PRECISION/PROFILE``: ``PATTERN`` (``none``: the
attention-free ceiling), ``float32`` or ``bfloat16``, ``p`` to print a profile of two more steps or
``-``. Each row: step time (mean of 4 steps after 2 untimed), the batches' build time within it, and
the peak memory over what the model held before the steps.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import pandas as pd
import torch
import torch.nn.functional as F

from gtx.measure.bench import AttentionCell, PreparedCell, prepare_attention_cell
from gtx.measure.reference import SkipAttention, TrainCell, first_batches
from gtx.measure.train_bench import _time_steps
from gtx.memory import peak_mb, reset_peak

UNION = "local:w=128|strided:l=128"
# (pattern, n, backends), the reference first; the masked SDPA up to 16384 tokens (an (n, n) mask),
# causal up to 16384 (its edges at 65536 would be 2^31 pairs)
ATTENTION = (
    [("causal", n, ("sdpa", "auto", "sdpa-rows")) for n in (4096, 16384)]
    + [("local:w=256", n, ("flexattention", "flex", "auto", "sdpa", "flexattention-rows")) for n in (4096, 16384)]
    + [(p, n, ("flexattention", "flex", "auto")) for p, n in [("local:w=256", 65536)]]
    + [(p, n, ("flexattention", "flex", "auto")) for p in ("bigbird", UNION) for n in (4096, 16384, 65536)]
)
ROUNDS, REPEATS = 3, 10
ROWS_LAYOUT = "-rows"  # a reference called as gtx calls it: on (1, H, n, D) views of (n, H, D) rows, q scaled first
MODEL = {"layers": "2", "heads": "4", "dim": "128", "dim_ff": "512", "batch_size": "1"}


def attention(device: str) -> list[dict]:
    """Per (pattern, n), every backend's cell set up once, then ``ROUNDS`` rounds of ``REPEATS`` calls
    each, the backends in turn (their order rotated each round), so that a slow spell of the machine
    hits every row alike; a row's time is the median of its calls, its ratio the reference's time over it."""
    rows = []
    for pattern, n, backends in ATTENTION:
        prepared, times = {}, {}
        for backend in backends:
            t = time.time()
            try:
                cell = (
                    rows_cell(backend.removesuffix(ROWS_LAYOUT), pattern, n, device)
                    if backend.endswith(ROWS_LAYOUT)
                    else prepare_attention_cell(AttentionCell(pattern, n, backend, device=device))
                )
                first = cell.timed()
                cell.timed(), cell.timed()  # warm-up
                prepared[backend], times[backend] = cell, []
                print(
                    f"ATT {pattern} {n} {backend}: set up, first call {1000 * first:.0f} ms ({time.time() - t:.0f} s)"
                )
            except Exception as e:  # a row that fails is reported, and the others still run
                print(f"ATT {pattern} {n} {backend}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
        for r in range(ROUNDS):
            order = list(prepared)[r % len(prepared) :] + list(prepared)[: r % len(prepared)] if prepared else []
            for backend in order:
                times[backend] += [prepared[backend].timed() for _ in range(REPEATS)]
        reference = statistics.median(times[backends[0]]) if backends[0] in prepared else math.nan
        for backend, cell in prepared.items():
            ms = 1000 * statistics.median(times[backend])
            rounds = [
                1000 * statistics.median(times[backend][i : i + REPEATS]) for i in range(0, ROUNDS * REPEATS, REPEATS)
            ]
            row = {
                "pattern": pattern,
                "n": n,
                "backend": backend,
                "ms": ms,
                "reference": backends[0],
                "ratio": 1000 * reference / ms,
                "choice": cell.choice(),
                "rounds_ms": " ".join(f"{r:.3f}" for r in rounds),
            }
            rows.append(row)
            print(
                f"ATT {pattern} {n} {backend}: {ms:.3f} ms, {row['ratio']:.2f}x {backends[0]} [{row['choice']}] "
                f"(rounds: {row['rounds_ms']})",
                flush=True,
            )
        del prepared
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def rows_cell(reference: str, pattern: str, n: int, device: str) -> PreparedCell:
    """SDPA ``is_causal`` or FlexAttention (with flex's BlockMask), forward + backward, on the layout
    gtx hands its kernels: what separates a reference row from gtx's row beside it, the layout and
    the scaling, or gtx's own work."""
    from torch.nn.attention.flex_attention import flex_attention

    from gtx.backends.flex import block_mask
    from gtx.graph.spec import parse_pattern
    from gtx.measure.method import method_edges

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, 32, generator=gen).to(device).requires_grad_() for _ in range(3))
    grad = torch.randn(n, 4, 32, generator=gen).to(device)
    if reference == "sdpa":
        call = lambda q4, k4, v4: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=1.0)  # noqa: E731
    else:
        mask = block_mask(method_edges(parse_pattern(pattern), "ee", n, torch.device(device)))
        compiled = torch.compile(flex_attention, dynamic=False)
        call = lambda q4, k4, v4: compiled(q4, k4, v4, block_mask=mask, scale=1.0)  # noqa: E731

    def step():
        q.grad = k.grad = v.grad = None
        heads_first = [x.transpose(0, 1)[None] for x in (q * 32**-0.5, k, v)]
        call(*heads_first)[0].transpose(0, 1).backward(grad)

    return PreparedCell(pattern, torch.device(device), step, lambda: f"{reference} on rows", lambda: (0, 1, 1))


def train(device: str, context: int, specs: list[str]) -> list[dict]:
    cuda = torch.device(device).type == "cuda"
    rows = []
    for spec in specs:
        pattern, precision, profile = spec.split("/")
        backend = SkipAttention.name if pattern == "none" else "auto"
        settings = dict(MODEL, context=str(context), precision=precision)
        t = time.time()
        try:
            cell = TrainCell("text", "lm", "causal" if pattern == "none" else pattern, backend, settings, device=device)
            run = cell.resolve()
            trainer, _ = cell.build(run)
            data = first_batches(run, 8)
            _time_steps(trainer.train_epoch, data[:2], 1, run)
            base = reset_peak(device)
            _, seconds, data_s = _time_steps(trainer.train_epoch, data[2:6], 0, run)
            peak = peak_mb(device) - base
            rows.append(
                {"pattern": pattern, "precision": precision, "context": context, "step_ms": 250 * seconds}
                | {"data_ms": 250 * data_s, "peak_over_base_mb": peak}
            )
            print(
                f"TRAIN {pattern} {precision}: step {250 * seconds:.1f} ms, data {250 * data_s:.1f} ms, "
                f"peak over base {peak:.0f} MB ({time.time() - t:.0f} s)",
                flush=True,
            )
            if profile == "p":
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as profiler

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profiler(activities=activities) as p:
                    _time_steps(trainer.train_epoch, data[6:8], 0, run)
                table = p.key_averages()
                for key in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:
                    print(table.table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)
        except Exception as e:
            print(f"TRAIN {pattern} {precision}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["attention", "train"])
    parser.add_argument("specs", nargs="*", help="train: PATTERN/PRECISION/PROFILE per row")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_intermixed_args()
    for spec in args.specs:
        parts = spec.split("/")
        if len(parts) != 3 or parts[1] not in ("float32", "bfloat16") or parts[2] not in ("p", "-"):
            parser.error(f"a train row is PATTERN/PRECISION/PROFILE (e.g. local:w=256/bfloat16/-), not {spec!r}")
    started = time.time()
    rows = attention(args.device) if args.what == "attention" else train(args.device, args.context, args.specs)
    if args.csv:
        pd.DataFrame(rows).assign(device=torch.cuda.get_device_name() if "cuda" in args.device else args.device).to_csv(
            args.csv, index=False
        )
    print(f"{args.what} done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
