"""Tasks: the base class of task plugins (seeded, cached splits and their metrics) and helpers for task
authors; vocabularies are in ``gtx.data.vocab``, batches of token graphs in ``gtx.data.batch``.

A task has one of three forms (``Task.form``), and a model serves some of them (``forms``):

- ``seq2seq``: an example is (source tokens, target tokens). The encoder reads ``source + <eos>``
  (as in tensor2tensor and fairseq: without an end marker a decoder cannot tell where a short
  source ends), the decoder reads ``<sos> + target`` and predicts ``target + <eos>`` (tasks with
  ``eos = False`` predict just the target, fixed length). Stages ``ee``, ``dd``, ``ed``.
- ``lm``: an example is (tokens, groups). The model reads ``tokens[:-1]`` and predicts
  ``tokens[1:]`` (decoder nodes, stage ``dd`` only). ``groups`` is empty (every prediction scored)
  or holds one string per prediction: ``""`` leaves it out of the loss and the accuracy, any other
  string scores it and names the group its accuracy is also reported in (``recall``'s distances).
- ``classify``: an example is (tokens, [label]). The encoder reads the tokens (stage ``ee`` only)
  and the model predicts one label per sample.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Sequence

from gtx.data.vocab import Vocab
from gtx.errors import GtxError, plugin_code
from gtx.files import NoSpace, atomic_write, cache_dir
from gtx.plugins import checks

# Vocab: task plugins import it here
__all__ = [
    "SPLITS",
    "Example",
    "Task",
    "Vocab",
    "disjoint_splits",
    "edit_distance",
    "grouped_accuracy",
    "stable_fraction",
]

SPLITS = ("train", "valid", "test")
Example = tuple[Sequence[str], Sequence[str]]  # per form: (source, target), (tokens, groups) or (tokens, [label])


class Task:
    """Base class of task plugins: subclasses implement ``generate`` (the config dataclass is
    registered beside the class: ``register(name, cls, config=Config)``).

    Attributes:
        form: ``seq2seq``, ``lm`` or ``classify`` (the module docstring says what an example is).
        eos: the target ends with <eos> (False: fixed-length targets, e.g. one class token); seq2seq.
        beam: the decoding used for test metrics is beam search of this width (1 = greedy).
        cache: generated data is cached on disk under ``cache_dir()``, keyed by the config.
        train_defaults: training settings this task needs other defaults for (``TrainConfig``
            fields, e.g. a long-context task's ``batch_size``); ``--set`` still overrides them.
        metric: the valid-split metric that judges a run of this task (``gtx compare``'s default,
            ``gtx runs``' column): a results column (``token_acc``, ``seq_acc``) or a key of
            ``phase_metrics``/``metrics`` (``bpc``, ``query_acc``, ``bleu``).
        text: the task can write its examples in text with a model's own tokenizer (``tokenizer``).
        tokenizer: set by the runner before any data is made when the model reads text with its own
            tokenizer (a pretrained model; ``gtx.data.vocab.Tokenizer``): a ``text`` task then writes
            with ``tokenizer.tokenize`` and its vocabulary is ``tokenizer.vocab``. None otherwise.

    Scored by generation (``new_tokens() > 0``, lm form): beside the teacher-forced pass, a model
    that generates continues each valid and test example's prompt (its first ``prompt_len`` tokens)
    greedily by up to ``new_tokens()`` tokens, and ``score_text`` scores the text it wrote
    (``gtx.run.generation``).
    """

    form = "seq2seq"
    metric = "token_acc"
    eos = True
    cache = True
    text = False
    train_defaults: dict = {}

    def __init__(self, name: str, config):
        self.name, self.config = name, config
        self.tokenizer = None
        self._splits: dict[str, list[Example]] | None = None

    def generate(self) -> dict[str, list[Example]]:
        """Build the splits from the config; deterministic given ``config.seed``."""
        raise NotImplementedError

    def check_tokenizer(self) -> None:
        """One line when a model's own tokenizer is set on a task that writes symbols, not text."""
        if self.tokenizer is not None and not self.text:
            raise GtxError(
                f"task {self.name!r} writes its own symbols, not text, so a model with its own tokenizer cannot read it; "
                "give it a task written in text (gtx tasks lists them: text, needle, niah, vt, cwe)"
            )

    def splits(self) -> dict[str, list[Example]]:
        if self._splits is None:
            self.check_tokenizer()
            with plugin_code(f"task {self.name!r}", "while making its data", settings=f"task {self.name!r}"):
                self._splits = self._load_or_generate()
            checks.examples(f"task {self.name!r}", self._splits)
            for split in SPLITS:
                if not self._splits.get(split):
                    raise GtxError(f"task {self.name!r} produced no {split} examples; check its settings")
            self.src_vocab, self.tgt_vocab = (
                (self.tokenizer.vocab,) * 2 if self.tokenizer is not None else self.vocabularies(self._splits["train"])
            )
        return self._splits

    def _load_or_generate(self) -> dict[str, list[Example]]:
        if not self.cache or self.tokenizer is not None:  # the cache key knows the config, not the tokenizer
            return self.generate()
        key = json.dumps(dataclasses.asdict(self.config), sort_keys=True)
        path = cache_dir() / "data" / self.name / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
        if path.exists():
            try:
                data = json.loads(path.read_text())
                splits = {s: [tuple(e) for e in data[s]] for s in SPLITS}
                # a file named by other settings' hash, or edited: what these settings make is made again
                if data.get("config") != json.loads(key):
                    why = "it holds the data of other settings"
                elif data.get("sha256") != _digest(splits):
                    why = "its examples are not those it was written with (or an older gtx wrote it)"
                else:
                    return splits
                warnings.warn(f"cached data {path}: {why}; making it again", stacklevel=2)
            except (
                OSError,
                ValueError,
                KeyError,
                TypeError,
                AttributeError,
            ) as e:  # a cache: made again, never a settings error
                warnings.warn(f"cached data {path} is unreadable ({type(e).__name__}); making it again", stacklevel=2)
        data = self.generate()
        try:
            atomic_write(path, json.dumps({"config": json.loads(key), "sha256": _digest(data), **data}))
        except NoSpace as e:  # a cache: the run goes on without it
            warnings.warn(f"task data not cached: no space left on the device of {e.folder}", stacklevel=2)
        return data

    def vocabularies(self, train: list[Example]) -> tuple[Vocab, Vocab]:
        """Source and target vocabularies (from the training split unless the task fixes them); an
        ``lm`` task reads and predicts one vocabulary."""
        src = Vocab(sorted({t for s, _ in train for t in s}))
        return (src, src) if self.form == "lm" else (src, Vocab(sorted({t for _, y in train for t in y})))

    def declared_len(self) -> int | None:
        """A length the task's settings say its sequences reach (``context_len`` or less), known before
        any data is made (None: the data alone tells). gtx checks it against the model's positions
        before generating the data."""
        return None

    def context_len(self) -> int:
        """The longest sequence a model reads at once (positions it needs), over every split."""
        longest = max(len(x) for split in self.splits().values() for x, _ in split)
        return longest - 1 if self.form == "lm" else longest + (self.form == "seq2seq")  # lm: inputs; seq2seq: + <eos>

    def phase_metrics(self, loss: float, groups: dict[str, tuple[int, int]], split: str) -> dict:
        """Task metrics of one phase of teacher-forced predictions over one split (train, valid or
        test): ``loss`` is the mean cross-entropy (nats) per scored target, ``groups`` maps each
        group name to (correct, scored) targets (lm tasks with groups)."""
        return {}

    def new_tokens(self) -> int:
        """Tokens generated after each example's prompt where the task is scored by generation; 0: it is not."""
        return 0

    def prompt_len(self, split: str, index: int) -> int:
        """The tokens of example ``index`` of ``split`` that are its prompt (lm): by default those up
        to the first scored prediction's input, the answer's tokens following."""
        groups = self.splits()[split][index][1]
        return next((i for i, g in enumerate(groups) if g), len(groups)) + 1

    def score_text(self, split: str, index: int, text: str) -> float:
        """The outcome, in [0, 1], of the text a model generated after example ``index``'s prompt."""
        raise NotImplementedError

    def write(self, text: str) -> list[str]:
        """A text as this task's tokens: the model's tokenizer's, else one token per character."""
        return self.tokenizer.tokenize(text) if self.tokenizer is not None else list(text)

    def read(self, tokens: Sequence[str]) -> str:
        """The text of this task's tokens (``write``'s inverse)."""
        return self.tokenizer.detokenize(tokens) if self.tokenizer is not None else "".join(tokens)

    def max_decode_len(self, src_len: int) -> int:
        """Most target tokens greedy/beam decoding may emit for a source of this length (with <eos>)."""
        return 2 * src_len + 10

    def metrics(self, hypotheses: list[list[str]], references: list[list[str]]) -> dict[str, float]:
        """Task-specific metrics of decoded outputs, beyond sequence accuracy."""
        return {}

    def seq_acc(self, hypotheses, references) -> float:
        return sum(h == r for h, r in zip(hypotheses, references)) / max(len(references), 1)


def _digest(splits: dict[str, list[Example]]) -> str:
    """A checksum of a task's examples, as the cache writes them (tuples as lists)."""
    return hashlib.sha256(json.dumps([splits[s] for s in SPLITS]).encode()).hexdigest()


def grouped_accuracy(groups: dict[str, tuple[int, int]], metric: str, by: str, counted: str) -> dict:
    """``phase_metrics`` of an lm task that scores a few predictions per example, in named groups:
    ``metric`` (accuracy over every scored prediction; NaN if none), ``<metric>_by_<by>`` {group:
    accuracy} and ``<counted>_by_<by>`` {group: predictions scored}."""
    correct = sum(c for c, _ in groups.values())
    scored = sum(n for _, n in groups.values())
    return {
        metric: correct / scored if scored else float("nan"),
        f"{metric}_by_{by}": {g: c / n for g, (c, n) in sorted(groups.items()) if n},
        f"{counted}_by_{by}": {g: n for g, (_, n) in sorted(groups.items())},
    }


def disjoint_splits(draw, sizes: dict[str, int], max_tries: int = 100) -> dict[str, list[Example]]:
    """Draw ``sizes[split]`` examples per split with ``draw(split)``, redrawing any whose source
    an earlier example already has, so that no source appears twice (or in two splits)."""
    seen: set[tuple[str, ...]] = set()
    out = {}
    for split, n in sizes.items():
        examples = []
        for _ in range(n * max_tries):
            if len(examples) == n:
                break
            src, tgt = draw(split)
            if tuple(src) not in seen:
                seen.add(tuple(src))
                examples.append((src, tgt))
        if len(examples) < n:
            raise GtxError(
                f"only {len(examples)} distinct {split} examples of {n} could be drawn; ask for fewer or longer ones"
            )
        out[split] = examples
    return out


def stable_fraction(key: str, seed: int) -> float:
    """A number in [0, 1) from a seeded hash of ``key``: a split that never changes with data order."""
    digest = hashlib.sha1(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]
