"""The runner: train and evaluate a run, checkpoint it, resume it, evaluate a checkpoint; append
results. Knows nothing of click.

    from gtx.experiments.runner import RunConfig, run
    table = run(RunConfig(task="sort", model="ut", pattern="local:w=4", settings={"dim": "64"}))

A run writes, after every epoch, its checkpoint (``gtx.experiments.checkpoint``) and then its rows: a run
killed at any moment leaves a checkpoint holding at least the rows on disk, so ``resume`` never
duplicates or loses an epoch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

import gtx
from gtx.attention.module import Attention
from gtx.attention.trainable import check_untrained, stages_of
from gtx.backends import get_backend
from gtx.data.batch import batches
from gtx.data.task import SPLITS
from gtx.errors import GtxError, Interrupted, PluginError, plugin_code
from gtx.experiments import checkpoint, distributed
from gtx.experiments.config import (
    DEFAULT_BACKEND,
    Resolved,
    RunConfig,
    cell_key,
    complete_note,
    resolve,
    resolve_configs,
    resolve_device,
)
from gtx.experiments.loggers import Loggers
from gtx.experiments.results import SCHEMA_VERSION, metrics_json, scalar_metrics, write_run
from gtx.experiments.runref import find_checkpoint, resolve_run
from gtx.experiments.train import NonFiniteLoss, PhaseStats, Trainer, evaluate
from gtx.files import check_writable, writable_dir
from gtx.plugins.registry import MODELS

__all__ = [
    "DEFAULT_BACKEND",
    "RunConfig",
    "RunInterrupted",
    "cell_key",
    "evaluate_checkpoint",
    "resolve",
    "resolve_configs",
    "resolve_device",
    "run",
]

Progress = Callable[[str, int], Callable[[], None]]


class RunInterrupted(Interrupted):
    """Ctrl-C during a run: the epochs done are written; the message says how to resume."""


def _versions() -> dict[str, str]:
    from gtx.backends.dgl_compat import import_dgl

    try:
        dgl_version = import_dgl().__version__
    except ImportError:
        dgl_version = "unavailable"
    return {"gtx_version": gtx.__version__, "torch_version": torch.__version__, "dgl_version": dgl_version}


def _results_dir(name: str, run_id: str | None = None) -> Path:
    """The results folder, created; the places a run writes to later (``runs/`` and, for ``run_id``,
    its checkpoint folder) checked before the first step, so no trained epoch is lost to them."""
    results_dir = writable_dir(Path(name))
    check_writable(results_dir / "runs", "results folder")
    if run_id:
        check_writable(checkpoint.checkpoint_dir(results_dir, run_id), "checkpoint folder")
    return results_dir


def build_attention(r, backend: str) -> Attention:
    """The run's backend, with its pattern's run-time parts (head groups, biases, selections, trainable attention)."""
    heads, dim = getattr(r.model_config, "heads", None), getattr(r.model_config, "dim", None)
    return Attention.for_width(get_backend(backend, r.device), r.pattern, heads, dim)


def build_model(r, attention: Attention) -> torch.nn.Module:
    who = f"model {r.config.model!r} ({MODELS.get(r.config.model).plugin})"
    with plugin_code(who, "while being built", settings=f"model {r.config.model!r}"):
        model = r.model_cls(r.model_config, r.task.src_vocab, r.task.tgt_vocab, attention)
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"{who} built a {type(model).__name__}; expected a torch.nn.Module")
    model.plugin_label = who  # what checks.model_output names
    return model.to(r.device)


def _new_run_id(task: str, model: str, kind: str = "") -> tuple[str, dt.datetime]:
    started = dt.datetime.now(dt.timezone.utc)
    return f"{started:%Y%m%d-%H%M%S}-{task}-{model}{kind}-{uuid.uuid4().hex[:6]}", started


def _row(common: dict, epoch: int, split: str, stats: PhaseStats, attention: Attention) -> dict:
    extra = {**stats.extra, **attention.reset_stats()}  # trainable attention's losses and kept edges per branch
    return {
        **common,
        "epoch": epoch,
        "split": split,
        **stats.row(),
        "seq_acc": extra.pop("seq_acc", float("nan")),
        "metrics": metrics_json(extra),
        "backend_plan": json.dumps(attention.reset_choices(), sort_keys=True),
    }


def _ran_note(r: Resolved, phase: PhaseStats, say, epoch: int, model) -> str | None:
    """``complete_note`` judged by the keys a phase read (patterns that choose or learn them); said once."""
    when = f"in epoch {epoch}'s {phase.split or 'train'} phase"
    note = complete_note(r, {s: phase.density(s) for s in phase.edges}, when, stages_of(model))
    if note:
        say(note)
    return note


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
        known = sorted(p.parent.name for p in (Path(results_dir) / "checkpoints").glob(f"*/{checkpoint.LAST}"))
        raise GtxError(
            f"--resume {run_id}: no checkpoint of that run under {Path(results_dir) / 'checkpoints'} (killed in its first epoch, "
            f"or removed); resumable runs there: {', '.join(known[-5:]) or '(none)'}"
        )
    state = checkpoint.load(path)
    owner = json.loads(state["common"])["run_id"]
    if owner != run_id:
        raise GtxError(
            f"--resume {run_id}: {path} is a checkpoint of run {owner}, not of {run_id}; resume {owner} from its own folder"
        )
    if any(row["split"] == "test" for row in checkpoint.rows_of(state)):
        raise GtxError(
            f"--resume {run_id}: that run is finished (it has test rows); start a new run, or gtx eval {path.parent / checkpoint.BEST}"
        )
    return state, RunConfig(**{**state["run_config"], "results_dir": results_dir})


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
    state = None
    if resume is not None:
        state, config = _resume_state(resume, config.results_dir)
    r = resolve(config)
    if not r.train.epochs and state is None:
        check_untrained(r.chosen, r.model_config, "--epochs 0")
    world, r.device = distributed.setup(r.device)
    torch.manual_seed(config.seed)
    attention = build_attention(r, config.backend)
    model = build_model(r, attention)
    trainer = Trainer(model, r.train, getattr(r.model_config, "dim", 128), r.device, r.task, world)
    if state:
        checkpoint.check_vocab(state, r.task, checkpoint.checkpoint_dir(config.results_dir, resume) / checkpoint.LAST)
        trainer.load_state_dict(state)
        torch.set_rng_state(state["rng"][world.rank % len(state["rng"])])
        common, rows, start, best = (
            json.loads(state["common"]),
            checkpoint.rows_of(state),
            state["epoch"] + 1,
            state["best_valid_loss"],
        )
        # a checkpoint from before schema 4 is rekeyed
        keys = {
            "schema_version": SCHEMA_VERSION,
            "cell": r.cell,
            "experiment": r.experiment,
        }
        common, rows = {**common, **keys}, [{**row, **keys} for row in rows]
        run_id = common["run_id"]
    else:
        if world.rank:  # dropout masks differ between ranks, as they would between the examples of one process
            torch.manual_seed(config.seed * 100_003 + world.rank)
        run_id, started = world.broadcast(_new_run_id(config.task, config.model))
        common = {
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "started_at": started.isoformat(timespec="seconds"),
            "task": config.task,
            "model": config.model,
            "pattern": r.chosen.spec,
            "cell": r.cell,
            "experiment": r.experiment,
            "eval_of": None,
            "backend": config.backend,
            "device": str(r.device),
            "seed": config.seed,
            "n_params": sum(p.numel() for p in model.parameters()),
            "config": json.dumps(r.as_dict(), sort_keys=True),
            **_versions(),
        }
        rows, start, best = [], 1, float("inf")
    results_dir = _results_dir(config.results_dir, run_id)  # every place this run writes, checked before it trains
    say = log if world.main else (lambda s: None)
    ckpt_dir = checkpoint.checkpoint_dir(results_dir, run_id)
    loggers = Loggers(config.loggers if world.main else [], run_id, results_dir)
    say(
        f"run {run_id}{f' (resumed at epoch {start})' if state else ''}: task {config.task}, model {config.model} "
        f"({common['n_params']:,} parameters), pattern {r.pattern.spec}, backend {config.backend}, device {r.device}"
        + (f", {world.size} processes" if world.size > 1 else "")
    )
    note = complete_note(r)
    if note:
        say(note)
    loggers.call("start", json.loads(common["config"]))

    def tick(label: str, split: str, size: int):
        """The progress callback of one phase (once per batch), on the main process."""
        return progress(label, -(-len(r.task.splits()[split]) // size)) if progress and world.main else (lambda: None)

    part = (world.rank, world.size)
    # last: the latest epoch that trained (--max-steps can stop inside one), what the test row is labelled
    epoch = last = start - 1
    status = "failed"
    snapshot = state  # the latest checkpoint's contents: the finished run's last.pt is it with the test rows
    attention.reset_choices(), attention.take_reads(), attention.reset_stats()
    try:
        # epoch 0: the model untrained, scored
        for epoch in range(start, r.train.epochs + 1) if r.train.epochs else [0]:
            if trainer.done:
                break
            new = []
            if epoch:
                shuffled = batches(
                    r.task, "train", r.pattern, r.train.batch_size, shuffle_seed=config.seed * 10_007 + epoch, part=part
                )
                phase = trainer.train_epoch(
                    shuffled, tick(f"epoch {epoch}/{r.train.epochs}", "train", r.train.batch_size)
                )
                note = note or _ran_note(r, phase, say, epoch, model)
                new.append(_row(common, epoch, "train", phase, attention))
                say(
                    f"epoch {epoch}: train loss {new[0]['loss']:.4f} acc {new[0]['token_acc']:.4f} ({new[0]['tokens_per_s']:,.0f} tokens/s)"
                )
            # every rank evaluates the whole split: no coordination, and every rank's model is the same
            valid = evaluate(
                model,
                r.task,
                batches(r.task, "valid", r.pattern, r.train.eval_batch_size),
                r.pattern,
                r.device,
                decode_limit=r.train.decode_valid,
                precision=r.train.precision,
                on_batch=tick(f"epoch {epoch} valid", "valid", r.train.eval_batch_size),
            )
            note = note or _ran_note(r, valid, say, epoch, model)
            new.append(_row(common, epoch, "valid", valid, attention))
            rows += new
            best_now = new[-1]["loss"] < best
            best = min(best, new[-1]["loss"])
            rng = world.gather(torch.get_rng_state())
            if world.main and epoch:
                snapshot = {
                    **trainer.state_dict(),
                    "run_config": dataclasses.asdict(config),
                    "common": json.dumps(common),
                    "epoch": epoch,
                    "rows": json.dumps(rows),
                    "best_valid_loss": best,
                    "rng": rng,
                    "vocab": {"src": r.task.src_vocab.itos, "tgt": r.task.tgt_vocab.itos},
                }
                checkpoint.save(ckpt_dir / checkpoint.LAST, snapshot)
                if best_now:
                    checkpoint.save(ckpt_dir / checkpoint.BEST, snapshot)
                write_run(results_dir, run_id, rows)
                loggers.call("epoch_end", epoch, new)
            last = epoch
            say(
                f"epoch {epoch}: valid loss {new[-1]['loss']:.4f} acc {new[-1]['token_acc']:.4f} "
                + " ".join(f"{k} {v:.4f}" for k, v in scalar_metrics(valid.extra).items())
            )
        beam = getattr(r.task_config, "beam", 1)
        test = evaluate(
            model,
            r.task,
            batches(r.task, "test", r.pattern, r.train.eval_batch_size),
            r.pattern,
            r.device,
            beam=beam,
            precision=r.train.precision,
            on_batch=tick("test", "test", r.train.eval_batch_size),
        )
        rows.append(_row(common, last, "test", test, attention))
        if world.main:  # the results first: a run killed between the two is complete to a sweep, never 'finished' yet missing its test rows
            write_run(results_dir, run_id, rows)
            if snapshot is not None:
                checkpoint.save(ckpt_dir / checkpoint.LAST, {**snapshot, "rows": json.dumps(rows)})  # finished
        status = "finished"
    except NonFiniteLoss as e:
        kept = (
            f"epochs up to {epoch - 1} and their checkpoint are kept under {results_dir}"
            if epoch > start
            else "nothing new was written"
        )
        raise GtxError(
            f"run {run_id} stopped: training loss is {e.value} at epoch {epoch}, step {e.step}; {kept}; "
            "lower --set lr_factor, or raise --set warmup"
        ) from None
    except KeyboardInterrupt:
        status = "interrupted"
        raise RunInterrupted(
            f"run {run_id} interrupted in epoch {epoch}: epochs up to {epoch - 1} are written; "
            f"continue with: gtx run --resume {run_id} --results {results_dir}"
        ) from None
    finally:
        loggers.call("end", rows, status)
    return pd.DataFrame(rows)


def trained_model(path: Path, state: dict, config: RunConfig) -> tuple[torch.nn.Module, Resolved, Attention]:
    """A checkpoint's model rebuilt under ``config`` (the run's own, or another pattern, backend or
    device) with its weights loaded: (model, its resolved configuration, its Attention). The one path
    from a checkpoint to a model (eval, plots, probes); a vocabulary or a shape that does not fit is
    one line."""
    r = resolve(config)
    checkpoint.check_vocab(state, r.task, path)
    attention = build_attention(r, config.backend)
    model = build_model(r, attention)
    checkpoint.check_shapes(model, state, path, config.model, r.chosen.spec)
    try:
        loaded = model.load_state_dict(state["model"], strict=False)
    except RuntimeError as e:  # torch's first line is a header ("Error(s) in loading ..."): the reason follows it
        why = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise GtxError(
            f"checkpoint {path} does not fit model {config.model!r} as configured here: {why[min(1, len(why) - 1)]}"
        ) from None
    learned = [key for key in loaded.missing_keys if checkpoint.trainable_key(key)]
    if learned:
        trained = json.loads(state["common"])["pattern"]
        raise GtxError(
            f"pattern {r.chosen.spec!r} attends with learned parameters that checkpoint {path} (trained under {trained!r}) lacks "
            f"({learned[0]}); evaluate it under a pattern without them, or train under {r.chosen.spec!r}"
        )
    # a trainable pattern's parameters are unused under another pattern: evaluating its model so is allowed
    other = [*loaded.missing_keys, *(key for key in loaded.unexpected_keys if not checkpoint.trainable_key(key))]
    if other:
        raise GtxError(
            f"checkpoint {path} does not fit model {config.model!r} as configured here: parameter {other[0]!r} "
            f"{'missing from the checkpoint' if other[0] in loaded.missing_keys else 'not in the model'}"
        )
    return model, r, attention


def evaluate_checkpoint(
    ref: str,
    results_dir: str | None = None,
    split: str = "test",
    beam: int | None = None,
    pattern: str | None = None,
    backend: str | None = None,
    device: str = "auto",
) -> pd.DataFrame:
    """Evaluate a trained model (a checkpoint path, or a run id under ``results_dir``) on one split,
    under its own pattern or another; append the rows as a new run whose ``eval_of`` names the source."""
    if split not in SPLITS:
        raise GtxError(f"--split {split}: choose one of {', '.join(SPLITS)}")
    path = find_checkpoint(ref, results_dir or "results")
    state = checkpoint.load(path)
    trained = RunConfig(**state["run_config"])
    results_dir = results_dir or str(path.parent.parent.parent)  # <results>/checkpoints/<run_id>/best.pt
    config = dataclasses.replace(
        trained,
        pattern=pattern or trained.pattern,
        backend=backend or trained.backend,
        device=device,
        results_dir=results_dir,
        loggers=[],
    )
    model, r, attention = trained_model(path, state, config)
    source = json.loads(state["common"])
    stats = evaluate(
        model,
        r.task,
        batches(r.task, split, r.pattern, r.train.eval_batch_size),
        r.pattern,
        r.device,
        beam=beam or getattr(r.task_config, "beam", 1),
        precision=r.train.precision,
    )
    run_id, started = _new_run_id(config.task, config.model, "-eval")
    setup = {
        **r.as_dict(),
        "checkpoint": str(path),
        "trained_pattern": source["pattern"],
        "attention_stage": stages_of(model),
    }
    common = {
        **source,
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "started_at": started.isoformat(timespec="seconds"),
        "pattern": r.chosen.spec,
        "cell": None,
        "experiment": r.experiment,
        "eval_of": source["run_id"],
        "backend": config.backend,
        "device": str(r.device),
        "config": json.dumps(setup, sort_keys=True),
        **_versions(),
    }
    rows = [_row(common, state["epoch"], split, stats, attention)]
    write_run(_results_dir(results_dir), run_id, rows)
    return pd.DataFrame(rows)
