"""Batches: a task's examples as flat node tensors (no padding) and their token graph, per form
(``gtx.data.task`` says what an example of each form is)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gtx.data.task import Task
from gtx.data.vocab import Vocab
from gtx.errors import GtxError
from gtx.graph.pattern import Pattern
from gtx.graph.tokens import TokenGraph, build_graph, positions

IGNORE = -100  # a target left out of the loss and the accuracy (cross_entropy's ignore_index)


@dataclass
class Batch:
    """A batch of examples as flat node tensors (no padding) and its token graph.

    ``src`` (N_enc,) encoder input ids (seq2seq: source + <eos>; classify: the tokens), None for
    lm; ``tgt_in`` (N_dec,) decoder input ids (seq2seq: <sos> + target; lm: tokens[:-1]), None for
    classify; ``src_pos``/``tgt_pos`` positions within each sample. ``targets`` are what the
    logits predict: (N_dec,) next tokens (``IGNORE`` where not scored) or (B,) labels (classify).
    ``group_ids`` (len(targets),) index ``group_names`` per target, -1 for none (lm tasks with groups)."""

    src: torch.Tensor | None
    src_pos: torch.Tensor | None
    tgt_in: torch.Tensor | None
    tgt_pos: torch.Tensor | None
    targets: torch.Tensor
    graph: TokenGraph
    split: str
    index: list[int]  # example indices in the split
    group_ids: torch.Tensor | None = None
    group_names: list[str] = dataclasses.field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Tokens the model computes per pass: decoder tokens (seq2seq, lm), else source tokens."""
        return int((self.tgt_in if self.tgt_in is not None else self.src).numel())

    def to(self, device) -> Batch:
        tensors = ("src", "src_pos", "tgt_in", "tgt_pos", "targets", "group_ids")
        move = {f: None if getattr(self, f) is None else getattr(self, f).to(device) for f in tensors}
        return dataclasses.replace(self, **move, graph=self.graph.to(device))


def _flat(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Concatenated ids, positions within each sequence, and lengths."""
    lens = [len(x) for x in seqs]
    return torch.tensor([i for x in seqs for i in x], dtype=torch.long), positions(torch.tensor(lens)), lens


def make_batch(task: Task, split: str, index: list[int], pattern: Pattern) -> Batch:
    """The batch of examples ``index`` of a split, with its token graph under ``pattern``."""
    examples = [task.splits()[split][i] for i in index]
    if task.form == "lm":
        ids = [task.src_vocab.encode(x) for x, _ in examples]
        tgt_in, tgt_pos, lens = _flat([x[:-1] for x in ids])
        targets = torch.tensor([i for x in ids for i in x[1:]], dtype=torch.long)
        group_ids, names = _groups([g for _, g in examples], lens)
        if group_ids is not None:
            targets[group_ids == -2] = IGNORE
            group_ids[group_ids == -2] = -1
        graph = build_graph(pattern, None, lens)
        return Batch(None, None, tgt_in, tgt_pos, targets, graph, split, index, group_ids, names)
    src, src_pos, src_lens = _flat(
        [task.src_vocab.encode(s) + ([] if task.form == "classify" else [Vocab.eos]) for s, _ in examples]
    )
    if task.form == "classify":
        targets = torch.tensor([task.tgt_vocab.encode(y)[0] for _, y in examples], dtype=torch.long)
        return Batch(src, src_pos, None, None, targets, build_graph(pattern, src_lens), split, index)
    eos = [Vocab.eos] if task.eos else []
    tgt_out = [task.tgt_vocab.encode(t) + eos for _, t in examples]
    # teacher forcing: the output shifted right
    tgt_in, tgt_pos, tgt_lens = _flat([([Vocab.sos] + t)[:-1] for t in tgt_out])
    targets = torch.tensor([i for t in tgt_out for i in t], dtype=torch.long)
    return Batch(src, src_pos, tgt_in, tgt_pos, targets, build_graph(pattern, src_lens, tgt_lens), split, index)


def _groups(groups: list[Sequence[str]], lens: list[int]) -> tuple[torch.Tensor | None, list[str]]:
    """Per-target group ids of lm examples: -2 for "" (not scored), -1 for no group at all."""
    if not any(groups):
        return None, []
    names = sorted({g for gs in groups for g in gs if g})
    code = {g: i for i, g in enumerate(names)} | {"": -2}
    ids = []
    for gs, n in zip(groups, lens):
        if gs and len(gs) != n:
            raise GtxError(f"an lm example has {len(gs)} groups for {n} predictions; give one per prediction or none")
        ids += [code[g] for g in gs] if gs else [-1] * n
    return torch.tensor(ids, dtype=torch.long), names


def batches(
    task: Task,
    split: str,
    pattern: Pattern,
    batch_size: int,
    shuffle_seed: int | None = None,
    part: tuple[int, int] = (0, 1),
) -> Iterator[Batch]:
    """Batches of ``batch_size`` examples; shuffled by ``shuffle_seed`` (None keeps the order).
    ``part=(r, n)``: examples r, r + n, ... of each batch (data-parallel rank r of n); a last batch
    with fewer than n examples is left out then, since every rank must take a step."""
    data = task.splits()[split]
    order = list(range(len(data)))
    if shuffle_seed is not None:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    rank, size = part
    for i in range(0, len(order), batch_size):
        chunk = order[i : i + batch_size]
        if len(chunk) >= size:
            yield make_batch(task, split, chunk[rank::size], pattern)
