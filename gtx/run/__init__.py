"""One run: its configuration resolved and checked (``config``), the model and attention built
(``build``), the runner and training loop (``runner``, ``train``), evaluation of a checkpoint
(``evaluation``), counted cost (``cost``), data parallel (``distributed``) and the loggers. A new
run setting goes in ``config``; what a run writes is ``gtx.records``'s."""
