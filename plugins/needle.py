"""needle: a secret placed at a chosen depth of filler text, asked for at the end (an ``lm`` task).

An example is ``context + 1`` tokens of text::

    <filler ...> The secret number of Ada is 4821. <filler ...> What is the secret number of Ada? It is 4821
                 \\_ the needle, at depth d of the filler _/                                           \\_ scored

The filler is bland sentences drawn at random; the needle goes in at the sentence boundary nearest
to fraction ``d`` of the filler's tokens (d = 0: before all of it, 1: after all of it, right before
the question). Only the answer's tokens are scored (teacher-forced, each in the group ``depth=d``);
every other prediction is left out. The depths cycle through ``depths`` so that each has the same
number of valid and test examples.

Written in text (``text = True``): with a pretrained model (``--model hf --set path=DIR``) every
piece is written with the model's own tokenizer and lengths and depths count its tokens; otherwise
every character is a token. Metrics per phase: ``needle_acc`` (answer tokens right, over all
depths), ``needle_acc_by_depth`` {depth: accuracy} and ``needles_by_depth`` {depth: answer tokens}.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gtx import hookimpl
from gtx.data.task import Task, Vocab, disjoint_splits, grouped_accuracy
from gtx.values import setting

FILLER = (
    "The grass is green and the sky is blue.", "A river runs past the old mill.", "The market opens early on Mondays.",
    "Rain fell on the roofs of the town all night.", "The road to the hills is long and quiet.", "Bread is baked before sunrise.",
    "Children walk to school along the canal.", "The library keeps its doors open late.", "A cat sleeps in the warm window.",
    "Boats rest in the harbour at low tide.", "The clock in the square strikes every hour.", "Apples ripen slowly in the orchard.",
    "Snow covers the fields in winter.", "The baker sells rolls and small cakes.", "Wind turns the sails of the mill.",
    "The train leaves the station at noon.", "Lamps are lit along the street at dusk.", "The garden is full of bees in June.",
)
NAMES = ("Ada", "Basil", "Clara", "Dmitri", "Edith", "Felix", "Greta", "Hugo", "Iris", "Jonas", "Karin", "Leon", "Mira", "Nils",
         "Olga", "Pavel", "Quinn", "Rosa", "Soren", "Tara", "Ulla", "Viktor", "Wanda", "Yusuf")
NEEDLE = " The secret number of {name} is {value}."
QUESTION = " What is the secret number of {name}? It is "  # the answer is the number alone: its digits are what is scored


@dataclass
class NeedleConfig:
    context: int = setting(256, "tokens the model reads per example: filler, needle, question and answer", "[1, inf)")
    depths: str = setting("0,0.25,0.5,0.75,1", "where the needle sits, as fractions of the filler (comma-separated, each in [0, 1])")
    digits: int = setting(4, "digits of each secret number", "[1, 12]")
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
        if not depths or not all(0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"depths={self.depths!r}: every depth is a fraction of the filler, in [0, 1]")


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

    def make(self, rng: np.random.Generator, depth: float) -> tuple[list[str], list[str]]:
        """One example: ``context + 1`` tokens and one group per prediction."""
        c = self.config
        name, value = NAMES[rng.integers(len(NAMES))], "".join(str(d) for d in rng.integers(0, 10, c.digits))
        needle, question, answer = (self.tokens(t) for t in (NEEDLE.format(name=name, value=value), QUESTION.format(name=name), value))
        room = c.context + 1 - len(needle) - len(question) - len(answer)
        if room < 1:
            raise ValueError(f"context={c.context} holds no filler: the needle, question and answer take {c.context + 1 - room} tokens; "
                             "raise context")
        sentences, total = [], 0
        while total < room:
            sentences.append(self.tokens(" " + FILLER[rng.integers(len(FILLER))]))
            total += len(sentences[-1])
        ends = [int(e) for e in np.cumsum([0] + [len(s) for s in sentences]) if e < room] + [room]  # the last sentence is cut at room
        filler = [t for s in sentences for t in s][:room]
        at = min(ends, key=lambda e: abs(e - depth * room))  # the sentence boundary nearest the depth
        tokens = filler[:at] + needle + filler[at:] + question + answer
        return tokens, [""] * (len(tokens) - 1 - len(answer)) + [group(depth)] * len(answer)

    def generate(self):
        c = self.config
        rng = np.random.default_rng(c.seed)
        depths = c.depth_list()
        counts = {"train": 0, "valid": 0, "test": 0}

        def draw(split):
            i = counts[split]
            counts[split] += 1
            return self.make(rng, depths[rng.integers(len(depths))] if split == "train" else depths[i % len(depths)])

        return disjoint_splits(draw, {"train": c.n_train, "valid": c.n_valid, "test": c.n_test})

    def vocabularies(self, train):
        """Characters of every sentence, name and digit the task can write: fixed by the task, not by the draw."""
        text = "".join(FILLER) + "".join(NAMES) + NEEDLE + QUESTION + "0123456789 "
        vocab = Vocab(sorted(set(text)))
        return vocab, vocab

    def context_len(self) -> int:
        return self.config.context

    def phase_metrics(self, loss, groups, split):
        return grouped_accuracy(groups, "needle_acc", "depth", "needles")


@hookimpl
def register_tasks(register):
    register("needle", Needle, config=NeedleConfig)
