"""``python -m gtx.cli``: the ``gtx`` command (sweeps run their cells this way)."""

from gtx.cli import main

main()
