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


class ModelVocab(Vocab):
    """A pretrained model's vocabulary: token ``i`` is the model's id ``i`` (no gtx special tokens
    in front), so ids reach the model's embedding rows unchanged. Tokens come from the model's own
    tokenizer, so every token a task writes with it is known."""

    def __init__(self, tokens: Sequence[str]):
        self.itos = list(tokens)
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    def encode(self, tokens: Sequence[str]) -> list[int]:
        return [self.stoi[t] for t in tokens]


class Tokenizer:
    """What a model that reads text with its own tokenizer gives the tasks (``GraphModel.tokenizer``):
    ``vocab`` (a ``ModelVocab``), ``tokenize(text) -> tokens`` and ``detokenize(tokens) -> text``."""

    vocab: Vocab

    def tokenize(self, text: str) -> list[str]:
        raise NotImplementedError

    def detokenize(self, tokens: Sequence[str]) -> str:
        raise NotImplementedError

    def n_bytes(self, tokens: Sequence[str]) -> int:
        """UTF-8 bytes of the text these tokens write: what bits per byte divide by."""
        return len(self.detokenize(tokens).encode("utf-8"))
