"""Attention and the model parts built on it: the ``Attention`` module every model receives (head
groups, score biases and content-chosen selections at run time: ``module``, ``selection``), the
engine's ``update_graph`` (``engine``), shared layers (``model``), adaptive computation time
(``act``), the one-stage models' stack (``stack``) and decoding (``decode``). Kernels live in
``gtx.backends``."""

from gtx.attention.module import Attention, check_budget, check_keep, check_pattern, check_selection

__all__ = ["Attention", "check_budget", "check_keep", "check_pattern", "check_selection"]
