"""lm: a decoder-only language model (stage ``dd`` alone), plain or universal (shared layer, ACT).

Reads ``tokens[:-1]`` of an ``lm`` task's examples and predicts ``tokens[1:]``; the pattern's
``dd`` rule decides what each position sees (``causal`` is GPT's attention, ``local:w=64`` a
sliding window). Pre-norm layers, sinusoidal positions, the output projection tied to the token
embedding.
"""

from gtx import Output, SelfAttentionStack, StackConfig, hookimpl


class LanguageModel(SelfAttentionStack):
    """Decoder-only language model over dd edges; --set universal=true shares one layer with ACT."""

    forms = ("lm",)
    stage, ntype = "dd", "dec"
    torch_references = ("torch SDPA is_causal", "torch SDPA bool mask")  # GPT-style, is_causal or the pattern's mask

    @classmethod
    def references(cls, config):
        return () if config.universal else cls.torch_references  # no plain-torch model shares one layer with ACT

    def __init__(self, config: StackConfig, src_vocab, tgt_vocab, attention):
        super().__init__(config, src_vocab, tgt_vocab, attention, share=True)
        self.init_weights()

    def forward(self, batch):
        x, ponder, steps = self.states(self.embed.tgt, batch.tgt_in, batch.tgt_pos, batch.graph)
        return Output(self.embed.generator(x), ponder, steps)


@hookimpl
def register_models(register):
    register("lm", LanguageModel, config=StackConfig)
