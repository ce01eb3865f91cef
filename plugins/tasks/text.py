"""text: character- or byte-level language modelling of one text, scored in bits per character.

An example is a window of ``context + 1`` consecutive tokens (characters, or bytes): the model reads
the first ``context`` and predicts the last ``context``. Windows are taken in order with stride
``context``, so each split's predictions cover its text once, without overlap (every token but the
split's first and the tail past the last whole window).

Data (``--set data_file=PATH``, default: the built-in corpus):

- the built-in corpus is the King James Bible (public domain, ~4.1 M characters, 66 distinct;
  ``data/kjv.txt.xz`` beside this file, described in ``data/README.md``);
- any UTF-8 text file is read character by character (``--set tokens=byte`` reads its bytes);
- ``enwik8`` and ``text8`` are recognised by file name (``enwik8``, ``text8``, or their distributed
  one-member archives ``enwik8.zip``, ``text8.zip``, read directly): enwik8 is byte-level (each
  byte one token), text8 character-level. ``.xz`` and ``.gz`` files are decompressed too.

Every file is split in order: the first 90% train, the next 5% valid, the last 5% test; for enwik8
and text8 (10^8 tokens each) this is the standard 90M/5M/5M split. ``train_tokens`` and
``eval_tokens`` keep CPU epochs and evaluations affordable by reading only the start of a split.

The metric is ``bpc``: the mean cross-entropy per predicted token in bits (nats / ln 2); at byte
level this is bits per byte, still reported as bpc (as enwik8 results are).

With a model that reads text with its own tokenizer (``--model hf --set path=DIR``), each split's
text (cut 90/5/5 by characters as above) is written in the model's tokens, and ``train_tokens`` and
``eval_tokens`` count characters, so models with different tokenizers read the same text. ``bpc``
is then bits per UTF-8 byte of the predicted text (the nats of a split's predictions over its
bytes), comparable across tokenizers and, on ASCII text, with character-level models.
"""

from __future__ import annotations

import gzip
import lzma
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from gtx import Task, Vocab, hookimpl, setting

BUILTIN = Path(__file__).resolve().parent / "data" / "kjv.txt.xz"
PERCENT = (90, 95)  # the train/valid and valid/test boundaries, in percent of the text
BYTE_LEVEL = {"enwik8"}  # file stems read byte by byte under tokens=auto


@dataclass
class TextConfig:
    context: int = setting(512, "tokens the model reads per example (windows of context+1, stride context)", "[1, inf)")
    data_file: str = field(
        default="", metadata={"help": "text file, enwik8, text8 (or their .zip); empty: the built-in King James Bible"}
    )
    tokens: str = field(default="auto", metadata={"help": "char, byte, or auto (byte for enwik8, else char)"})
    train_tokens: int = field(default=0, metadata={"help": "train on the first N tokens of the train split (0 = all)"})
    eval_tokens: int = field(
        default=131072,
        metadata={
            "help": "evaluate on the first N tokens of valid and test (0 = all, e.g. for reported enwik8 numbers)"
        },
    )


class Windows:
    """The examples of one split: window i is ``(text[begin : begin + context + 1], [])`` with
    ``begin = start + i * context``, cut on access from one string the splits share (no copies,
    nothing per character). ``limit`` ends the windows early (train_tokens, eval_tokens) but not
    the split (``split_text``)."""

    def __init__(self, text: str, start: int, end: int, context: int, limit: int = 0):
        self.text, self.start, self.end, self.context = text, start, end, context
        stop = min(end, start + limit + 1) if limit else end  # +1: a split's first token is read, never predicted
        self.n = max(stop - start - 1, 0) // context

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[str, list]:
        if not -self.n <= i < self.n:
            raise IndexError(f"window {i} of {self.n}")
        begin = self.start + (i % self.n) * self.context
        return self.text[begin : begin + self.context + 1], []

    def split_text(self) -> str:
        """The whole split's text, windows or not."""
        return self.text[self.start : self.end]


def split_bounds(n: int) -> tuple[int, int]:
    """Where train ends and test begins in a text of n tokens (90/5/5, in order; integer maths, so
    10^8 tokens split exactly 90M/5M/5M)."""
    return n * PERCENT[0] // 100, n * PERCENT[1] // 100


def min_length(context: int) -> int:
    """The shortest text whose valid and test splits each hold one window of context + 1 tokens."""

    def fits(n):
        a, b = split_bounds(n)
        return min(b - a, n - b) >= context + 1

    n = 20 * (context + 1)  # valid and test are 5% each: this is within a few dozen tokens of the answer
    while not fits(n):
        n += 1
    while fits(n - 1):
        n -= 1
    return n


def read_bytes(path: Path) -> bytes:
    """The file's bytes; ``.zip`` (one member), ``.xz`` and ``.gz`` are decompressed."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            members = [m for m in z.infolist() if not m.is_dir()]
            if len(members) != 1:
                raise ValueError(
                    f"data_file {path} holds {len(members)} files; a .zip must hold exactly one (as enwik8.zip and text8.zip do)"
                )
            return z.read(members[0])
    if path.suffix == ".xz":
        return lzma.decompress(path.read_bytes())
    if path.suffix == ".gz":
        return gzip.decompress(path.read_bytes())
    return path.read_bytes()


def load_text(path: str, tokens: str) -> str:
    """The file as one string, one character per token: UTF-8 for ``char``, latin-1 for ``byte``
    (each byte one character)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"data_file {path}: no such file; give --set data_file=PATH of a text file, or leave it empty for the built-in corpus"
        )
    data = read_bytes(p)
    if not data:
        raise ValueError(f"data_file {path} is empty; give a text file with some text in it")
    if tokens == "byte":
        return data.decode("latin-1")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data_file {path} is not UTF-8 (byte offset {e.start:,}: 0x{data[e.start]:02x}); "
            "read it byte by byte with --set tokens=byte"
        ) from None


def corpus_name(path: Path) -> str:
    """The file's name without compression suffixes: enwik8.zip -> enwik8."""
    name = path.name
    for suffix in (".zip", ".xz", ".gz"):
        name = name.removesuffix(suffix)
    return name


class Text(Task):
    """Character/byte-level language modelling (default: the King James Bible); bits per character."""

    form = "lm"
    metric = "bpc"
    cache = False  # reading the file is fast; megabytes of windows do not belong in a JSON cache
    text = True
    # 128 windows of 512+ tokens (the trainer's default) is 64k+ tokens a step: minutes per step on a CPU
    train_defaults = {"batch_size": 16, "eval_batch_size": 16}

    @property
    def path(self) -> Path:
        return Path(self.config.data_file) if self.config.data_file else BUILTIN

    @property
    def level(self) -> str:
        """``char`` or ``byte``: ``tokens`` with ``auto`` resolved by the file name."""
        if self.config.tokens != "auto":
            return self.config.tokens
        return "byte" if corpus_name(self.path) in BYTE_LEVEL else "char"

    def generate(self):
        c = self.config
        if c.tokens not in ("auto", "char", "byte"):
            raise ValueError(f"tokens must be auto, char or byte, got {c.tokens!r}; e.g. --set tokens=byte")
        if c.context < 1:
            raise ValueError(f"context must be >= 1, got {c.context}")
        if c.train_tokens < 0 or c.eval_tokens < 0:
            raise ValueError(
                f"train_tokens and eval_tokens must be >= 0 (0 = all), got {c.train_tokens}, {c.eval_tokens}"
            )
        for name in ("train_tokens", "eval_tokens"):
            if 0 < getattr(c, name) < c.context:
                raise ValueError(
                    f"{name}={getattr(c, name)} is less than one window; set it >= context={c.context} (or 0 for all)"
                )
        text = load_text(str(self.path), self.level)
        n = len(text)
        need = min_length(c.context)
        if n < need:
            unit = "bytes" if self.level == "byte" else "characters"
            raise ValueError(
                f"data_file {self.path} has {n:,} {unit}, too short for one window of context+1={c.context + 1} in each of "
                f"train/valid/test (90/5/5); it must be at least {need:,} {unit}, or lower --set context"
            )
        a, b = split_bounds(n)
        bounds = {"train": (0, a, c.train_tokens), "valid": (a, b, c.eval_tokens), "test": (b, n, c.eval_tokens)}
        if self.tokenizer is None:
            return {split: Windows(text, start, end, c.context, limit) for split, (start, end, limit) in bounds.items()}
        splits, self._tokens_per_byte = {}, {}
        for split, (start, end, limit) in bounds.items():
            tokens = self.tokenizer.tokenize(text[start : min(end, start + limit) if limit else end])
            splits[split] = Windows(tokens, 0, len(tokens), c.context)
            predicted = tokens[1 : 1 + len(splits[split]) * c.context]
            self._tokens_per_byte[split] = len(predicted) / max(self.tokenizer.n_bytes(predicted), 1)
        return splits

    def vocabularies(self, train):
        """One vocabulary for input and output: all 256 bytes, or the characters of the whole train
        split (not only its first train_tokens: the vocabulary must not change with the limit); a
        character only valid or test have becomes <unk>."""
        vocab = Vocab([chr(i) for i in range(256)] if self.level == "byte" else sorted(set(train.split_text())))
        return vocab, vocab

    def declared_len(self) -> int:
        """Every window is ``context`` tokens: the settings say it, and it is the longest a model reads."""
        return self.config.context

    context_len = declared_len

    def phase_metrics(self, loss, groups, split):
        """``bpc``: ``loss`` (mean nats per predicted token) in bits; per byte under a model's tokenizer."""
        per_token = loss / math.log(2)
        return {"bpc": per_token * self._tokens_per_byte[split] if self.tokenizer is not None else per_token}


@hookimpl
def register_tasks(register):
    register("text", Text, config=TextConfig)
