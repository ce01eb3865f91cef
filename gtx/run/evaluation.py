"""A trained model from its checkpoint (``trained_model``: eval, plots, probes), and its evaluation
as a run of its own (``evaluate_checkpoint``: ``gtx eval``)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import torch

from gtx.attention.module import Attention
from gtx.attention.trainable import stages_of
from gtx.data.batch import batches
from gtx.data.task import SPLITS
from gtx.errors import GtxError
from gtx.records import checkpoint
from gtx.records.results import SCHEMA_VERSION, write_run
from gtx.records.runref import find_checkpoint
from gtx.run.build import (
    build_attention,
    build_model,
    check_results_dir,
    checked_results_dir,
    new_run_id,
    result_row,
    versions,
)
from gtx.run.config import Resolved, RunConfig, check_beam, resolve
from gtx.run.train import evaluate


def trained_model(path: Path, state: dict, config: RunConfig) -> tuple[torch.nn.Module, Resolved, Attention]:
    """A checkpoint's model rebuilt under ``config`` (the run's own, or another pattern, backend or
    device) with its weights loaded: (model, its resolved configuration, its Attention). The one path
    from a checkpoint to a model (eval, plots, probes); a vocabulary or a shape that does not fit is
    one line."""
    resolved = resolve(config)
    checkpoint.check_vocab(state, resolved.task, path)
    checkpoint.check_definitions(state, resolved.definitions, path)
    attention = build_attention(resolved)
    model = build_model(resolved, attention)
    checkpoint.check_shapes(model, state, path, config.model, resolved.pattern_given.spec)
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
            f"pattern {resolved.pattern_given.spec!r} attends with learned parameters that checkpoint {path} (trained under {trained!r}) lacks "
            f"({learned[0]}); evaluate it under a pattern without them, or train under {resolved.pattern_given.spec!r}"
        )
    # a trainable pattern's parameters are unused under another pattern: evaluating its model so is allowed
    other = [*loaded.missing_keys, *(key for key in loaded.unexpected_keys if not checkpoint.trainable_key(key))]
    if other:
        raise GtxError(
            f"checkpoint {path} does not fit model {config.model!r} as configured here: parameter {other[0]!r} "
            f"{'missing from the checkpoint' if other[0] in loaded.missing_keys else 'not in the model'}"
        )
    return model, resolved, attention


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
    checkpoint.owner(state, path)  # its rows name the run it claims: the run asked for
    trained = checkpoint.run_config(state)
    results_dir = results_dir or str(path.parent.parent.parent)  # <results>/checkpoints/<run_id>/best.pt
    check_results_dir(results_dir)  # before the evaluation, whose rows it would lose
    config = dataclasses.replace(
        trained,
        pattern=pattern or trained.pattern,
        backend=backend or trained.backend,
        device=device,
        results_dir=results_dir,
        loggers=[],
    )
    model, resolved, attention = trained_model(path, state, config)
    beam = beam or getattr(resolved.task_config, "beam", 1)
    check_beam(beam, resolved.task, f"--beam {beam}")
    source = json.loads(state["common"])
    stats = evaluate(
        model,
        resolved.task,
        batches(resolved.task, split, resolved.pattern_run, resolved.train.eval_batch_size),
        resolved.pattern_run,
        resolved.device,
        beam=beam,
        precision=resolved.train.precision,
        decode_pattern=resolved.decode,
    )
    run_id, started = new_run_id(config.task, config.model, "-eval")
    setup = {
        **resolved.as_dict(),
        "checkpoint": str(path),
        "trained_pattern": source["pattern"],
        "attention_stage": stages_of(model),
    }
    common = {
        **source,
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "started_at": started.isoformat(timespec="seconds"),
        "pattern": resolved.pattern_given.spec,
        # the trained run's methods and the evaluating pattern's: the figures depend on both
        "definitions": json.dumps(
            dict(sorted({**checkpoint.recorded_definitions(state), **resolved.definitions}.items()))
        ),
        "cell": None,
        "experiment": resolved.experiment,
        "eval_of": source["run_id"],
        "backend": config.backend,
        "device": str(resolved.device),
        "config": json.dumps(setup, sort_keys=True),
        **versions(),
    }
    rows = [result_row(common, state["epoch"], split, stats, attention, setup["attention_stage"])]
    if not math.isfinite(rows[0]["loss"]):
        raise GtxError(
            f"{path}: its {split} loss is {rows[0]['loss']}: the checkpoint's weights are not finite; nothing written"
        )
    write_run(checked_results_dir(results_dir), run_id, rows)
    return pd.DataFrame(rows)
