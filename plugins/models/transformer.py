"""transformer: the encoder-decoder of the DGL tutorial, written as update_graph calls.

Pre-norm sub-layers as in the DGL tutorial (and the Annotated Transformer): ``x + dropout(sublayer(LN(x)))``,
a final LayerNorm on each stack, sinusoidal positions, optional shared embeddings.
"""

from dataclasses import dataclass, field

from torch import nn

from gtx import Output, Seq2SeqModel, hookimpl, layer_attention, layers, propagate_attention, setting, update_graph


@dataclass
class TransformerConfig:
    layers: int = setting(2, "encoder and decoder layers", "[1, inf)")
    heads: int = setting(4, range="[1, inf)")
    dim: int = setting(128, "d_model", "[1, inf)")
    dim_ff: int = setting(512, range="[1, inf)")
    dropout: float = setting(0.1, range="[0, 1)")
    share_embeddings: bool = field(
        default=True, metadata={"help": "tie source/target embeddings and the output projection"}
    )
    embed_scale: float = setting(
        4.0, "token embeddings are multiplied by this (the DGL tutorial: sqrt(dim))", "(0, inf)"
    )


class Transformer(Seq2SeqModel):
    """Transformer encoder-decoder (Vaswani et al.) as message passing over ee, dd and ed edges."""

    torch_references = ("torch.nn",)  # torch.nn.Transformer of the same sizes
    positions = layers.POSITIONS  # its embeddings' table: the longest sequence it reads

    def __init__(self, config: TransformerConfig, src_vocab, tgt_vocab, attention):
        super().__init__(attention)
        self.embed = layers.Embeddings(
            src_vocab, tgt_vocab, config.dim, config.dropout, config.share_embeddings, config.embed_scale
        )
        self.encoder = nn.ModuleList(
            layers.EncoderLayer(config.heads, config.dim, config.dim_ff, config.dropout) for _ in range(config.layers)
        )
        self.decoder = nn.ModuleList(
            layers.DecoderLayer(config.heads, config.dim, config.dim_ff, config.dropout) for _ in range(config.layers)
        )
        # each layer's own trainable attention (patterns with parameters: nsa, dsa)
        self.enc_attention = nn.ModuleList(layer_attention(attention) for _ in self.encoder)
        self.dec_attention = nn.ModuleList(layer_attention(attention) for _ in self.decoder)
        self.enc_norm, self.dec_norm = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.init_weights()

    def encode(self, src, src_pos, graph):
        nodes = {"enc": {"x": self.embed.embed(self.embed.src, src, src_pos)}}
        for layer, attention in zip(self.encoder, self.enc_attention):
            update_graph(
                nodes, "ee", graph.edges["ee"], [(layer.pre, "enc", None)], [(layer.post, "enc", None)], attention
            )
        return layers.Encoded(self.enc_norm(nodes["enc"]["x"]))

    def decode(self, encoded, tgt_in, tgt_pos, graph):
        nodes = {"enc": {"x": encoded.x}, "dec": {"x": self.embed.embed(self.embed.tgt, tgt_in, tgt_pos)}}
        for layer, attention in zip(self.decoder, self.dec_attention):
            update_graph(
                nodes,
                "dd",
                graph.edges["dd"],
                [(layer.pre_self, "dec", None)],
                [(layer.post_self, "dec", None)],
                attention,
            )
            update_graph(
                nodes,
                "ed",
                graph.edges["ed"],
                [(layer.pre_query, "dec", None), (layer.pre_memory, "enc", None)],
                [(layer.post_cross, "dec", None)],
                attention,
            )
        return Output(self.embed.generator(self.dec_norm(nodes["dec"]["x"])))

    def start_decoding(self, encoded, pattern):
        memory = [layer.pre_memory({"x": encoded.x}) for layer in self.decoder]  # ed keys/values, fixed
        return {"memory": memory, "k": [None] * len(self.decoder), "v": [None] * len(self.decoder)}

    def decode_next(self, state, tokens, pos, edges):
        """The decoder for the latest token of each hypothesis: the same sub-layers as ``decode``,
        over self-attention keys/values cached per layer."""
        x = self.embed.embed(self.embed.tgt, tokens, pos)
        for i, layer in enumerate(self.decoder):
            new = layer.pre_self({"x": x})
            state["k"][i], state["v"][i] = (
                layers.append_keys(state["k"][i], new["k"]),
                layers.append_keys(state["v"][i], new["v"]),
            )
            wv = propagate_attention(
                new["q"], state["k"][i].flatten(0, 1), state["v"][i].flatten(0, 1), edges["dd"], self.dec_attention[i]
            )
            x = layer.post_self({"x": x, "wv": wv})["x"]
            memory = state["memory"][i]
            wv = propagate_attention(
                layer.pre_query({"x": x})["q"], memory["k"], memory["v"], edges["ed"], self.dec_attention[i]
            )
            x = layer.post_cross({"x": x, "wv": wv})["x"]
        return self.embed.generator(self.dec_norm(x)), state


@hookimpl
def register_models(register):
    register("transformer", Transformer, config=TransformerConfig)
