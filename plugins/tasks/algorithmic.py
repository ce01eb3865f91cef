"""Algorithmic tasks: copy and sort (the DGL tutorial's), reverse and addition (the Universal
Transformer paper's, with length generalisation)."""

from dataclasses import dataclass, field

import numpy as np

from gtx import Task, Vocab, disjoint_splits, hookimpl, setting

LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
DIGITS = [str(d) for d in range(10)]


@dataclass
class LetterConfig:
    n_train: int = setting(9000, "training examples", "[1, inf)")
    n_valid: int = setting(1000, range="[1, inf)")
    n_test: int = setting(1000, range="[1, inf)")
    mean_len: float = setting(15.0, "lengths are int(N(mean_len, std_len)), at least 1", "[1, inf)")
    std_len: float = setting(3.0, range="[0, inf)")
    seed: int = 0


class LetterTask(Task):
    """Sequences of letters a-z with lengths int(N(15, 3)) clipped to >= 1 (the DGL tutorial's data)."""

    def transform(self, seq: list[str]) -> list[str]:
        raise NotImplementedError

    def generate(self):
        c = self.config
        rng = np.random.default_rng(c.seed)

        def draw(split):
            seq = [str(t) for t in rng.choice(LETTERS, max(int(rng.normal(c.mean_len, c.std_len)), 1))]
            return seq, self.transform(seq)

        return disjoint_splits(draw, {"train": c.n_train, "valid": c.n_valid, "test": c.n_test})

    def max_decode_len(self, src_len):
        return src_len + 1

    def declared_len(self) -> int:
        return int(self.config.mean_len) + 1  # about half the sequences are this long or longer (with <eos>)


class Copy(LetterTask):
    """Copy: the target is the source (letters a-z, lengths ~ N(15, 3))."""

    def transform(self, seq):
        return list(seq)


class Sort(LetterTask):
    """Sort: the target is the source sorted, duplicates kept (letters a-z, lengths ~ N(15, 3))."""

    def transform(self, seq):
        return sorted(seq)


@dataclass
class DigitConfig:
    n_train: int = setting(9000, range="[1, inf)")
    n_valid: int = setting(1000, range="[1, inf)")
    n_test: int = setting(1000, range="[1, inf)")
    train_len: int = setting(20, "train and valid lengths are uniform on 1..train_len", "[1, inf)")
    test_len: int = setting(40, "test lengths are uniform on train_len+1..test_len (generalisation)", "[1, inf)")
    generalise: bool = field(default=True, metadata={"help": "False: test lengths like train"})
    seed: int = 0


class DigitTask(Task):
    """Base of the decimal tasks: lengths uniform on 1..L for train/valid, longer for test."""

    def example(self, rng, length: int):
        raise NotImplementedError

    def generate(self):
        c = self.config
        if c.train_len < 1 or (c.generalise and c.test_len <= c.train_len):
            raise ValueError(f"need train_len >= 1 and test_len > train_len, got {c.train_len}, {c.test_len}")
        rng = np.random.default_rng(c.seed)

        def draw(split):
            lo, hi = (c.train_len + 1, c.test_len) if split == "test" and c.generalise else (1, c.train_len)
            return self.example(rng, int(rng.integers(lo, hi + 1)))

        return disjoint_splits(draw, {"train": c.n_train, "valid": c.n_valid, "test": c.n_test})

    def vocabularies(self, train):
        return Vocab(DIGITS + ["+"]), Vocab(DIGITS)  # fixed: longer test data must not be <unk>

    def max_decode_len(self, src_len):
        return src_len + 2

    def declared_len(self) -> int:
        c = self.config
        lo, hi = (c.train_len + 1, c.test_len) if c.generalise else (1, c.train_len)
        return (lo + hi) // 2 + 1  # about half the test sequences are this long or longer (with <eos>)


class Reverse(DigitTask):
    """Reverse: the target is the source reversed (digits; test on longer sequences)."""

    def example(self, rng, length):
        seq = [str(d) for d in rng.integers(0, 10, length)]
        return seq, seq[::-1]


def little_endian_number(rng, length: int) -> list[int]:
    """Digits least-significant first; the most significant is non-zero unless the length is 1."""
    digits = [int(d) for d in rng.integers(0, 10, length)]
    if length > 1 and digits[-1] == 0:
        digits[-1] = int(rng.integers(1, 10))
    return digits


class Addition(DigitTask):
    """Addition: little-endian a + b -> little-endian sum (test on longer inputs)."""

    def example(self, rng, length):
        """An input of exactly ``length`` tokens (at least 3): a, '+', b, digits little-endian as in
        tensor2tensor. t2t draws both lengths below a maximum; an exact total length is what makes
        the test split strictly longer than training."""
        length = max(length, 3)
        l1 = int(rng.integers(1, length - 1))  # 1..length-2
        a, b = little_endian_number(rng, l1), little_endian_number(rng, length - 1 - l1)
        total = sum(d * 10**i for i, d in enumerate(a)) + sum(d * 10**i for i, d in enumerate(b))
        src = [str(d) for d in a] + ["+"] + [str(d) for d in b]
        return src, list(str(total)[::-1])


@hookimpl
def register_tasks(register):
    register("copy", Copy, config=LetterConfig)
    register("sort", Sort, config=LetterConfig)
    register("reverse", Reverse, config=DigitConfig)
    register("addition", Addition, config=DigitConfig)
