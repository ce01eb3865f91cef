"""gtx: sparse attention as message passing over token graphs.

The public API for plugin authors and Python users (docs/api.md; kept stable by tests/test_layout.py):

    from gtx import hookimpl                          # plugin hooks (gtx/plugins/hookspecs.py)
    from gtx import Pattern, parse_pattern, setting   # patterns, specs, config fields with ranges
    from gtx import Task, Vocab, GtxError, PatternError
    from gtx import load_results, plot, testing       # results tables, figures, checks for pattern authors
    from gtx import Trainable                         # attention with parameters of its own (nsa, dsa)

Everything else is internal. Modules moved into subpackages keep their old import paths
(``gtx.pattern``, ``gtx.task``, ``gtx.runner``, ...): ``_MOVED`` maps them to their new places.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from gtx.plugins.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

#: name -> (module, attribute or None for the module itself), imported on first use
PUBLIC = {
    "Pattern": ("gtx.graph.pattern", "Pattern"),
    "parse_pattern": ("gtx.graph.spec", "parse_pattern"),
    "setting": ("gtx.values", "setting"),
    "Task": ("gtx.data.task", "Task"),
    "Vocab": ("gtx.data.task", "Vocab"),
    "GtxError": ("gtx.errors", "GtxError"),
    "PatternError": ("gtx.errors", "PatternError"),
    "load_results": ("gtx.experiments.results", "load"),
    "plot": ("gtx.pictures.plot", None),
    "testing": ("gtx.testing", None),
    "Trainable": ("gtx.attention.trainable", "Trainable"),
}
__all__ = ["hookimpl", "hookspec", "__version__", *PUBLIC]

#: old module -> new module: paths documented before the subpackages keep working
_MOVED = {
    "gtx.hookspecs": "gtx.plugins.hookspecs", "gtx.checks": "gtx.plugins.checks",
    "gtx.pattern": "gtx.graph.pattern", "gtx.spec": "gtx.graph.spec", "gtx.task": "gtx.data.task",
    "gtx.engine": "gtx.attention.engine", "gtx.selection": "gtx.attention.selection", "gtx.model": "gtx.attention.model",
    "gtx.act": "gtx.attention.act", "gtx.stack": "gtx.attention.stack", "gtx.decode": "gtx.attention.decode",
    **{f"gtx.{m}": f"gtx.experiments.{m}" for m in ("config", "runner", "train", "checkpoint", "distributed", "results", "compare",
                                                    "stats", "sweep", "claims", "loggers", "runs")},
    **{f"gtx.{m}": f"gtx.measure.{m}" for m in ("bench", "reference", "probe")},
    **{f"gtx.{m}": f"gtx.pictures.{m}" for m in ("plot", "plot_model", "report")},
    **{f"gtx.cli_{m}": f"gtx.cli.{m}" for m in ("common", "bench", "plot", "runs", "sweep")},
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the very module object at its new place (one module, two names)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        self._real_spec = module.__spec__  # the import machinery sets __spec__ to the alias's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = self._real_spec


sys.meta_path.append(_MovedFinder())


def __getattr__(name: str):
    if name in PUBLIC:
        module, attr = PUBLIC[name]
        value = importlib.import_module(module)
        return value if attr is None else getattr(value, attr)
    raise AttributeError(f"module 'gtx' has no attribute {name!r}")
