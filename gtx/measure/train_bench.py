"""``gtx bench train``: training tokens/s per (pattern, backend) on the same batches, beside the
model's plain-torch references and its attention-free ceiling."""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import pandas as pd

from gtx.backends import Backend
from gtx.errors import GtxError
from gtx.measure.bench import sync_device

TRAIN_COLUMNS = [
    "task",
    "model",
    "pattern",
    "backend",
    "tokens_per_s",
    "vs_reference",
    "ceiling_share",
    "step_ms",
    "attention_ms",
    "data_ms",
    "peak_mem_mb",
    "steps",
    "rounds",
    "device",
    "choice",
]


@dataclass
class TrainBench:
    """What ``bench_train`` times: each of ``patterns`` (specs) x ``backends`` on ``task`` and ``model``
    under ``settings`` (``--set``), ``rounds`` interleaved rounds of ``steps`` timed steps (the first
    round after ``warmup_steps`` untimed ones); with ``bound`` the attention-free ceiling, with
    ``baseline`` the plain-torch references; with ``memory`` each row's peak memory over
    ``memory_steps`` steps in a fresh subprocess (at most ``timeout_s`` seconds each)."""

    task: str = "copy"
    model: str = "transformer"
    patterns: tuple[str, ...] | str = ("full",)
    backends: tuple[str, ...] = ("auto",)
    steps: int = 30
    warmup_steps: int = 3
    settings: dict | None = None
    device: str = "cpu"
    baseline: bool = True
    bound: bool = True
    rounds: int = 3
    memory: bool = False
    memory_steps: int = 3
    plugins_dirs: tuple = ()
    timeout_s: float = 900


@dataclass
class _Variant:
    """One row of ``bench_train``, built and timed in this process."""

    cell: object  # its gtx.measure.reference.TrainCell
    fields: dict  # the row's model, pattern and backend columns
    group: str  # the model variant it is compared within
    role: str  # gtx, bound or reference
    trainer: object
    backend: Backend | None
    run: object  # its ``Resolved``: task, device and the pattern its batches are built under


def bench_train(bench: TrainBench, log=lambda s: None) -> pd.DataFrame:
    """Training tokens/s (target tokens per second of wall time, graph building included) per
    pattern and backend, on the same batches, beside plain-torch references.

    Rows per model variant (ut: also with halting off): each pattern x backend; with ``bound`` the
    model with attention skipped (``SkipAttention``, graphs under NO_EDGES): the ceiling for any
    backend; with ``baseline`` the model's plain-torch references (``gtx.measure.reference.references``:
    transformer: torch.nn.Transformer; lm: SDPA is_causal, and SDPA with the bool mask of each
    pattern but full/causal). Every variant is built first, then timed in interleaved rounds (a
    variant's round runs after every other variant's previous round), so that a slow spell of a
    shared machine hits all alike; a row reports its median round.

    ``vs_reference``: tokens/s over the first reference's; ``ceiling_share``: the part of the
    possible gain reached, (row - reference) / (bound - reference) in tokens/s, NaN without both,
    where the bound is not faster, and for a row faster than its bound (the run's noise larger than
    its attention's cost; logged); ``data_ms``: the part of a step spent building batches and graphs
    (edges are built when a backend first reads them, in the step; the bound reads none);
    ``attention_ms``: the step minus the bound's (rows of the bound's model; NaN for a row faster
    than its bound);
    ``peak_mem_mb`` (``memory``): ``gtx.measure.reference.train_cell_memory`` per variant in a
    fresh subprocess after the timed rounds (NaN without ``memory``)."""
    from gtx.measure.reference import SkipAttention, first_batches, memory_in_subprocess

    variants = _variants(bench)
    if not variants:
        raise GtxError("bench train: nothing to time; give --backends, or keep --bound or --baseline")
    data = first_batches(variants[0].run, bench.steps + bench.warmup_steps)
    rows = _rows(bench, variants, *_time_rounds(bench, variants, data, log), len(data) - bench.warmup_steps)
    if bench.memory:
        for v, row in zip(variants, rows):
            row["peak_mem_mb"], why = memory_in_subprocess(v.cell, bench.memory_steps, bench.timeout_s)
            log(
                f"memory  {v.fields['model']:<12} {v.fields['pattern']:<14} {v.fields['backend']:<20} "
                f"{row['peak_mem_mb']:9.1f} MB  {why}"
            )
    df = pd.DataFrame(rows)
    floor = df[df.backend == SkipAttention.name].set_index("model").step_ms
    df["attention_ms"] = df.step_ms - df.model.map(floor)
    # a row faster than its model without attention: the run's noise exceeded that row's attention, and
    # the ceiling was no bound; what would be derived from it is left empty, not written
    beaten = df.attention_ms < 0
    for row in df[beaten].itertuples():
        log(
            f"ceiling: {row.model} {row.pattern} {row.backend} ran faster ({row.step_ms:,.1f} ms a step) than the model "
            f"without attention ({floor[row.model]:,.1f} ms): the run's noise exceeds its attention's cost; its "
            "attention_ms and ceiling_share are left empty (rerun with more --steps or --rounds)"
        )
    df.loc[beaten, ["attention_ms", "ceiling_share"]] = float("nan")
    return df.reindex(columns=TRAIN_COLUMNS)


def _variants(bench: TrainBench) -> list[_Variant]:
    """Every row's model, built in this process: per model variant, the gtx rows, the bound, the references."""
    from gtx.graph.spec import parse_pattern
    from gtx.measure.reference import NO_EDGES, TORCH_TRANSFORMER, SkipAttention, TrainCell, references
    from gtx.plugins.registry import MODELS
    from gtx.run.runner import resolve_device

    patterns = [bench.patterns] if isinstance(bench.patterns, str) else bench.patterns
    specs = [parse_pattern(p).spec for p in patterns]
    dev, dirs = str(resolve_device(bench.device)), tuple(map(str, bench.plugins_dirs))
    task, model, variants = bench.task, bench.model, []

    def add(cell, fields, group, role):
        resolved = cell.resolve()
        variant = _Variant(cell, {**fields, "backend": cell.backend}, group, role, *cell.build(resolved), resolved)
        variants.append(variant)

    model_cls = MODELS.get(model).obj
    for label, extra in [("", {}), *getattr(model_cls, "bench_variants", {}).items()]:
        group, sets = model + label, {**(bench.settings or {}), **extra}
        for spec in specs:
            for b in bench.backends:
                add(TrainCell(task, model, spec, b, sets, dev, dirs), {"model": group, "pattern": spec}, group, "gtx")
        skip = TrainCell(task, model, NO_EDGES, SkipAttention.name, sets, dev, dirs)
        if bench.bound:
            add(skip, {"model": group, "pattern": "-"}, group, "bound")
        if bench.baseline:
            mine = [v.run for v in variants if v.group == group]
            config = (mine[0] if mine else skip.resolve()).model_config
            for kind, spec in references(model_cls, config, specs):
                fields = {"model": group, "pattern": spec}
                if kind == TORCH_TRANSFORMER:  # another implementation, not the bound's model: no attention_ms
                    fields = {"model": "torch.nn.Transformer", "pattern": "full (padded, masked)"}
                add(TrainCell(task, model, spec, kind, sets, dev, dirs), fields, group, "reference")
    return variants


def _time_rounds(bench: TrainBench, variants: list[_Variant], data: list, log) -> tuple[list, list]:
    """Per variant, (tokens, wall_s, data_s) of each round and the backend's choices, counted."""
    timings = [[] for _ in variants]
    choices = [{} for _ in variants]
    for round_ in range(bench.rounds):
        warmup = bench.warmup_steps if round_ == 0 else 0
        for v, times, chosen in zip(variants, timings, choices):
            if v.backend is not None:
                v.backend.reset_choices()  # one backend object serves every variant that names it
            times.append(_time_steps(v.trainer.train_epoch, data[bench.warmup_steps - warmup :], warmup, v.run))
            for stage, counts in (v.backend.reset_choices() if v.backend is not None else {}).items():
                chosen.setdefault(stage, Counter()).update(counts)
            tokens, wall, _ = times[-1]
            log(
                f"round {round_ + 1}/{bench.rounds}  {v.fields['model']:<12} {v.fields['pattern']:<14} "
                f"{v.fields['backend']:<20} {tokens / wall:10,.0f} tokens/s"
            )
    return timings, choices


def _rows(bench: TrainBench, variants: list[_Variant], timings: list, choices: list, n: int) -> list[dict]:
    """Each variant's median round as a row, with its ratios to its group's reference and bound."""
    rows = []
    for v, times, chosen in zip(variants, timings, choices):
        tokens, wall, data_s = times[0][0], *(statistics.median(t[i] for t in times) for i in (1, 2))
        rows.append(
            {
                "task": bench.task,
                **v.fields,
                "tokens_per_s": tokens / wall,
                "step_ms": 1000 * wall / n,
                "data_ms": 1000 * data_s / n,
                "peak_mem_mb": float("nan"),
                "steps": n,
                "rounds": bench.rounds,
                "device": str(v.run.device),
                "choice": json.dumps(chosen) if v.backend is not None else "",
            }
        )
    for group in dict.fromkeys(v.group for v in variants):
        members = [(v, row) for v, row in zip(variants, rows) if v.group == group]
        ref, top = (
            next((row["tokens_per_s"] for v, row in members if v.role == role), float("nan"))
            for role in ("reference", "bound")
        )
        for _, row in members:
            row["vs_reference"] = row["tokens_per_s"] / ref
            row["ceiling_share"] = (row["tokens_per_s"] - ref) / (top - ref) if top > ref else float("nan")
    return rows


def _time_steps(epoch, data, warmup_steps, resolved):
    """Run the first ``warmup_steps`` batches untimed, then time the rest. Every batch is rebuilt
    from its examples with the run's pattern, inside the timed region, so that data cost is counted.
    ``epoch`` (``Trainer.train_epoch``) takes the timed batches as one pass, as training does: what
    a pass sets up once (train mode, its meters) is not charged to every step."""
    from gtx.data.batch import make_batch

    tokens, data_s = 0, 0.0

    def fresh(batches, timed):
        nonlocal tokens, data_s
        for batch in batches:
            d0 = time.perf_counter()
            built = make_batch(resolved.task, batch.split, batch.index, resolved.pattern)
            if timed:
                data_s += time.perf_counter() - d0
                tokens += built.n_tokens
            yield built

    if warmup_steps:
        epoch(fresh(data[:warmup_steps], False))
    sync_device(resolved.device)
    t0 = time.perf_counter()
    epoch(fresh(data[warmup_steps:], True))
    sync_device(resolved.device)
    return tokens, time.perf_counter() - t0, data_s
