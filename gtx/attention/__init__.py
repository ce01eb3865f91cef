"""What a model attends with: the ``Attention`` module every model receives (head groups, score
biases and content-chosen selections at run time: ``module``), the budget account (``budget``), the
checks of what a pattern selects (``checks``), attention with parameters of its own
(``trainable``), and ``selection``: the one home of the selection contract and its kernels (the
selection kinds, the call that attends over one, the choosers; C kernels built by ``gtx.native``).
Backends (the kernels of plain patterns) live in ``gtx.backends``, the model parts built on
attention in ``gtx.model``."""

from gtx.attention.checks import check_keep, check_selection
from gtx.attention.module import Attention, check_budget, check_pattern

__all__ = ["Attention", "check_budget", "check_keep", "check_pattern", "check_selection"]
