"""What a run was asked to be, as its checkpoints and results record it: ``RunConfig`` (resolved
and checked by ``gtx.run.config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_BACKEND = "auto"


@dataclass
class RunConfig:
    """One experiment. ``settings`` are ``key=value`` strings for the model, task or training
    configs (``dim=64``; prefix ``model.``, ``task.`` or ``train.`` where a key is ambiguous)."""

    task: str = "copy"
    model: str = "transformer"
    pattern: str = "full"
    backend: str = DEFAULT_BACKEND
    device: str = "auto"
    seed: int = 0
    results_dir: str = "results"
    settings: dict[str, str] = field(default_factory=dict)
    loggers: list[str] = field(default_factory=list)  # names registered by register_loggers (--log)
