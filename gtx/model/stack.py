"""One-stage models: a stack of self-attention layers over one node type, written as
``update_graph`` calls. Plain (``layers`` layers of their own) or universal (one shared layer
repeated per node until it halts, with ACT as in ``ut``: ``--set universal=true``).

The ``lm`` plugin runs the stack over decoder nodes (stage ``dd``: the pattern's causal rule), the
``encoder`` plugin over encoder nodes (stage ``ee``). Memory is O(nodes * dim) plus what the
attention backend needs for the edges: no (n, n) buffer outside attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from gtx.attention.module import layer_attention
from gtx.model.act import AdaptiveComputation, Halting
from gtx.model.engine import update_graph
from gtx.model.layers import Embeddings, EncoderLayer, GraphModel, PositionalEncoding
from gtx.values import setting


@dataclass
class StackConfig:
    layers: int = setting(2, "layers (universal: the most steps is max_depth instead)", "[1, inf)")
    heads: int = setting(4, range="[1, inf)")
    dim: int = setting(128, "d_model", "[1, inf)")
    dim_ff: int = setting(512, range="[1, inf)")
    dropout: float = setting(0.1, range="[0, 1)")
    max_len: int = setting(16384, "positions the model has: the longest sequence it reads", "[1, inf)")
    universal: bool = field(
        default=False, metadata={"help": "one shared layer repeated per node with ACT halting (as ut)"}
    )
    max_depth: int = setting(8, "universal: most recurrent steps per node", "[1, inf)")
    threshold: float = setting(0.99, "universal: a node halts once its halting probabilities sum to this", "(0, 1]")
    act_loss_weight: float = setting(0.01, range="[0, inf)")
    act: bool = field(default=True, metadata={"help": "universal: False runs every node max_depth steps"})
    embed_scale: float = setting(4.0, "token embeddings are multiplied by this", "(0, inf)")


class SelfAttentionStack(AdaptiveComputation, GraphModel):
    """Base of one-stage models: subclasses set ``stage`` and ``ntype`` and build ``forward`` on
    ``states``."""

    stage = "ee"
    ntype = "enc"
    dynamic_pattern = None  # universal models wrap ACT around the pattern: see ``modifier``

    def __init__(self, config: StackConfig, src_vocab, tgt_vocab, attention, share: bool):
        super().__init__(attention)
        c = self.config = config
        self.embed = Embeddings(src_vocab, tgt_vocab, c.dim, c.dropout, share, c.embed_scale, max_len=c.max_len)
        self.layers = nn.ModuleList(
            EncoderLayer(c.heads, c.dim, c.dim_ff, c.dropout) for _ in range(1 if c.universal else c.layers)
        )
        # each layer's own trainable attention
        self.layer_attention = nn.ModuleList(layer_attention(attention) for _ in self.layers)
        if c.universal:
            self.halt = Halting(c.dim)
            self.time = PositionalEncoding(c.dim, max_len=c.max_depth)
        self.norm = nn.LayerNorm(c.dim)

    @classmethod
    def modifier(cls, config: StackConfig) -> str | None:
        return "act" if config.universal else None

    def states(
        self, table: nn.Embedding, ids: torch.Tensor, pos: torch.Tensor, graph
    ) -> tuple[torch.Tensor, torch.Tensor | None, list]:
        """Final states (n, dim) of the nodes, the ponder loss (universal with ACT) and step counts."""
        edges = graph.edges[self.stage]
        if not self.config.universal:
            nodes = {self.ntype: {"x": self.embed.embed(table, ids, pos)}}
            for layer, attention in zip(self.layers, self.layer_attention):
                update_graph(
                    nodes,
                    self.stage,
                    edges,
                    [(layer.pre, self.ntype, None)],
                    [(layer.post, self.ntype, None)],
                    attention,
                )
            return self.norm(nodes[self.ntype]["x"]), None, []
        nodes = {self.ntype: self._state(table, ids, pos)}
        layer, ntype = self.layers[0], self.ntype

        def step(t, sel, keep, end):
            update_graph(
                nodes,
                self.stage,
                keep(edges),
                [(self._step_forward(t), ntype, sel), (layer.pre, ntype, sel)],
                [(layer.post, ntype, sel), *self._halting(self.halt, ntype, sel, end)],
                self.layer_attention[0],
            )

        data = nodes[ntype]
        self._steps(data, graph.pattern, step)
        return self.norm(self._final(data)), self._ponder_loss(data["r"]), [data["steps"]]
