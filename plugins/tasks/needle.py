"""needle: a secret placed at a chosen depth of filler text, asked for at the end (an ``lm`` task).

An example is ``context + 1`` tokens of text::

    <filler ...> The secret number of Ada is 4821. <filler ...> What is the secret number of Ada? It is 4821
                 \\_ the needle, at depth d of the filler _/                                           \\_ scored

The filler is bland sentences drawn at random (the last one cut where the example reaches
``context + 1`` tokens); the needle goes in at the sentence boundary nearest to fraction ``d`` of
the filler's tokens (d = 0: before all of it, 1: after all of it, right before the question). The
name is one of the first ``n_names`` names, the number ``digits`` random digits. Only the answer's
tokens that write its digits are scored (teacher-forced, each in the group ``depth=d``: ``0.5`` is
``depth=0.50``); every other prediction, a space token before the number included, is left out. The
depths cycle through ``depths`` so that each has the same number of valid and test examples;
training examples draw theirs at random.

Written in text (``text = True``): with a pretrained model (``--model hf --set path=DIR``) every
piece (filler sentences, needle, question, the answer `` 4821``) is written with the model's own
tokenizer, as it writes the whole text (each piece begins with its space, as a word-level
pre-tokenizer splits), so the answer's tokens are known; lengths and depths count its tokens.
Otherwise every character is a token (the vocabulary: every character the task can write).

Metrics per phase: ``needle_acc`` (scored answer tokens right, over all depths),
``needle_acc_by_depth`` {depth: accuracy} and ``needles_by_depth`` {depth: scored answer tokens}.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gtx import Task, Vocab, disjoint_splits, grouped_accuracy, hookimpl, setting

FILLER = (
    "The grass is green and the sky is blue.",
    "A river runs past the old mill.",
    "The market opens early on Mondays.",
    "Rain fell on the roofs of the town all night.",
    "The road to the hills is long and quiet.",
    "Bread is baked before sunrise.",
    "Children walk to school along the canal.",
    "The library keeps its doors open late.",
    "A cat sleeps in the warm window.",
    "Boats rest in the harbour at low tide.",
    "The clock in the square strikes every hour.",
    "Apples ripen slowly in the orchard.",
    "Snow covers the fields in winter.",
    "The baker sells rolls and small cakes.",
    "Wind turns the sails of the mill.",
    "The train leaves the station at noon.",
    "Lamps are lit along the street at dusk.",
    "The garden is full of bees in June.",
)
NAMES = (
    "Ada",
    "Basil",
    "Clara",
    "Dmitri",
    "Edith",
    "Felix",
    "Greta",
    "Hugo",
    "Iris",
    "Jonas",
    "Karin",
    "Leon",
    "Mira",
    "Nils",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Soren",
    "Tara",
    "Ulla",
    "Viktor",
    "Wanda",
    "Yusuf",
)
NEEDLE = " The secret number of {name} is {value}."
QUESTION = " What is the secret number of {name}? It is"
ANSWER = " {value}"  # with its space, as the tokenizer writes the number after "It is"; only tokens that write digits are scored
DIGITS = "0123456789"


@dataclass
class NeedleConfig:
    context: int = setting(256, "tokens the model reads per example: filler, needle, question and answer", "[1, inf)")
    depths: str = setting(
        "0,0.25,0.5,0.75,1", "where the needle sits, as fractions of the filler (comma-separated, each in [0, 1])"
    )
    digits: int = setting(4, "digits of each secret number", "[1, 12]")
    n_names: int = setting(
        len(NAMES), f"names the secret belongs to, the first n of {len(NAMES)} fixed ones", f"[1, {len(NAMES)}]"
    )
    n_train: int = setting(2000, range="[1, inf)")
    n_valid: int = setting(200, range="[1, inf)")
    n_test: int = setting(200, range="[1, inf)")
    seed: int = 0

    def depth_list(self) -> list[float]:
        return [float(d) for d in self.depths.split(",")]

    def __post_init__(self) -> None:
        try:
            depths = self.depth_list()
        except ValueError:
            raise ValueError(f"depths={self.depths!r}: write fractions separated by commas, e.g. 0,0.5,1") from None
        if not all(0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"depths={self.depths!r}: every depth is a fraction of the filler, in [0, 1]")
        names = [group(d) for d in depths]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(
                f"depths={self.depths!r}: two depths share the group {twice}; give each depth once, differing in the first two decimals"
            )


def group(depth: float) -> str:
    return f"depth={depth:.2f}"


class Needle(Task):
    """A secret at a chosen depth of filler text, asked for at the end; accuracy of the answer per depth."""

    form = "lm"
    metric = "needle_acc"
    text = True
    cache = False  # fast to make, and a model's tokenizer changes it
    train_defaults = {"batch_size": 32, "eval_batch_size": 32}

    def tokens(self, text: str) -> list[str]:
        return self.tokenizer.tokenize(text) if self.tokenizer is not None else list(text)

    def make(
        self, rng: np.random.Generator, depth: float, filler_tokens: list[list[str]]
    ) -> tuple[list[str], list[str]]:
        """One example: ``context + 1`` tokens and one group per prediction; ``filler_tokens``: each
        filler sentence's tokens (with its leading space)."""
        c = self.config
        name, value = NAMES[rng.integers(c.n_names)], "".join(str(d) for d in rng.integers(0, 10, c.digits))
        needle, question, answer = (self.tokens(t.format(name=name, value=value)) for t in (NEEDLE, QUESTION, ANSWER))
        room = c.context + 1 - len(needle) - len(question) - len(answer)
        if room < 1:
            raise ValueError(
                f"context={c.context} holds no filler: the needle, question and answer take {c.context + 1 - room} tokens; "
                "raise context"
            )
        sentences, total = [], 0
        while total < room:
            sentences.append(filler_tokens[rng.integers(len(FILLER))])
            total += len(sentences[-1])
        # the last sentence is cut at room
        ends = [int(e) for e in np.cumsum([0] + [len(s) for s in sentences]) if e < room] + [room]
        filler = [t for s in sentences for t in s][:room]
        at = min(ends, key=lambda e: abs(e - depth * room))  # the sentence boundary nearest the depth
        tokens = filler[:at] + needle + filler[at:] + question + answer
        # not a lone space token before the digits
        scored = [group(depth) if any(ch in DIGITS for ch in t) else "" for t in answer]
        return tokens, [""] * (len(tokens) - 1 - len(answer)) + scored

    def generate(self):
        c = self.config
        rng = np.random.default_rng(c.seed)
        depths = c.depth_list()
        counts = {"train": 0, "valid": 0, "test": 0}
        filler_tokens = [self.tokens(" " + s) for s in FILLER]  # once, not per example: a model's tokenizer is slow

        def draw(split):
            i = counts[split]
            counts[split] += 1
            return self.make(
                rng, depths[rng.integers(len(depths))] if split == "train" else depths[i % len(depths)], filler_tokens
            )

        return disjoint_splits(draw, {"train": c.n_train, "valid": c.n_valid, "test": c.n_test})

    def vocabularies(self, train):
        """Characters of every sentence, name and digit the task can write: fixed by the task, not by the draw."""
        text = (
            "".join(FILLER)
            + "".join(NAMES)
            + NEEDLE.format(name="", value="")
            + QUESTION.format(name="")
            + DIGITS
            + " "
        )
        vocab = Vocab(sorted(set(text)))
        return vocab, vocab

    def declared_len(self) -> int:
        return self.config.context

    def context_len(self) -> int:
        return self.config.context

    def phase_metrics(self, loss, groups, split):
        return grouped_accuracy(groups, "needle_acc", "depth", "needles")


@hookimpl
def register_tasks(register):
    register("needle", Needle, config=NeedleConfig)
