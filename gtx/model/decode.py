"""Autoregressive decoding: greedy and beam search.

The decoder graph grows one token at a time: at every length the pattern's ``dd`` and ``ed`` edges
are built for the current prefix, exactly as in training (patterns are checked to be
prefix-consistent), and the encoder runs once. A model with incremental decoding
(``Seq2SeqModel.start_decoding``) computes only the latest token at each length, over its cached
keys and values: O(T) decoder work per sequence instead of O(T^2); others recompute the prefix.
"""

from __future__ import annotations

import dataclasses

import torch

from gtx.data.batch import Batch
from gtx.data.task import Task
from gtx.data.vocab import Vocab
from gtx.graph.pattern import Pattern
from gtx.graph.tokens import EdgeSet, batch_edges, build_graph, positions
from gtx.model.layers import Encoded, Seq2SeqModel


def _select(encoded: Encoded, src_lens: torch.Tensor, repeat: int) -> Encoded:
    """Repeat every sample's encoder nodes ``repeat`` times (one copy per beam hypothesis)."""
    if repeat == 1:
        return encoded
    starts = torch.cumsum(src_lens, 0) - src_lens
    index = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(starts.tolist(), src_lens.tolist()) for _ in range(repeat)]
    )
    index = index.to(encoded.x.device)
    fields = {f.name: getattr(encoded, f.name) for f in dataclasses.fields(encoded)}
    return Encoded(**{k: None if v is None else v[index] for k, v in fields.items()})


def latest_edges(pattern: Pattern, src_lens: list[int], length: int, device) -> dict[str, EdgeSet]:
    """The ``dd`` and ``ed`` edges into the last position of prefixes of ``length`` tokens, one per
    sample: queries are samples; ``dd`` keys are numbered sample * length + position, ``ed`` keys
    are the samples' encoder nodes."""
    lens = [length] * len(src_lens)
    out = {}
    for stage, key_lens in (("dd", lens), ("ed", src_lens)):
        e = batch_edges(pattern, stage, lens, key_lens)
        last = e.dst % length == length - 1
        out[stage] = EdgeSet(e.src[last], e.dst[last] // length, e.n_src, len(lens), stage).to(device)
    return out


@torch.no_grad()
def decode(
    model: Seq2SeqModel, task: Task, batch: Batch, pattern: Pattern, beam: int = 1, incremental: bool = True
) -> list[list[int]]:
    """Token ids of the best hypothesis per sample, without <sos> and <eos>; greedy when beam == 1.

    Hypotheses are scored by the sum of log-probabilities; the final choice among a sample's beams
    divides by the length (finished hypotheses keep their score). ``incremental=False`` recomputes
    the prefix even for a model that can decode incrementally (the reference it is tested against)."""
    device = batch.src.device
    src_lens = batch.graph.src_lens
    encoded = _select(model.encode(batch.src, batch.src_pos, batch.graph), src_lens, beam)
    start = getattr(model, "start_decoding", None)  # models need not subclass Seq2SeqModel
    # patterns that choose or learn at run time see the whole prefix, as in training: no incremental step
    state = start(encoded, pattern) if incremental and start and pattern.plain else None
    n_samples = len(src_lens)
    rep_lens = src_lens.repeat_interleave(beam).tolist()
    limits = torch.tensor([task.max_decode_len(n - 1) for n in rep_lens])  # sources end with <eos>
    seqs = torch.full((n_samples * beam, 1), Vocab.sos, dtype=torch.long)
    scores = torch.zeros(n_samples, beam)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    finished = torch.zeros(n_samples * beam, dtype=torch.bool)
    for t in range(int(limits.max())):
        length = seqs.shape[1]
        if state is None:
            graph = build_graph(pattern, rep_lens, [length] * len(rep_lens)).to(device)
            lens = torch.full((len(rep_lens),), length)
            logits = model.decode(encoded, seqs.flatten().to(device), positions(lens).to(device), graph).logits[
                length - 1 :: length
            ]
        else:
            pos = torch.full((len(rep_lens),), length - 1, device=device)
            logits, state = model.decode_next(
                state, seqs[:, -1].to(device), pos, latest_edges(pattern, rep_lens, length, device)
            )
        logp = torch.log_softmax(logits.float(), -1).cpu()  # the last position of each hypothesis
        vocab = logp.shape[1]
        logp[:, [Vocab.pad, Vocab.sos]] = float("-inf")  # never generated
        logp[finished] = float("-inf")
        logp[finished, Vocab.pad] = 0.0  # a finished hypothesis only extends with padding, at no cost
        cand = (scores.reshape(-1, 1) + logp).reshape(n_samples, beam * vocab)
        scores, flat = cand.topk(beam, dim=1)
        origin = (flat // vocab + torch.arange(n_samples)[:, None] * beam).flatten()
        token = (flat % vocab).flatten()
        seqs = torch.cat([seqs[origin], token[:, None]], 1)
        if state is not None and beam > 1:
            state = model.reorder_decoding(state, origin.to(device))
        finished = finished[origin] | (token == Vocab.eos) | (token == Vocab.pad) | (t + 1 >= limits)
        if bool(finished.all()):
            break
    hyps = [_strip(s) for s in seqs[:, 1:].tolist()]
    lengths = torch.tensor([len(h) + 1 for h in hyps], dtype=torch.float32).reshape(n_samples, beam)
    best = (scores / lengths).argmax(1)
    return [hyps[i * beam + int(b)] for i, b in enumerate(best)]


def _strip(ids: list[int]) -> list[int]:
    out = []
    for i in ids:
        if i in (Vocab.eos, Vocab.pad):
            break
        out.append(i)
    return out
