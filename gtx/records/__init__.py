"""What runs leave, and reading it: where each thing lives under a results folder (``layout``), the
results schema and its files (``results``), checkpoints (``checkpoint``), finding a run by its id
(``runref``), run listings (``runs``), comparisons and their statistics (``compare``, ``stats``),
and the docs' figure tables with their provenance (``figures``). Below the run: a run writes
through these modules and nothing here trains. A new results column goes in ``results``; a new
statistic in ``stats``; a new place under the results folder in ``layout``."""
