"""Plugins: the hooks (``hookspecs``), the plugin manager and registries that load and name them
(``registry``), and the checks of what plugins hand back (``checks``). A new hook goes here."""

from gtx.plugins.registry import (
    BACKENDS,
    BIASES,
    LOGGERS,
    MODELS,
    PATTERNS,
    TASKS,
    Registry,
    call_each,
    label_of,
    load_plugins,
    pm,
    task_metrics,
)

__all__ = [
    "BACKENDS",
    "BIASES",
    "LOGGERS",
    "MODELS",
    "PATTERNS",
    "TASKS",
    "Registry",
    "call_each",
    "label_of",
    "load_plugins",
    "pm",
    "task_metrics",
]
