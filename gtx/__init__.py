"""gtx: sparse attention as message passing over token graphs.

The public API for plugin authors and Python users is what docs/api.md lists (tests/test_layout.py
checks the two agree), for example:

    from gtx import hookimpl                          # plugin hooks (gtx/plugins/hookspecs.py)
    from gtx import Pattern, parse_pattern, setting   # patterns, specs, config fields with ranges
    from gtx import Task, Vocab, GtxError, PatternError
    from gtx import load_results, plot, testing       # results tables, figures, checks for pattern authors
    from gtx import Trainable, KeySelection, attend_selection   # methods that choose keys (nsa, dsa)
    from gtx import update_graph, layers              # what model plugins are built from

Everything else is internal and may move.
"""

from __future__ import annotations

import importlib

from gtx.plugins.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

#: name -> (module, attribute or None for the module itself), imported on first use
PUBLIC = {
    # patterns: the type, its specs, the stages and the rules fixed patterns are written with
    "Pattern": ("gtx.graph.pattern", "Pattern"),
    "parse_pattern": ("gtx.graph.spec", "parse_pattern"),
    "STAGES": ("gtx.graph.pattern", "STAGES"),
    "everything": ("gtx.graph.pattern", "everything"),
    "causal": ("gtx.graph.pattern", "causal"),
    "align": ("gtx.graph.pattern", "align"),
    "EdgeSet": ("gtx.graph.tokens", "EdgeSet"),
    "batch_edges": ("gtx.graph.tokens", "batch_edges"),
    "build_graph": ("gtx.graph.tokens", "build_graph"),
    "window_edges": ("gtx.graph.tokens", "window_edges"),
    # the selection contract: what a method that chooses keys from the content hands the kernels
    "KeySelection": ("gtx.attention.selection", "KeySelection"),
    "TokenBlockSelection": ("gtx.attention.selection", "TokenBlockSelection"),
    "BlockSelection": ("gtx.attention.selection", "BlockSelection"),
    "attend_selection": ("gtx.attention.selection", "attend_selection"),
    "selection": ("gtx.attention.selection", None),
    "Run": ("gtx.attention.trainable", "Run"),
    "setting": ("gtx.values", "setting"),
    # tasks
    "Task": ("gtx.data.task", "Task"),
    "Vocab": ("gtx.data.task", "Vocab"),
    "Tokenizer": ("gtx.data.vocab", "Tokenizer"),
    "ModelVocab": ("gtx.data.vocab", "ModelVocab"),
    "disjoint_splits": ("gtx.data.task", "disjoint_splits"),
    "grouped_accuracy": ("gtx.data.task", "grouped_accuracy"),
    "edit_distance": ("gtx.data.task", "edit_distance"),
    "stable_fraction": ("gtx.data.task", "stable_fraction"),
    "PromptTask": ("gtx.data.prompts", "PromptTask"),
    "PromptConfig": ("gtx.data.prompts", "PromptConfig"),
    "Prompt": ("gtx.data.prompts", "Prompt"),
    "answer_recall": ("gtx.data.prompts", "answer_recall"),
    "synthetic_words": ("gtx.data.prompts", "synthetic_words"),
    "fit_count": ("gtx.data.prompts", "fit_count"),
    "GtxError": ("gtx.errors", "GtxError"),
    "PatternError": ("gtx.errors", "PatternError"),
    "load_plugins": ("gtx.plugins.registry", "load_plugins"),
    "Backend": ("gtx.backends", "Backend"),
    "get_backend": ("gtx.backends", "get_backend"),
    # models: update_graph and the parts the built-in models are made of
    "update_graph": ("gtx.model.engine", "update_graph"),
    "propagate_attention": ("gtx.model.engine", "propagate_attention"),
    "apply_nodes": ("gtx.model.engine", "apply_nodes"),
    "layer_attention": ("gtx.attention.module", "layer_attention"),
    "GraphModel": ("gtx.model.layers", "GraphModel"),
    "Seq2SeqModel": ("gtx.model.layers", "Seq2SeqModel"),
    "Output": ("gtx.model.layers", "Output"),
    "layers": ("gtx.model.layers", None),
    "SelfAttentionStack": ("gtx.model.stack", "SelfAttentionStack"),
    "StackConfig": ("gtx.model.stack", "StackConfig"),
    "AdaptiveComputation": ("gtx.model.act", "AdaptiveComputation"),
    "Halting": ("gtx.model.act", "Halting"),
    "pretrained": ("gtx.model.pretrained", None),
    "Trainable": ("gtx.attention.trainable", "Trainable"),
    "causal_lens": ("gtx.attention.trainable", "causal_lens"),
    "Logger": ("gtx.run.loggers", "Logger"),
    "scalars": ("gtx.run.loggers", "scalars"),
    "load_results": ("gtx.records.results", "load"),
    "load_frontiers": ("gtx.sweeps.frontier_tables", "load_frontiers"),
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
