"""ut: the Universal Transformer with adaptive computation time (ACT), as in the DGL tutorial.

One shared encoder layer and one shared decoder layer applied repeatedly, each node until it halts
(``gtx.act`` has the halting rule, the ponder loss and how attention follows the active nodes).
"""

from dataclasses import dataclass, field

from torch import nn

from gtx import (
    AdaptiveComputation,
    Halting,
    Output,
    Seq2SeqModel,
    apply_nodes,
    hookimpl,
    layer_attention,
    layers,
    propagate_attention,
    setting,
    update_graph,
)


@dataclass
class UTConfig:
    heads: int = setting(4, range="[1, inf)")
    dim: int = setting(128, range="[1, inf)")
    dim_ff: int = setting(512, range="[1, inf)")
    dropout: float = setting(0.1, range="[0, 1)")
    max_depth: int = setting(8, "most recurrent steps per node", "[1, inf)")
    threshold: float = setting(0.99, "a node halts once its halting probabilities sum to this", "(0, 1]")
    act_loss_weight: float = setting(0.01, range="[0, inf)")
    act: bool = field(default=True, metadata={"help": "False: no halting, every node runs max_depth steps"})
    share_embeddings: bool = True
    embed_scale: float = setting(
        4.0, "token embeddings are multiplied by this (the DGL tutorial: sqrt(dim))", "(0, inf)"
    )


class UniversalTransformer(AdaptiveComputation, Seq2SeqModel):
    """Universal Transformer with ACT: shared layers repeated per node until it halts."""

    positions = layers.POSITIONS  # its embeddings' table: the longest sequence it reads
    bench_variants = {"[act=false]": {"act": "false"}}  # every node runs max_depth steps: what halting saves

    def __init__(self, config: UTConfig, src_vocab, tgt_vocab, attention):
        super().__init__(attention)
        c = self.config = config
        self.embed = layers.Embeddings(src_vocab, tgt_vocab, c.dim, c.dropout, c.share_embeddings, c.embed_scale)
        self.enc_layer = layers.EncoderLayer(c.heads, c.dim, c.dim_ff, c.dropout)
        self.dec_layer = layers.DecoderLayer(c.heads, c.dim, c.dim_ff, c.dropout)
        # the shared layers' trainable attention
        self.enc_attention, self.dec_attention = (
            layer_attention(attention),
            layer_attention(attention),
        )
        self.halt_enc, self.halt_dec = Halting(c.dim), Halting(c.dim)
        self.time = layers.PositionalEncoding(c.dim, max_len=c.max_depth)
        self.enc_norm, self.dec_norm = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.init_weights()

    def encode(self, src, src_pos, graph):
        nodes = {"enc": self._state(self.embed.src, src, src_pos)}
        layer = self.enc_layer

        def step(t, ids, edges, end):
            update_graph(
                nodes,
                "ee",
                edges(graph.edges["ee"]),
                [(self._step_forward(t), "enc", ids), (layer.pre, "enc", ids)],
                [(layer.post, "enc", ids), *self._halting(self.halt_enc, "enc", ids, end)],
                self.enc_attention,
            )

        self._steps(nodes["enc"], graph.pattern, step)
        data = nodes["enc"]
        return layers.Encoded(self.enc_norm(self._final(data)), data["r"], data["steps"])

    def decode(self, encoded, tgt_in, tgt_pos, graph):
        nodes = {"enc": {"x": encoded.x}, "dec": self._state(self.embed.tgt, tgt_in, tgt_pos)}
        layer = self.dec_layer
        nodes["enc"].update(layer.pre_memory(nodes["enc"]))  # keys/values of the memory: the same every step

        def step(t, ids, edges, end):
            update_graph(
                nodes,
                "dd",
                edges(graph.edges["dd"]),
                [(self._step_forward(t), "dec", ids), (layer.pre_self, "dec", ids)],
                [(layer.post_self, "dec", ids)],
                self.dec_attention,
            )
            update_graph(
                nodes,
                "ed",
                edges(graph.edges["ed"]),
                [(layer.pre_query, "dec", ids)],
                [(layer.post_cross, "dec", ids), *self._halting(self.halt_dec, "dec", ids, end)],
                self.dec_attention,
            )

        self._steps(nodes["dec"], graph.pattern, step)
        data = nodes["dec"]
        logits = self.embed.generator(self.dec_norm(self._final(data)))
        return Output(logits, self._ponder_loss(encoded.remainders, data["r"]), [encoded.steps, data["steps"]])

    def start_decoding(self, encoded, pattern):
        memory = self.dec_layer.pre_memory({"x": encoded.x})  # ed keys/values, the same every step
        return {
            "memory": memory,
            "pattern": pattern,
            "k": [None] * self.config.max_depth,
            "v": [None] * self.config.max_depth,
        }

    def decode_next(self, state, tokens, pos, edges):
        """The decoder's steps for the latest token of each hypothesis. Self-attention at step t reads
        every earlier token's keys/values as they were at step t (or at its last step, once halted:
        what ``decode`` sees too), cached per step."""
        nodes = {"dec": self._state(self.embed.tgt, tokens, pos)}
        data, layer, memory = nodes["dec"], self.dec_layer, state["memory"]

        def step(t, ids, keep, end):
            for fn in (self._step_forward(t), layer.pre_self):
                apply_nodes(nodes, fn, "dec", ids)
            cache(t)
            k, v = state["k"][t].flatten(0, 1), state["v"][t].flatten(0, 1)
            data["wv"] = propagate_attention(data["q"], k, v, keep(edges["dd"]), self.dec_attention)
            apply_nodes(nodes, layer.post_self, "dec", ids)
            apply_nodes(nodes, layer.pre_query, "dec", ids)
            data["wv"] = propagate_attention(data["q"], memory["k"], memory["v"], keep(edges["ed"]), self.dec_attention)
            for fn, ntype, sel in [(layer.post_cross, "dec", ids), *self._halting(self.halt_dec, "dec", ids, end)]:
                apply_nodes(nodes, fn, ntype, sel)

        def cache(t):
            state["k"][t], state["v"][t] = (
                layers.append_keys(state["k"][t], data["k"]),
                layers.append_keys(state["v"][t], data["v"]),
            )

        length = int(pos[0]) + 1
        self._steps(data, state["pattern"], step)
        for t in range(self.config.max_depth):  # steps after all these tokens halted: their last keys
            if state["k"][t] is None or state["k"][t].shape[1] < length:
                cache(t)
        return self.embed.generator(self.dec_norm(self._final(data))), state


@hookimpl
def register_models(register):
    register("ut", UniversalTransformer, config=UTConfig)
