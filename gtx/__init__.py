"""gtx: sparse attention as message passing over token graphs.

The public API for plugin authors and Python users is what docs/api.md lists (tests/test_layout.py
checks the two agree), for example:

    from gtx import hookimpl                          # plugin hooks (gtx/plugins/hookspecs.py)
    from gtx import Pattern, parse_pattern, setting   # patterns, specs, config fields with ranges
    from gtx import Task, Vocab, GtxError, PatternError
    from gtx import load_results, plot, testing       # results tables, figures, checks for pattern authors
    from gtx import Trainable                         # attention with parameters of its own (nsa, dsa)

Everything else is internal and may move.
"""

from __future__ import annotations

import importlib

from gtx.plugins.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

#: name -> (module, attribute or None for the module itself), imported on first use
PUBLIC = {
    "Pattern": ("gtx.graph.pattern", "Pattern"),
    "parse_pattern": ("gtx.graph.spec", "parse_pattern"),
    "batch_edges": ("gtx.graph.tokens", "batch_edges"),
    "setting": ("gtx.values", "setting"),
    "Task": ("gtx.data.task", "Task"),
    "Vocab": ("gtx.data.task", "Vocab"),
    "Tokenizer": ("gtx.data.vocab", "Tokenizer"),
    "GtxError": ("gtx.errors", "GtxError"),
    "PatternError": ("gtx.errors", "PatternError"),
    "load_plugins": ("gtx.plugins.registry", "load_plugins"),
    "Backend": ("gtx.backends", "Backend"),
    "get_backend": ("gtx.backends", "get_backend"),
    "GraphModel": ("gtx.model.layers", "GraphModel"),
    "Seq2SeqModel": ("gtx.model.layers", "Seq2SeqModel"),
    "SelfAttentionStack": ("gtx.model.stack", "SelfAttentionStack"),
    "Trainable": ("gtx.attention.trainable", "Trainable"),
    "causal_lens": ("gtx.attention.trainable", "causal_lens"),
    "Logger": ("gtx.experiments.loggers", "Logger"),
    "scalars": ("gtx.experiments.loggers", "scalars"),
    "load_results": ("gtx.experiments.results", "load"),
    "load_frontiers": ("gtx.experiments.frontier_tables", "load_frontiers"),
    "probe": ("gtx.measure.probe", None),
    "plot": ("gtx.pictures.plot", None),
    "plot_model": ("gtx.pictures.plot_model", None),
    "report": ("gtx.pictures.report", None),
    "testing": ("gtx.testing", None),
}
__all__ = ["hookimpl", "hookspec", "__version__", *PUBLIC]


def __getattr__(name: str):
    if name in PUBLIC:
        module, attr = PUBLIC[name]
        value = importlib.import_module(module)
        return value if attr is None else getattr(value, attr)
    raise AttributeError(f"module 'gtx' has no attribute {name!r}")
