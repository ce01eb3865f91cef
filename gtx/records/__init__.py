"""What runs leave, and reading it: the results schema and its files (``results``), checkpoints
(``checkpoint``), finding a run by its id (``runref``), run listings (``runs``), comparisons and
their statistics (``compare``, ``stats``). Below the run: a run writes through these modules and
nothing here trains. A new results column goes in ``results``; a new statistic in ``stats``."""
