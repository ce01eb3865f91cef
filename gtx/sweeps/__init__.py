"""Many runs: grids of settings (``grid``), a study's patterns and budgets (``study``), sweeps and
their cells (``sweep``, one claim per cell in ``claims``), launching on a cluster (``cluster``),
and budget frontiers with their saved tables (``frontier``, ``frontier_tables``). Above the run:
each cell is one ordinary run."""
