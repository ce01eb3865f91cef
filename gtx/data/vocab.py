"""Vocabularies: tokens <-> ids, the four special tokens first."""

from __future__ import annotations

from collections.abc import Sequence

PAD, SOS, EOS, UNK = "<pad>", "<sos>", "<eos>", "<unk>"


class Vocab:
    """Token <-> id; ids 0..3 are <pad>, <sos>, <eos>, <unk>."""

    def __init__(self, tokens: Sequence[str]):
        self.itos = [PAD, SOS, EOS, UNK] + [t for t in dict.fromkeys(tokens) if t not in (PAD, SOS, EOS, UNK)]
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.itos == other.itos

    def encode(self, tokens: Sequence[str]) -> list[int]:
        unk = self.stoi[UNK]
        return [self.stoi.get(t, unk) for t in tokens]

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.itos[i] for i in ids]

    sos, eos, pad = 1, 2, 0
