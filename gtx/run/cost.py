"""Training cost counted as a model runs: the results' ``flops`` and ``attn_flops`` columns.

FLOPs are counted, not estimated from sizes: every ``torch.nn.Linear`` call adds ``2 x in x out``
per row it maps, every ``gtx.attention.Attention`` call ``2 x (Dk + Dv)`` per attended edge and
head (q.k, then the weighted sum of v). Embeddings, norms, softmax and a method's own extras (an
indexer's scores, NSA's compression) are left out: they are small next to the matmuls, or counted
through the linear layers they use. A training step counts its forward ``1 + BACKWARD`` times.
"""

from __future__ import annotations

import math

import torch

from gtx.attention.module import Attention

BACKWARD = 2  # a backward pass costs about twice its forward: gradients for the inputs and for the weights


class FlopCount:
    """Forward FLOPs of ``model`` inside ``with FlopCount(model) as f:``: ``f.dense`` (linear
    layers, attention's projections included), ``f.attention`` (NaN when the model holds no
    ``Attention`` module: a plugin that attends by itself) and ``f.total``, their sum."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.dense, self.attention = model, 0.0, float("nan")

    def _linear(self, module: torch.nn.Linear, inputs, output) -> None:
        self.dense += 2.0 * module.in_features * output.numel()

    def __enter__(self) -> FlopCount:
        self._attn = [m for m in self.model.modules() if isinstance(m, Attention)]
        self._start = sum(m.flops for m in self._attn)
        self._hooks = [
            m.register_forward_hook(self._linear) for m in self.model.modules() if isinstance(m, torch.nn.Linear)
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        if self._attn:
            self.attention = sum(m.flops for m in self._attn) - self._start

    @property
    def total(self) -> float:
        return self.dense + (0.0 if math.isnan(self.attention) else self.attention)
