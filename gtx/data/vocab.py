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
    ``vocab`` (a ``ModelVocab``), ``tokenize(text) -> tokens`` and ``detokenize(tokens) -> text``;
    where it has them, its chat template (``chat``) and the tokens that end a text (``stop_tokens``)."""

    vocab: Vocab

    def tokenize(self, text: str) -> list[str]:
        raise NotImplementedError

    def detokenize(self, tokens: Sequence[str]) -> str:
        raise NotImplementedError

    def n_bytes(self, tokens: Sequence[str]) -> int:
        """UTF-8 bytes of the text these tokens write: what bits per byte divide by."""
        return len(self.detokenize(tokens).encode("utf-8"))

    def chat(self, turns: Sequence[tuple[str, str]]) -> str | None:
        """The conversation ``turns`` ((role, text) pairs: ``user``, ``assistant``) in the model's chat
        template, up to where the assistant's next turn begins; None: the model has no chat template."""
        return None

    def stop_tokens(self) -> list[str]:
        """The tokens after which a generated text has ended (an end-of-sequence token), if any."""
        return []
