"""Adaptive computation time (ACT, Graves 2016) as the Universal Transformer uses it: one shared
layer applied repeatedly per node until the node halts.

Before each step a node adds its position and a timestep encoding to its state; a halting unit per
node accumulates p = sigmoid(W LN(x) + b) (b initialised to 1) until the sum reaches ``threshold``
or ``max_depth`` steps; the output is the halting-weighted sum of the node's states; the ponder
loss is ``act_loss_weight * mean(remainders)``. At every step attention runs over the ``act``
pattern around the run's pattern: only edges into still-active nodes. A halted node keeps its last
keys and values, so active queries still see it.
"""

from __future__ import annotations

import torch
from torch import nn


class Halting(nn.Module):
    """p = sigmoid(W LN(x) + b), b initialised to 1 (halt late at first)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 1)
        nn.init.constant_(self.proj.bias, 1.0)

    def forward(self, x):
        return torch.sigmoid(self.proj(self.norm(x)))


class AdaptiveComputation:
    """Mixin of models with ACT. Expects ``self.config`` with ``max_depth``, ``threshold``, ``act``
    and ``act_loss_weight``; ``self.embed`` (``gtx.model.layers.Embeddings``) and ``self.time``, a
    ``PositionalEncoding`` of ``max_depth`` steps.

    Node state of one node type (``state``): ``x`` the state, ``pos`` positions, ``s`` the
    halting-weighted sum of states, ``sum_p`` (n, 1) halting mass, ``r`` (n, 1) remainders,
    ``steps`` (n,) steps taken, ``active`` (n,) bool."""

    dynamic_pattern = "act"

    def _state(self, table, ids, pos):
        x = self.embed.token(table, ids)
        n = x.shape[0]
        return {
            "x": x,
            "pos": pos,
            "s": torch.zeros_like(x),
            "sum_p": x.new_zeros(n, 1),
            "r": x.new_ones(n, 1),
            "steps": torch.zeros(n, dtype=torch.long, device=x.device),
            "active": torch.ones(n, dtype=torch.bool, device=x.device),
        }

    def _step_forward(self, t: int):
        time = self.time(torch.tensor([t], device=self.time.pe.device))

        def fn(nodes):
            return {
                "x": self.embed.dropout(nodes["x"] + self.embed.pos(nodes["pos"]) + time),
                "steps": nodes["steps"] + 1,
            }

        return fn

    def _halt(self, halting: Halting, end: bool):
        threshold = self.config.threshold

        def fn(nodes):
            x, p = nodes["x"], halting(nodes["x"])
            sum_p = nodes["sum_p"] + p
            active = (sum_p < threshold) & (not end)
            cont = active.to(x.dtype)
            r = nodes["r"] * (1 - cont) + (1 - sum_p) * cont  # a node halting now keeps its last remainder
            s = nodes["s"] + ((1 - cont) * r + cont * p) * x
            return {"sum_p": sum_p, "r": r, "s": s, "active": active.squeeze(1)}

        return fn

    def _steps(self, data, pattern, update):
        """Call ``update(t, ids, keep, end)`` per step while nodes are active: ``ids`` are the active
        node ids (None: all), ``keep(edges)`` applies the dynamic pattern's filter, ``end`` marks the
        last allowed step."""
        for t in range(self.config.max_depth):
            active = data["active"]
            if not active.any():
                break
            ids = None if bool(active.all()) else active.nonzero().squeeze(1)

            def keep(edges, active=active, ids=ids):
                return edges if ids is None or not pattern.dynamic else pattern.filter(edges, active)

            update(t, ids, keep, t == self.config.max_depth - 1)

    def _final(self, data):
        return data["s"] if self.config.act else data["x"]

    def _halting(self, halting, ntype, ids, end):
        return [(self._halt(halting, end), ntype, ids)] if self.config.act else []

    def _ponder_loss(self, *remainders: torch.Tensor) -> torch.Tensor | None:
        """``act_loss_weight`` times the mean remainder over all nodes; None without ACT."""
        if not self.config.act:
            return None
        return self.config.act_loss_weight * torch.cat(remainders).mean()
