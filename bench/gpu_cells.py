"""Attention cells and training steps timed in one process, for a card lent for minutes.

    python bench/gpu_cells.py attention [--device cuda]
    python bench/gpu_cells.py train [--device cuda] [--context 16384] SPEC...

``gtx bench attention`` and ``gtx bench train`` run every row in a fresh process (so that each
row's peak memory is its own); on a GPU each such process compiles FlexAttention again, 5-15 s a
row. This script calls the same measurements (``run_attention_cell``, the training bench's
``_time_steps``) for every row in one process, so a row costs its own time, and prints a line per row.

``attention``: forward + backward of one sequence (4 heads of 32, float32; median of 10 after 2
warm-up calls) of ``local:w=256`` at 4096, 16384 and 65536 tokens, ``bigbird`` at 16384 and 65536,
and ``causal`` at 16384, each on FlexAttention called directly with flex's BlockMask, ``flex``,
``auto`` and SDPA (the masked SDPA up to 16384 tokens).

``train``: the CPU tables' model (``lm``: 2 layers, 4 heads, dim 128, dim_ff 512, one sequence of
``--context`` tokens of ``text``), per SPEC ``PATTERN/PRECISION/PROFILE``: ``PATTERN`` (``none``: the
attention-free ceiling), ``float32`` or ``bfloat16``, ``p`` to print a profile of two more steps or
``-``. Each row: step time (mean of 4 steps after 2 untimed), the batches' build time within it, and
the peak memory over what the model held before the steps.
"""

from __future__ import annotations

import argparse
import time

import torch

from gtx.measure.bench import AttentionCell, run_attention_cell
from gtx.measure.reference import SkipAttention, TrainCell, first_batches
from gtx.measure.train_bench import _time_steps
from gtx.memory import peak_mb, reset_peak

ATTENTION = (
    [("local:w=256", n, b) for n in (4096, 16384) for b in ("flexattention", "flex", "auto", "sdpa")]
    + [("local:w=256", 65536, b) for b in ("flexattention", "flex", "auto")]
    + [("bigbird", n, b) for n in (16384, 65536) for b in ("flexattention", "flex", "auto")]
    + [("causal", 16384, b) for b in ("sdpa", "auto")]
)
MODEL = {"layers": "2", "heads": "4", "dim": "128", "dim_ff": "512", "batch_size": "1"}


def attention(device: str) -> None:
    for pattern, n, backend in ATTENTION:
        t = time.time()
        try:
            r = run_attention_cell(AttentionCell(pattern, n, backend, device=device, repeats=10, warmup=2))
            print(
                f"ATT {pattern} {n} {backend}: {r['ms']:.3f} ms first {r['first_ms']:.0f} ms "
                f"peak {r['peak_mem_mb']:.0f} MB {r['choice']} ({time.time() - t:.0f} s)",
                flush=True,
            )
        except Exception as e:  # a row that fails is reported, and the others still run
            print(f"ATT {pattern} {n} {backend}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)


def train(device: str, context: int, specs: list[str]) -> None:
    cuda = torch.device(device).type == "cuda"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["attention", "train"])
    parser.add_argument("specs", nargs="*", help="train: PATTERN/PRECISION/PROFILE per row")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=16384)
    args = parser.parse_intermixed_args()
    for spec in args.specs:
        parts = spec.split("/")
        if len(parts) != 3 or parts[1] not in ("float32", "bfloat16") or parts[2] not in ("p", "-"):
            parser.error(f"a train row is PATTERN/PRECISION/PROFILE (e.g. local:w=256/bfloat16/-), not {spec!r}")
    started = time.time()
    if args.what == "attention":
        attention(args.device)
    else:
        train(args.device, args.context, args.specs)
    print(f"{args.what} done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
