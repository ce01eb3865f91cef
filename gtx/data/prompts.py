"""Prompt tasks: text tasks whose examples are prompts a model continues by generation, scored on the
text it writes (``Task.new_tokens``), as RULER's long-context tasks are (Hsieh et al. 2024).

A ``PromptTask`` subclass draws each example's random parts (``draw``) and renders them around
``size`` units of filler (``render``: a ``Prompt``); the base class chooses the largest size whose
prompt, written with the model's tokenizer, leaves room for the tokens to generate within
``context`` (``fit_count``), writes it in completion or chat form, and keeps its reference answers.
The teacher-forced pass scores the reference answer's tokens after the prompt.

Helpers for such tasks: ``answer_recall`` (RULER's string match), ``synthetic_words`` (pronounceable
made-up words, for lists without a corpus) and ``fit_count``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gtx.data.task import SPLITS, Task
from gtx.data.vocab import Vocab
from gtx.errors import GtxError
from gtx.values import setting

PROMPTS = ("completion", "chat")
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
CONTROL = re.compile(r"[\x00-\x1f]")


@dataclass
class PromptConfig:
    """The settings every prompt task has (a subclass adds its own, and may give ``new`` another default)."""

    context: int = setting(
        1024,
        "tokens of each example: the prompt and the tokens to generate, as many as fit (filler fills it)",
        "[1, inf)",
    )
    new: int = setting(32, "tokens generated after each prompt (generation stops earlier at end of text)", "[1, inf)")
    prompt: str = setting(
        "completion",
        "completion: the task's text then the answer's first words; chat: the task's text as the user's turn in "
        "the model's chat template, the answer's first words opening the assistant's",
    )
    n_train: int = setting(20, range="[1, inf)")
    n_valid: int = setting(20, range="[1, inf)")
    n_test: int = setting(100, range="[1, inf)")
    seed: int = 0

    def __post_init__(self):
        if self.prompt not in PROMPTS:
            raise ValueError(f"prompt={self.prompt!r}: choose {' or '.join(PROMPTS)}")


@dataclass
class Prompt:
    """One example before it is written: ``turns``, the conversation's texts by role (``user`` first,
    ``assistant`` replies between: few-shot examples), ``prefix`` (the answer's first words, which
    the model continues), ``answers`` (what the generated text must hold) and ``answer`` (the
    reference continuation the teacher-forced pass scores)."""

    turns: list[tuple[str, str]]
    prefix: str
    answers: list[str]
    answer: str


class PromptTask(Task):
    """A task scored by generation (lm form, written in text): subclasses set ``draw`` and ``render``;
    the config is a ``PromptConfig``. ``answer_acc`` is the fraction of reference answers found in
    the generated text (``answer_recall``), averaged over the samples."""

    form = "lm"
    text = True
    cache = False  # a model's tokenizer changes it
    metric = "answer_acc"
    train_defaults = {"batch_size": 1, "eval_batch_size": 1}  # long examples: the logits of one are large

    def draw(self, rng: np.random.Generator):
        """An example's random parts, whatever its size (rendered by ``render``)."""
        raise NotImplementedError

    def render(self, drawn, size: int) -> Prompt:
        """The example of ``drawn`` with ``size`` units of filler; longer as ``size`` grows."""
        raise NotImplementedError

    def new_tokens(self) -> int:
        return self.config.new

    def check_tokenizer(self) -> None:
        super().check_tokenizer()
        if self.config.prompt == "chat" and (self.tokenizer is None or self.tokenizer.chat([("user", "")]) is None):
            has = "a tokenizer without a chat template" if self.tokenizer is not None else "no tokenizer of its own"
            raise GtxError(
                f"task {self.name!r} prompt=chat: the model has {has}; use prompt=completion, or a model whose "
                "tokenizer has a chat template"
            )

    def prompt_text(self, p: Prompt, form: str | None = None) -> str:
        """The prompt in ``form`` (None: the configured one). Completion: each user text, its reply
        after it and a newline after that, then the last user text and the prefix; chat: the turns in
        the model's chat template, then the prefix."""
        if (form or self.config.prompt) == "chat":
            return self.tokenizer.chat([(role, text.strip()) for role, text in p.turns]) + p.prefix
        return "".join(text + ("\n" if role == "assistant" else "") for role, text in p.turns) + p.prefix

    def fit(
        self, drawn, budget: int, answer_room: Callable[[Prompt], int], form: str | None = None, fix: str = ""
    ) -> Prompt:
        """``drawn`` rendered at the largest size whose prompt's tokens (in ``form``: ``prompt_text``)
        and ``answer_room(prompt)`` fit in ``budget``; ``fix``: what else the refusal of a budget too
        small offers."""

        def length(n: int) -> int:
            p = self.render(drawn, n)
            return len(self.write(self.prompt_text(p, form))) + answer_room(p)

        size = fit_count(length, budget)
        if size < 0:
            raise GtxError(
                f"task {self.name!r} context={self.config.context}: a prompt without filler and its answer's room take "
                f"{length(0)} tokens of the {budget} it may; raise context{fix}"
            )
        return self.render(drawn, size)

    def generate(self):
        """Each example drawn by its own generator (seeded by the task's seed, split and index), again
        where its prompt is one an earlier example has (no prompt appears twice, in any split)."""
        c = self.config
        self.answers: dict[str, list[list[str]]] = {}
        sizes = {"train": c.n_train, "valid": c.n_valid, "test": c.n_test}
        out, seen = {}, set()
        for k, split in enumerate(SPLITS):
            examples, self.answers[split] = [], []
            for i in range(sizes[split]):
                rng = np.random.default_rng([c.seed, k, i])
                for _ in range(100):
                    p = self.fit(self.draw(rng), c.context, lambda p: max(c.new, len(self.write(p.answer))))
                    prompt = self.write(self.prompt_text(p))
                    if tuple(prompt) not in seen:
                        break
                else:
                    raise GtxError(
                        f"task {self.name!r}: only {len(seen)} distinct prompts could be drawn; ask for fewer examples, "
                        "or give keys and values more room (digits, word or uuid)"
                    )
                seen.add(tuple(prompt))
                answer = self.write(p.answer)
                examples.append((prompt + answer, [""] * (len(prompt) - 1) + ["answer"] * len(answer)))
                self.answers[split].append(p.answers)
            out[split] = examples
        return out

    def score_text(self, split: str, index: int, text: str) -> float:
        self.splits()
        return answer_recall(text, self.answers[split][index])

    def vocabularies(self, train):
        """Printable ASCII and the newline: every character a prompt task writes."""
        vocab = Vocab([*(c for c in string.printable if c >= " " and c != "\x7f"), "\n"])
        return vocab, vocab

    def declared_len(self) -> int:
        return self.config.context

    def context_len(self) -> int:
        return self.config.context


def answer_recall(text: str, answers: Sequence[str]) -> float:
    """The fraction of ``answers`` found in ``text``, ignoring case: RULER's ``string_match_all`` of one
    sample (its text stripped, control characters made newlines). One answer: 1 or 0."""
    if not answers:
        raise ValueError("answer_recall needs at least one reference answer")
    text = CONTROL.sub("\n", text.strip()).strip().lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def synthetic_words(rng: np.random.Generator, n: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct made-up words of two or three consonant-vowel syllables (``"tabeko"``), none in ``exclude``."""
    out, seen = [], set(exclude)
    while len(out) < n:
        m = 2 * (n - len(out)) + 8
        syllables = rng.integers(2, 4, m)
        cons, vows = rng.integers(0, len(CONSONANTS), (m, 3)), rng.integers(0, len(VOWELS), (m, 3))
        for k, c, v in zip(syllables, cons, vows):
            word = "".join(CONSONANTS[c[j]] + VOWELS[v[j]] for j in range(k))
            if word not in seen and len(out) < n:
                seen.add(word)
                out.append(word)
    return out


def fit_count(length: Callable[[int], int], budget: int) -> int:
    """The largest ``n >= 0`` with ``length(n) <= budget``, for a length that grows with ``n`` (a prompt
    around ``n`` units of filler, in tokens); -1 where ``length(0)`` is over. It probes where the
    growth seen so far says the answer lies, then narrows the bracket: a few calls, not one per n."""
    base = length(0)
    if base > budget:
        return -1
    per = max(length(1) - base, 1)  # one unit's tokens, about
    lo, hi, guess = 0, None, (budget - base) // per  # length(lo) <= budget < length(hi)
    for _ in range(200):
        if hi is not None and hi - lo <= 1:
            return lo
        inside = lo < guess and (hi is None or guess < hi)
        n = guess if inside else (lo + hi) // 2 if hi is not None else 2 * lo + 1
        t = length(n)
        lo, hi = (n, hi) if t <= budget else (lo, n)
        guess = n + (budget - t) // per
        if t <= budget:
            guess = max(guess, n + 1)
    raise GtxError(f"no count of filler fits {budget} tokens: the prompt's length does not grow with it")
