"""What a run is made of: its attention and model built from a resolved configuration, its id, its
folders checked before it trains, and its rows (the columns of ``gtx.records.results``)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path

import torch

import gtx
from gtx.attention.module import Attention
from gtx.attention.trainable import starts_trained
from gtx.errors import PluginError, plugin_code
from gtx.files import check_writable, writable_dir
from gtx.plugins.registry import MODELS
from gtx.records import checkpoint
from gtx.records.layout import ResultsFolder
from gtx.records.results import metrics_json
from gtx.run.config import Resolved
from gtx.run.train import PhaseStats


def build_attention(resolved: Resolved) -> Attention:
    """The run's backend, with its pattern's run-time parts (head groups, biases, selections, trainable attention)."""
    heads, dim = getattr(resolved.model_config, "heads", None), getattr(resolved.model_config, "dim", None)
    return Attention.for_width(resolved.backend, resolved.pattern, heads, dim, starts_trained(resolved.model_config))


def build_model(resolved: Resolved, attention: Attention) -> torch.nn.Module:
    who = f"model {resolved.config.model!r} ({MODELS.get(resolved.config.model).plugin})"
    with plugin_code(who, "while being built", settings=f"model {resolved.config.model!r}"):
        model = resolved.model_cls(resolved.model_config, resolved.task.src_vocab, resolved.task.tgt_vocab, attention)
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"{who} built a {type(model).__name__}; expected a torch.nn.Module")
    model.plugin_label = who  # what checks.model_output names
    return model.to(resolved.device)


def versions() -> dict[str, str]:
    from gtx.backends.dgl_compat import import_dgl

    try:
        dgl_version = import_dgl().__version__
    except ImportError:
        dgl_version = "unavailable"
    return {"gtx_version": gtx.__version__, "torch_version": torch.__version__, "dgl_version": dgl_version}


def checked_results_dir(name: str, run_id: str | None = None) -> Path:
    """The results folder, created; the places a run writes to later (``runs/`` and, for ``run_id``,
    its checkpoint folder) checked before the first step, so no trained epoch is lost to them."""
    check_results_dir(name, run_id)
    return writable_dir(Path(name))


def check_results_dir(name: str, run_id: str | None = None) -> None:
    """What ``checked_results_dir`` checks, creating nothing: for work that writes only at its end
    (``gtx eval``), before that work."""
    results_dir = check_writable(Path(name))
    check_writable(ResultsFolder(results_dir).runs(), "results folder")
    if run_id:
        check_writable(checkpoint.checkpoint_dir(results_dir, run_id), "checkpoint folder")


def new_run_id(task: str, model: str, kind: str = "") -> tuple[str, dt.datetime]:
    started = dt.datetime.now(dt.timezone.utc)
    return f"{started:%Y%m%d-%H%M%S}-{task}-{model}{kind}-{uuid.uuid4().hex[:6]}", started


def result_row(
    common: dict, epoch: int, split: str, stats: PhaseStats, attention: Attention, stage: str | None = None
) -> dict:
    """One results row of a phase. ``stage``: what the model's trainable attention runs as after the phase
    (``gtx.attention.trainable.stages_of``: DSA's stage, steps and resolved ``freeze``), kept in its metrics as
    ``attention_stage``; the phase's losses and kept edges per branch say which stages the phase ran."""
    extra = {**stats.extra, **attention.reset_stats()}  # trainable attention's losses and kept edges per branch
    if stage:
        extra["attention_stage"] = stage
    return {
        **common,
        "epoch": epoch,
        "split": split,
        **stats.row(),
        "seq_acc": extra.pop("seq_acc", float("nan")),
        "metrics": metrics_json(extra),
        "backend_plan": json.dumps(attention.reset_choices(), sort_keys=True),
    }
