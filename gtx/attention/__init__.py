"""What a model attends with: the ``Attention`` module every model receives (head groups, score
biases and content-chosen selections at run time: ``module``), the budget account (``budget``), the
checks of what a pattern selects (``checks``) and attention with parameters of its own
(``trainable``). The selection contract (the selection kinds, the call that attends over one, the
choosers) lives a floor below in ``gtx.selection``, its Triton kernels in ``gtx.triton_kernels``
and its C kernels in ``gtx.native``; backends (the kernels of plain patterns) in ``gtx.backends``,
the model parts built on attention in ``gtx.model``."""

from gtx.attention.checks import check_keep, check_selection
from gtx.attention.module import Attention, check_budget, check_pattern

__all__ = ["Attention", "check_budget", "check_keep", "check_pattern", "check_selection"]
