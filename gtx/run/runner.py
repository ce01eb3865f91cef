"""The runner: train and evaluate a run, checkpoint it, resume it; append its
results. Knows nothing of click. (A checkpoint evaluated: ``gtx.run.evaluation``.)

    from gtx.run.runner import RunConfig, run
    table = run(RunConfig(task="sort", model="ut", pattern="local:w=4", settings={"dim": "64"}))

A run writes, after every epoch, its checkpoint (``gtx.records.checkpoint``) and then its rows: a run
killed at any moment leaves a checkpoint holding at least the rows on disk, so ``resume`` never
duplicates or loses an epoch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from gtx.attention.module import Attention
from gtx.attention.trainable import check_untrained, stages_of
from gtx.data.batch import batches
from gtx.errors import GtxError, Interrupted
from gtx.files import NoSpace, check_space
from gtx.records import checkpoint, claims
from gtx.records.layout import ResultsFolder
from gtx.records.results import SCHEMA_VERSION, scalar_metrics, write_run
from gtx.records.run_config import DEFAULT_BACKEND, RunConfig
from gtx.records.runref import resolve_run
from gtx.run import distributed
from gtx.run.build import build_attention, build_model, checked_results_dir, new_run_id, result_row, versions
from gtx.run.config import (
    Resolved,
    cell_key,
    complete_note,
    resolve,
    resolve_configs,
    resolve_device,
)
from gtx.run.loggers import Loggers
from gtx.run.train import NonFiniteLoss, PhaseStats, Trainer, evaluate

__all__ = [
    "DEFAULT_BACKEND",
    "RunConfig",
    "RunInterrupted",
    "cell_key",
    "resolve",
    "resolve_configs",
    "resolve_device",
    "run",
]

#: ``progress(description, total, unit="batch")``: a callback to call after each of ``total`` units
Progress = Callable[..., Callable[[], None]]


class RunInterrupted(Interrupted):
    """Ctrl-C during a run: the epochs done are written; the message says how to resume."""


def _resume_state(run_id: str, results_dir: str) -> tuple[dict, RunConfig]:
    """The last checkpoint of an unfinished run, and its configuration (writing into ``results_dir``)."""
    if not run_id.strip():
        raise GtxError("--resume needs a run id; `gtx runs` lists the runs under --results")
    try:
        run_id = resolve_run(run_id, results_dir)  # a prefix or the 6-hex tail, as `gtx runs` prints it
    except GtxError as e:
        raise GtxError(f"--resume: {e}") from None
    path = checkpoint.checkpoint_dir(results_dir, run_id) / checkpoint.LAST
    if not path.is_file():
        folder = ResultsFolder(results_dir).checkpoints()
        known = sorted(p.parent.name for p in folder.glob(f"*/{checkpoint.LAST}"))
        raise GtxError(
            f"--resume {run_id}: no checkpoint of that run under {folder} (killed in its first epoch, "
            f"or removed); resumable runs there: {', '.join(known[-5:]) or '(none)'}"
        )
    state = checkpoint.load(path)
    checkpoint.require(state, path, checkpoint.RESUMABLE)
    try:
        checkpoint.owner(state, path)
    except GtxError as e:
        raise GtxError(f"--resume {run_id}: {e}") from None
    if any(row["split"] == "test" for row in checkpoint.rows_of(state)):
        raise GtxError(
            f"--resume {run_id}: that run is finished (it has test rows); start a new run, or gtx eval {path.parent / checkpoint.BEST}"
        )
    return state, dataclasses.replace(checkpoint.run_config(state), results_dir=results_dir)


@dataclasses.dataclass
class _Run:
    """A run's parts between its steps: what it trains, what it has written, where and to whom it speaks."""

    config: RunConfig
    resolved: Resolved
    world: distributed.World
    attention: Attention
    model: torch.nn.Module
    trainer: Trainer
    common: dict  # the columns every row of the run shares
    rows: list[dict]
    start: int  # the first epoch still to train
    best: float  # the lowest validation loss so far
    snapshot: dict | None  # the latest checkpoint's contents (the finished run's last.pt is it with the test rows)
    results_dir: Path
    say: Callable[[str], None]
    progress: Progress | None
    note: str | None = None  # the full-attention note, said at most once
    kept: int = 0  # the epoch its last.pt holds (0: none), what --resume continues after

    @property
    def checkpoints(self) -> Path:
        return checkpoint.checkpoint_dir(self.results_dir, self.common["run_id"])

    def tick(self, label: str, split: str, size: int) -> Callable[[], None]:
        """The progress callback of one phase (once per batch), on the main process."""
        if not (self.progress and self.world.main):
            return lambda: None
        return self.progress(label, -(-len(self.resolved.task.splits()[split]) // size))

    def samples(self, label: str) -> Callable[[int], Callable[[], None]]:
        """The progress of a phase's generation: given its count of samples, a callback per sample."""
        if not (self.progress and self.world.main):
            return lambda count: lambda: None
        return lambda count: self.progress(f"{label}: generation", count, "sample")

    def judge(self, phase: PhaseStats, epoch: int) -> None:
        """Say ``complete_note`` judged by the keys a phase read (patterns that choose or learn them), once."""
        if not self.note:
            when = f"in epoch {epoch}'s {phase.split or 'train'} phase"
            read = {stage: phase.density(stage) for stage in phase.edges}
            self.note = complete_note(self.resolved, read, when, stages_of(self.model))
            if self.note:
                self.say(self.note)


def _new_common(config: RunConfig, resolved: Resolved, model: torch.nn.Module, world) -> dict:
    run_id, started = world.broadcast(new_run_id(config.task, config.model))
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "started_at": started.isoformat(timespec="seconds"),
        "task": config.task,
        "model": config.model,
        "pattern": resolved.pattern_given.spec,
        "definitions": json.dumps(resolved.definitions),
        "cell": resolved.cell,
        "experiment": resolved.experiment,
        "eval_of": None,
        "backend": config.backend,
        "device": str(resolved.device),
        "seed": config.seed,
        "n_params": sum(p.numel() for p in model.parameters()),
        "config": json.dumps(resolved.as_dict(), sort_keys=True),
        **versions(),
    }


def _restore(state: dict, resolved: Resolved, trainer: Trainer, world) -> tuple[dict, list[dict], int, float]:
    """A checkpoint's training state loaded into ``trainer``: (common, rows, next epoch, best valid loss)."""
    trainer.load_state_dict(state)
    torch.set_rng_state(state["rng"][world.rank % len(state["rng"])])
    # a checkpoint from before schema 4 is rekeyed; one from before schema 6 gets the definitions it continues under
    keys = {
        "schema_version": SCHEMA_VERSION,
        "cell": resolved.cell,
        "experiment": resolved.experiment,
        "definitions": json.dumps(resolved.definitions),
    }
    common = {**json.loads(state["common"]), **keys}
    rows = [{**row, **keys} for row in checkpoint.rows_of(state)]
    return common, rows, state["epoch"] + 1, state["best_valid_loss"]


def _prepare(config: RunConfig, resume: str | None, progress, log) -> _Run:
    """Resolve, build and (for ``resume``) restore a run; check every place it writes; say what it is."""
    state = None
    if resume is not None:
        state, config = _resume_state(resume, config.results_dir)
    resolved = resolve(config)
    config = resolved.config  # its settings as resolved: what the checkpoint stores
    if not resolved.train.epochs and state is None:
        check_untrained(resolved.pattern_given, resolved.model_config, "--epochs 0")
    if resolved.train.epochs and not resolved.backend.trains_on(resolved.device):
        raise GtxError(
            f"backend {config.backend!r} has no backward on {resolved.device}, so it cannot train; train with --backend "
            f"auto and evaluate under {config.backend!r} (gtx eval RUN --backend {config.backend}), or run --epochs 0"
        )
    world, resolved.device = distributed.setup(resolved.device)
    torch.manual_seed(config.seed)
    attention = build_attention(resolved)
    path = getattr(resolved.model_config, "path", "")
    if path and world.main:  # reading (and dequantizing) a pretrained model's weights takes seconds: said first
        log(f"loading model {config.model} from {path}")
    model = build_model(resolved, attention)
    width = getattr(resolved.model_config, "dim", 128)
    trainer = Trainer(model, resolved.train, width, resolved.device, resolved.task, world)
    if state:
        last = checkpoint.checkpoint_dir(config.results_dir, resume) / checkpoint.LAST
        checkpoint.check_vocab(state, resolved.task, last)
        checkpoint.check_definitions(state, resolved.definitions, last)
        common, rows, start, best = _restore(state, resolved, trainer, world)
    else:
        if world.rank:  # dropout masks differ between ranks, as they would between the examples of one process
            torch.manual_seed(config.seed * 100_003 + world.rank)
        common, rows, start, best = _new_common(config, resolved, model, world), [], 1, float("inf")
    results_dir = checked_results_dir(config.results_dir, common["run_id"])  # checked before it trains
    say = log if world.main else (lambda s: None)
    say(
        f"run {common['run_id']}{f' (resumed at epoch {start})' if state else ''}: task {config.task}, "
        f"model {config.model} ({common['n_params']:,} parameters), pattern {resolved.pattern_run.spec}, "
        f"backend {config.backend}, device {resolved.device}" + (f", {world.size} processes" if world.size > 1 else "")
    )
    run = _Run(
        config, resolved, world, attention, model, trainer, common, rows, start, best, state, results_dir, say, progress
    )
    run.kept = start - 1
    if resolved.train.epochs and world.main:  # a full device is refused before an epoch is trained for nothing
        check_space(results_dir, 3 * sum(p.numel() * p.element_size() for p in model.parameters()))
    run.note = complete_note(resolved)
    if run.note:
        say(run.note)
    return run


def _epoch(run: _Run, epoch: int) -> list[dict]:
    """Train one epoch (none for epoch 0: the untrained model, scored) and validate: the new rows."""
    resolved, train, new = run.resolved, run.resolved.train, []
    if epoch:
        shuffled = batches(
            resolved.task,
            "train",
            resolved.pattern_run,
            train.batch_size,
            shuffle_seed=run.config.seed * 10_007 + epoch,
            part=(run.world.rank, run.world.size),
        )
        phase = run.trainer.train_epoch(shuffled, run.tick(f"epoch {epoch}/{train.epochs}", "train", train.batch_size))
        run.judge(phase, epoch)
        new.append(result_row(run.common, epoch, "train", phase, run.attention, stages_of(run.model)))
        run.say(
            f"epoch {epoch}: train loss {new[0]['loss']:.4f} acc {new[0]['token_acc']:.4f} "
            f"({new[0]['tokens_per_s']:,.0f} tokens/s)"
        )
    # every rank evaluates the whole split: no coordination, and every rank's model is the same
    valid = evaluate(
        run.model,
        resolved.task,
        batches(resolved.task, "valid", resolved.pattern_run, train.eval_batch_size),
        resolved.pattern_run,
        resolved.device,
        decode_limit=train.decode_valid,
        precision=train.precision,
        on_batch=run.tick(f"epoch {epoch} valid", "valid", train.eval_batch_size),
        on_sample=run.samples(f"epoch {epoch} valid"),
        decode_pattern=resolved.decode,
    )
    run.judge(valid, epoch)
    new.append(result_row(run.common, epoch, "valid", valid, run.attention, stages_of(run.model)))
    _finite(run, new[-1])
    run.say(
        f"epoch {epoch}: valid loss {new[-1]['loss']:.4f} acc {new[-1]['token_acc']:.4f} "
        + " ".join(f"{k} {v:.4f}" for k, v in scalar_metrics(valid.extra).items())
    )
    return new


def _finite(run: _Run, row: dict) -> None:
    """Refuse an evaluation's NaN or infinite loss (the last steps left the weights non-finite)
    before its row or a checkpoint of those weights is written over the last good ones."""
    if not math.isfinite(row["loss"]):
        raise NonFiniteLoss(run.trainer.step, row["loss"], row["split"])


def _save_epoch(run: _Run, epoch: int, new: list[dict], loggers: Loggers) -> None:
    """Checkpoint (best on a new lowest validation loss, then last), then the rows: on disk, a
    checkpoint always holds at least the rows written, and best.pt is never older than the
    best_valid_loss last.pt records (a run stopped between the two redoes the epoch on resume)."""
    run.rows += new
    best_now = new[-1]["loss"] < run.best
    run.best = min(run.best, new[-1]["loss"])
    rng = run.world.gather(torch.get_rng_state())
    if not (run.world.main and epoch):
        return
    task = run.resolved.task
    run.snapshot = {
        **run.trainer.state_dict(),
        "run_config": dataclasses.asdict(run.config),
        "common": json.dumps(run.common),
        "epoch": epoch,
        "rows": json.dumps(run.rows),
        "best_valid_loss": run.best,
        "rng": rng,
        "vocab": {"src": task.src_vocab.itos, "tgt": task.tgt_vocab.itos},
    }
    if best_now:
        checkpoint.save(run.checkpoints / checkpoint.BEST, run.snapshot)
    checkpoint.save(run.checkpoints / checkpoint.LAST, run.snapshot)
    run.kept = epoch
    write_run(run.results_dir, run.common["run_id"], run.rows)
    loggers.call("epoch_end", epoch, new)


def _test(run: _Run, last: int) -> None:
    """Score the test split, labelled with the last epoch that trained; write the rows, then mark the checkpoint finished."""
    resolved = run.resolved
    test = evaluate(
        run.model,
        resolved.task,
        batches(resolved.task, "test", resolved.pattern_run, resolved.train.eval_batch_size),
        resolved.pattern_run,
        resolved.device,
        beam=getattr(resolved.task_config, "beam", 1),
        precision=resolved.train.precision,
        on_batch=run.tick("test", "test", resolved.train.eval_batch_size),
        on_sample=run.samples("test"),
        decode_pattern=resolved.decode,
    )
    run.rows.append(result_row(run.common, last, "test", test, run.attention, stages_of(run.model)))
    _finite(run, run.rows[-1])
    if run.world.main:  # the results first: a run killed between the two is complete to a sweep, never 'finished' yet missing its test rows
        write_run(run.results_dir, run.common["run_id"], run.rows)
        if run.snapshot is not None:
            checkpoint.save(run.checkpoints / checkpoint.LAST, {**run.snapshot, "rows": json.dumps(run.rows)})


def run(
    config: RunConfig,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda s: None,
    resume: str | None = None,
) -> pd.DataFrame:
    """Train and evaluate one run; append its rows under ``config.results_dir``; return them.

    ``resume``: a run id under ``config.results_dir`` to continue from its last checkpoint (its
    configuration comes from the checkpoint). ``progress(description, total)`` may return a
    per-batch callback (the CLI's progress bar). Under torchrun, every rank calls this; rank 0 writes.
    """
    run = _prepare(config, resume, progress, log)
    if not run.world.main:
        return _train_and_test(run, config)
    with claims.run_lock(run.checkpoints, run.common["run_id"], run.results_dir):  # one process trains a run
        return _train_and_test(run, config)


def _train_and_test(run: _Run, config: RunConfig) -> pd.DataFrame:
    """``run``'s epochs from its start, then its test split; what stops it is one line."""
    run_id, epochs = run.common["run_id"], run.resolved.train.epochs
    loggers = Loggers(config.loggers if run.world.main else [], run_id, run.results_dir)
    loggers.call("start", json.loads(run.common["config"]))
    # last: the latest epoch that trained (--max-steps can stop inside one), what the test row is labelled
    epoch = last = run.start - 1
    where = f"in epoch {run.start}"
    status = "failed"
    run.attention.reset_choices(), run.attention.take_reads(), run.attention.reset_stats()
    try:
        for epoch in range(run.start, epochs + 1) if epochs else [0]:
            if run.trainer.done:
                break
            where = f"in epoch {epoch}"
            _save_epoch(run, epoch, _epoch(run, epoch), loggers)
            last = epoch
        where = "in its test phase"
        _test(run, last)
        status = "finished"
    except NonFiniteLoss as e:
        done = last if e.split == "test" else epoch - 1  # the test split runs after the last epoch is written
        kept = (
            f"epochs up to {done} and their checkpoint are kept under {run.results_dir}"
            if done >= run.start
            else "nothing new was written"
        )
        fix = (
            "no update has run yet, so the learning rate is not the cause: check the attention (try --backend dense)"
            if e.split == "train" and e.step == 1
            else "lower --set lr_factor, or raise --set warmup"
        )
        raise GtxError(f"run {run_id} stopped in epoch {epoch}: {e}; {kept}; {fix}") from None
    except NoSpace as e:
        kept = (
            f"epochs up to {run.kept} are kept in its checkpoint; free space there, then continue with: "
            f"gtx run --resume {run_id} --results {run.results_dir}"
            if run.kept
            else "nothing of it is kept; free space there, then run it again"
        )
        raise GtxError(f"run {run_id} stopped {where}: no space left on the device of {e.folder}; {kept}") from None
    except KeyboardInterrupt:
        status = "interrupted"
        raise RunInterrupted(
            f"run {run_id} interrupted in epoch {epoch}: epochs up to {epoch - 1} are written; "
            f"continue with: gtx run --resume {run_id} --results {run.results_dir}"
        ) from None
    finally:
        loggers.call("end", run.rows, status)
    return pd.DataFrame(run.rows)
