"""translation: parallel text from a folder in the Multi30k layout, BLEU with sacrebleu.

``--set data_dir=DIR`` with ``train.src``/``train.tgt``, ``val.src``/``val.tgt``,
``test.src``/``test.tgt``: one sentence per line, lines aligned. Tokens are words (split on
whitespace) or characters; the vocabulary comes from the training split.
"""

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gtx import GtxError, Task, Vocab, hookimpl, setting

FILES = {"train": "train", "valid": "val", "test": "test"}


@dataclass
class TranslationConfig:
    data_dir: str = field(default="", metadata={"help": "folder with train/val/test .src and .tgt files"})
    tokens: str = field(default="word", metadata={"help": "word or char"})
    lowercase: bool = True
    min_freq: int = setting(1, "rarer training tokens become <unk>", "[1, inf)")
    max_len: int = setting(100, "drop training pairs longer than this (tokens)", "[1, inf)")
    beam: int = setting(4, "beam width for test decoding (1 = greedy)", "[1, inf)")


class Translation(Task):
    """Translation: parallel text from data_dir (Multi30k layout); BLEU on test (sacrebleu)."""

    metric = "bleu"

    cache = False  # the files are the data; tokenising them is cheap

    def tokenize(self, line: str) -> list[str]:
        line = line.strip().lower() if self.config.lowercase else line.strip()
        return list(line) if self.config.tokens == "char" else line.split()

    def detokenize(self, tokens: list[str]) -> str:
        return "".join(tokens) if self.config.tokens == "char" else " ".join(tokens)

    def generate(self):
        c = self.config
        if c.tokens not in ("word", "char"):
            raise GtxError(f"task translation: tokens must be 'word' or 'char', got {c.tokens!r}")
        if not c.data_dir:
            raise GtxError("task translation needs its data: --set data_dir=DIR (train.src/train.tgt, val.*, test.*)")
        root = Path(c.data_dir)
        out = {}
        for split, stem in FILES.items():
            paths = [root / f"{stem}.src", root / f"{stem}.tgt"]
            missing = [str(p) for p in paths if not p.is_file()]
            if missing:
                raise GtxError(
                    f"task translation: missing {', '.join(missing)}; data_dir needs train, val and test .src/.tgt files"
                )
            src, tgt = (_lines(p) for p in paths)
            if len(src) != len(tgt):
                raise GtxError(f"task translation: {paths[0]} has {len(src)} lines but {paths[1]} has {len(tgt)}")
            pairs = [(self.tokenize(s), self.tokenize(t)) for s, t in zip(src, tgt)]
            pairs = [(s, t) for s, t in pairs if s and t]
            if not pairs:
                raise GtxError(f"task translation: {paths[0]} and {paths[1]} hold no pair of non-empty lines")
            if split == "train":
                pairs = [(s, t) for s, t in pairs if len(s) <= c.max_len and len(t) <= c.max_len]
            out[split] = pairs
        return out

    def vocabularies(self, train):
        def vocab(side):
            counts = Counter(t for pair in train for t in pair[side])
            return Vocab(sorted(t for t, n in counts.items() if n >= self.config.min_freq))

        return vocab(0), vocab(1)

    def max_decode_len(self, src_len):
        return int(1.5 * src_len) + 10

    def metrics(self, hypotheses, references):
        import sacrebleu

        hyp = [self.detokenize(h) for h in hypotheses]
        ref = [self.detokenize(r) for r in references]
        tokenize = "char" if self.config.tokens == "char" else "13a"
        return {"bleu": sacrebleu.corpus_bleu(hyp, [ref], tokenize=tokenize).score}


@hookimpl
def register_tasks(register):
    register("translation", Translation, config=TranslationConfig)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise GtxError(
            f"task translation: {path} is not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at {e.start})"
        ) from None
