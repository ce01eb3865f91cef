"""encoder: an encoder-only classifier (stage ``ee`` alone), plain or universal (shared layer, ACT).

Reads a ``classify`` task's tokens, runs the stack over the pattern's ``ee`` edges, averages each
sample's final states (mean pooling, as LRA's encoders do) and predicts one label per sample.
"""

import torch
from torch import nn

from gtx import Output, SelfAttentionStack, StackConfig, hookimpl


class EncoderClassifier(SelfAttentionStack):
    """Encoder-only classifier over ee edges, mean-pooled; --set universal=true shares one layer with ACT."""

    forms = ("classify",)
    stage, ntype = "ee", "enc"

    def __init__(self, config: StackConfig, src_vocab, tgt_vocab, attention):
        super().__init__(config, src_vocab, tgt_vocab, attention, share=False)
        self.classifier = nn.Linear(config.dim, len(tgt_vocab))
        self.init_weights()

    def forward(self, batch):
        x, ponder, steps = self.states(self.embed.src, batch.src, batch.src_pos, batch.graph)
        lens = batch.graph.src_lens.to(x.device)
        sample = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
        pooled = x.new_zeros(len(lens), x.shape[1]).index_add(0, sample, x) / lens[:, None].to(x.dtype)
        return Output(self.classifier(pooled), ponder, steps)


@hookimpl
def register_models(register):
    register("encoder", EncoderClassifier, config=StackConfig)
