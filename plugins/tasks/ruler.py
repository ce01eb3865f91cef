"""RULER's synthetic long-context tasks (Hsieh et al. 2024), without a corpus: needle in a haystack
(``niah``), variable tracking (``vt``) and common-words extraction (``cwe``), lm tasks scored by
greedy generation.

Each example fills ``context`` tokens of the model's own tokenizer with as much filler as fits
beside the prompt's other text and the ``new`` tokens to generate (RULER's ``max_seq_length``). The
prompts are RULER's: the task's text, then the answer's first words (``prompt=completion``), or the
task's text as the user's turn in the model's chat template with the answer's first words opening
the assistant's (``prompt=chat``). The generated text is scored as RULER scores it: the fraction of
the reference answers it contains, ignoring case (``answer_acc``; one answer: 0 or 1); each
sample's outcome is kept in the row's ``outcomes``. Without a tokenizer of the model's (a random
``hf`` family model) every character is a token.

- ``niah``: needles "One of the special magic numbers for {key} is: {value}." among RULER's noise
  filler (its five sentences repeated, one per line) or among other needles (``haystack=needles``);
  ``kind``: single (one needle), multikey (four needles of different keys, one asked), multivalue
  (four values for the key asked), multiquery (four keys asked at once); keys and values are
  numbers (``digits`` digits), made-up words (two joined by a hyphen) or UUIDs.
- ``vt``: ``chains`` chains of ``hops`` assignments ("VAR QPWKD = 48213", then "VAR TRMSA = VAR
  QPWKD ") spread through the noise filler, one line each; asked which variables are assigned the
  first chain's value (all ``hops + 1`` of its chain). With ``fewshot``, a short solved example
  first, as RULER gives one (at most 500 tokens, and at most half of ``context``).
- ``cwe``: a numbered list of made-up words, ``common`` of them repeated ``common_repeats`` times
  and the rest ``uncommon_repeats`` times, shuffled; asked for the ``common`` most common. RULER's
  repeats by length: 30 and 3 from 4096 tokens of context, 6 and 1 below; with ``fewshot``, a
  solved example of 40 words (20 below 4096 tokens) first.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np

from gtx import Prompt, PromptConfig, PromptTask, hookimpl, setting, synthetic_words

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_TEXT = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
VT_TEXT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEXT = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the {count} most common words in the above list?"
)
CWE_PREFIX = " Answer: The top {count} words that appear most often in the list are:"
ITEMS = {"number": "numbers", "word": "words", "uuid": "uuids"}
#: (keys, values per key, keys asked)
KINDS = {"single": (1, 1, 1), "multikey": (4, 1, 1), "multivalue": (1, 4, 1), "multiquery": (4, 1, 4)}
LONG = 4096  # context from which RULER's cwe uses its long-list repeats
LETTERS = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))


def singular(text: str) -> str:
    """RULER's niah wording for one answer: "A special magic number is ...", "What is the ..."."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is")


def item(rng: np.random.Generator, kind: str, digits: int) -> str:
    if kind == "number":
        return str(int(rng.integers(10 ** (digits - 1), 10**digits)))
    if kind == "word":
        return "-".join(synthetic_words(rng, 2))
    return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))


def spread(lines: list[str], inserted: list[str], fractions) -> list[str]:
    """``lines`` with ``inserted`` placed in their order at the given fractions of them (sorted)."""
    out = list(lines)
    for j, (line, f) in enumerate(zip(inserted, sorted(fractions))):
        out.insert(min(int(f * (len(lines) + 1)), len(lines)) + j, line)
    return out


def new_tokens(default: int):
    """The ``new`` setting with a task's default (RULER's tokens to generate)."""
    return setting(default, "tokens generated after each prompt (generation stops earlier at end of text)", "[1, inf)")


@dataclass
class NiahConfig(PromptConfig):
    new: int = new_tokens(128)
    kind: str = setting("single", f"needles and questions: {', '.join(KINDS)}")
    key: str = setting("word", "what a needle's key is: word, number or uuid")
    value: str = setting("number", "what a needle's value is: number, word or uuid")
    haystack: str = setting("noise", "noise (RULER's filler sentences) or needles (needles of other keys)")
    digits: int = setting(7, "digits of a number key or value", "[1, 18]")

    def __post_init__(self):
        super().__post_init__()
        for name, value, allowed in (
            ("kind", self.kind, KINDS),
            ("key", self.key, ITEMS),
            ("value", self.value, ITEMS),
            ("haystack", self.haystack, ("noise", "needles")),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose {', '.join(allowed)}")


class Niah(PromptTask):
    """Needles in a haystack (RULER's niah): the value(s) of the key(s) asked, found in the generated text."""

    def draw(self, rng):
        c = self.config
        n_keys, n_values, n_asked = KINDS[c.kind]
        keys = []
        while len(keys) < n_keys:
            key = item(rng, c.key, c.digits)
            keys += [key] if key not in keys else []
        values = [[item(rng, c.value, c.digits) for _ in range(n_values)] for _ in keys]
        needles = [NEEDLE.format(kind=ITEMS[c.value], key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        order = rng.permutation(len(needles))
        asked = rng.choice(n_keys, n_asked, replace=False).tolist()
        return {
            "keys": keys,
            "values": values,
            "needles": [needles[i] for i in order],
            "at": rng.random(len(needles)),
            "asked": asked,
            "haystack": int(rng.integers(2**62)),
        }

    def render(self, d, size):
        c = self.config
        if c.haystack == "noise":
            lines = [NOISE] * size
        else:  # needles of other keys, drawn in one order whatever the size
            other = np.random.default_rng(d["haystack"])
            lines = [
                NEEDLE.format(
                    kind=ITEMS[c.value], key=item(other, c.key, c.digits), value=item(other, c.value, c.digits)
                )
                for _ in range(size)
            ]
        asked = [d["keys"][i] for i in d["asked"]]
        answers = [v for i in d["asked"] for v in d["values"][i]]
        query = ", ".join(asked[:-1]) + ", and " + asked[-1] if len(asked) > 1 else asked[0]
        text, prefix, kind = NIAH_TEXT, NIAH_PREFIX, ITEMS[c.value]
        if len(answers) == 1:
            text, prefix, kind = singular(text), singular(prefix), c.value
        context = "\n".join(spread(lines, d["needles"], d["at"]))
        return Prompt(
            [("user", text.format(kind=kind, context=context, query=query))],
            prefix.format(kind=kind, query=query),
            answers,
            " " + ", ".join(answers),
        )


@dataclass
class VtConfig(PromptConfig):
    new: int = new_tokens(30)
    chains: int = setting(1, "chains of assignments; the first one's variables are asked for", "[1, 26]")
    hops: int = setting(4, "assignments after each chain's first: its variables are hops + 1", "[1, 100]")
    fewshot: bool = setting(True, "a solved example first, as RULER gives one")


class Vt(PromptTask):
    """Variable tracking (RULER's vt): every variable a value reaches through a chain of assignments."""

    def chain_draw(self, rng, letters: int):
        c = self.config
        names = []
        while len(names) < c.chains * (c.hops + 1):
            name = "".join(rng.choice(LETTERS, letters))
            names += [name] if name not in names else []
        chains = [names[i : i + c.hops + 1] for i in range(0, len(names), c.hops + 1)]
        values = [str(int(rng.integers(10000, 99999))) for _ in chains]
        return {"chains": chains, "values": values, "at": rng.random((len(chains), c.hops + 1))}

    def draw(self, rng):
        d = self.chain_draw(rng, 5)
        if self.config.fewshot:
            example = self.chain_draw(rng, 3)
            budget = min(500, self.config.context // 2)
            p = self.fit(
                example, budget, lambda p: 0, "completion", " (half of it at most holds the example), or fewshot=false"
            )
            d["example"] = p.turns[0][1] + p.prefix + " " + " ".join(p.answers) + "\n\n"
        return d

    def render(self, d, size):
        c = self.config
        lines = [NOISE] * size
        for chain, value, at in zip(d["chains"], d["values"], d["at"]):
            statements = [f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(chain, chain[1:])]
            lines = spread(lines, statements, at)
        query, count = d["values"][0], c.hops + 1
        text = d.get("example", "") + VT_TEXT.format(context="\n".join(lines), query=query)
        answers = d["chains"][0]
        return Prompt([("user", text)], VT_PREFIX.format(count=count, query=query), answers, " ".join(answers))


@dataclass
class CweConfig(PromptConfig):
    new: int = new_tokens(120)
    common: int = setting(10, "words repeated most often: what is asked for", "[1, inf)")
    common_repeats: int = setting(
        0, "times each common word is listed (0: RULER's, 30 from 4096 tokens, else 6)", "[0, inf)"
    )
    uncommon_repeats: int = setting(
        0, "times each other word is listed (0: RULER's, 3 from 4096 tokens, else 1)", "[0, inf)"
    )
    fewshot: bool = setting(True, "a solved example first, as RULER gives one")

    def repeats(self) -> tuple[int, int]:
        long = self.context >= LONG
        return self.common_repeats or (30 if long else 6), self.uncommon_repeats or (3 if long else 1)

    def __post_init__(self):
        super().__post_init__()
        common, uncommon = self.repeats()
        if common <= uncommon:
            raise ValueError(
                f"common_repeats={common} and uncommon_repeats={uncommon}: the common words must be listed more often"
            )


class Cwe(PromptTask):
    """Common-words extraction (RULER's cwe): the most repeated words of a long numbered list."""

    def words(self, seed: int, total: int, repeats: tuple[int, int]) -> tuple[str, list[str]]:
        """A numbered list of ``total`` distinct words, the first ``common`` of them repeated more, and those words."""
        rng = np.random.default_rng(seed)
        words = synthetic_words(rng, total)
        common = words[: self.config.common]
        listed = common * repeats[0] + words[self.config.common :] * repeats[1]
        listed = [listed[i] for i in rng.permutation(len(listed))]
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    def draw(self, rng):
        return {"list": int(rng.integers(2**62)), "example": int(rng.integers(2**62))}

    def render(self, d, size):
        c = self.config
        count = c.common
        turns = []
        if c.fewshot:
            long = c.context >= LONG
            listed, common = self.words(d["example"], 40 if long else 20, (10, 3) if long else (3, 1))
            numbered = " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
            turns += [
                ("user", CWE_TEXT.format(context=listed, count=count)),
                ("assistant", CWE_PREFIX.format(count=count) + " " + numbered),
            ]
        listed, common = self.words(d["list"], count + size, c.repeats())
        turns.append(("user", CWE_TEXT.format(context=listed, count=count)))
        numbered = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
        return Prompt(turns, CWE_PREFIX.format(count=count), common, numbered)


@hookimpl
def register_tasks(register):
    register("niah", Niah, config=NiahConfig)
    register("vt", Vt, config=VtConfig)
    register("cwe", Cwe, config=CweConfig)
