"""Experiments: a run's configuration (``config``), the runner and training loop (``runner``,
``train``), checkpoints, data parallel, loggers; the results schema (``results``), comparisons and
their statistics (``compare``, ``stats``), sweeps (``sweep``, ``claims``) and run listings (``runs``).
A new statistic goes in ``stats``; a new results column in ``results``."""
