"""Every gtx hook, in one place.

Each ``register_*`` hook receives a ``register`` callback and calls it once per thing it provides;
plugins may accept any subset of a hook's arguments. Two plugins registering one name is an error
that names both, and a misspelled hook is an error at load time (``pm.check_pending()``).

Edge convention, for every stage: an edge ``src -> dst`` means query ``dst`` attends to key/value
``src``; the softmax of query ``dst`` runs over its incoming edges.
"""

import pluggy

hookspec = pluggy.HookspecMarker("gtx")
hookimpl = pluggy.HookimplMarker("gtx")


@hookspec
def register_patterns(register):
    """Register attention patterns: ``register(name, factory, definition=None)``.

    ``factory(**params) -> gtx.graph.pattern.Pattern``; its keyword parameters (with type annotations and
    defaults) are the pattern's command-line parameters (``local:w=4``) and the first line of its
    docstring is the description shown by ``gtx patterns``. ``definition`` (an int from 1): the
    method's definition version, raised whenever it computes something else under the same name;
    the pattern carries it (``Pattern.definitions``), results rows record it (``definitions``), and
    checkpoints and figure tables of another version are refused.
    """


@hookspec
def register_biases(register):
    """Register score biases: ``register(name, bias_cls, definition=None)``; ``P+name:key=value`` adds one
    to a pattern; ``definition`` as for patterns.

    ``bias_cls(heads, **params)`` is a ``torch.nn.Module`` (its parameters train with the model,
    shared by all layers) whose ``forward(q_pos, k_pos, stage, heads) -> (E, len(heads))`` gives the
    additive score of each edge for the given head indices, from the query and key positions within
    their sample ((E,) int64 each), or None to leave ``stage`` unbiased. Keyword parameters with
    type annotations and defaults are the command-line parameters; the docstring's first line is
    what ``gtx patterns`` shows.
    """


@hookspec
def register_backends(register):
    """Register attention backends: ``register(name, backend)``.

    ``backend`` is a ``gtx.backends.Backend``: ``backend(q, k, v, edges)`` computes softmax attention
    of each query over its incoming edges; ``backend.available(device)`` returns ``None`` where it runs on
    ``device`` (a ``torch.device`` or its name), else why not.
    """


@hookspec
def register_models(register):
    """Register models: ``register(name, model_cls, config=ConfigDataclass)``.

    ``model_cls(config, src_vocab, tgt_vocab, attention)`` is a ``torch.nn.Module`` written as
    ``update_graph`` calls; ``attention`` (a ``gtx.attention.Attention``: the chosen backend plus the
    pattern's head groups, biases and selections, a module whose parameters the model owns) is what
    it passes to ``update_graph`` / ``propagate_attention``.
    """


@hookspec
def register_tasks(register):
    """Register tasks (data and metrics): ``register(name, task_cls, config=ConfigDataclass)``."""


@hookspec
def register_commands(cli):
    """Add commands to the click group ``cli``, e.g. ``gtx mycommand ...``."""


@hookspec
def register_loggers(register):
    """Register run loggers: ``register(name, logger_cls)``; ``gtx run --log NAME`` (repeatable) uses one.

    ``logger_cls(run_id, results_dir)`` is a ``gtx.run.loggers.Logger``: ``start(config)`` before the
    first epoch (``config``: the run's resolved configuration, a JSON-ready dict), ``epoch_end(epoch,
    rows)`` after each epoch's rows are written (``rows``: that epoch's train and valid rows, dicts
    in the results schema), ``end(rows, status)`` once, with every row of the run and ``status``
    ``"finished"``, ``"failed"`` or ``"interrupted"``. Only the main process of a data-parallel run logs.
    """
