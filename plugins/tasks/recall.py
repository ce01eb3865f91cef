"""recall: multi-query associative recall (MQAR), an ``lm`` task: look a key's value up far back.

The task of Zoology (Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient
Language Models", ``multiquery_ar``), regenerated here. An example of ``L`` tokens::

    k5 v2 k0 v7 k3 v2 ... | v4 k0 v7 v1 v9 k5 v2 v0 ...
    \\_ n_pairs pairs _/    \\_ the query section: queries among filler _/

- The pairs: ``n_pairs`` distinct keys (of ``n_keys``) each followed by its value (of ``n_values``,
  drawn with replacement). Keys and values are disjoint vocabularies (``k*``, ``v*``).
- The query section: each key reappears ``queries_per_key`` times, each time followed by its value
  again; the prediction made at the key (the token after it) is scored, every other prediction is
  not (group ``""``). The rest is filler: random values, never keys, so a key always is a query.
  Query slots (two tokens each, aligned after the pairs) are placed ``power`` (Zoology's power
  law: slot s weighted 1/(s+1), most queries soon after the pairs, some far) or ``uniform``.
- Training sequences may be shorter (``train_min_len``: lengths log-uniform on
  [train_min_len, seq_len], a mix of short and long rather than an ordered curriculum, since the
  trainer shuffles); valid and test sequences are exactly ``seq_len`` tokens.

Every scored prediction is in a distance group: the distance d from the query back to the key's
latest earlier occurrence (its pair, or an earlier query of it, whose value follows it too: with
``queries_per_key=1`` that is the pair), in buckets ``d0000-0031`` then powers of two
(``d0032-0063``, ``d0064-0127``, ...), zero-padded so that names sort by distance. A causal
``local:w=32`` query sees itself and the 32 positions before it, so one layer reads the value
(at d - 1 back) for d <= 33: ``d0000-0031`` lies within its window; n layers relay at most
32n + 1 back, so a 2-layer ``local:w=32`` model is at chance (1 / n_values) from ``d0064-0127``
on (but for d = 64, 65).

Metrics per phase: ``query_acc`` (accuracy over the scored predictions, equal to ``token_acc``),
``query_acc_by_distance`` {bucket: accuracy} and ``queries_by_distance`` {bucket: count}.

The defaults are chosen to be learnt at seq_len 1024 on a CPU. A 2-layer model must first form an
induction circuit (a previous-token head, then a head matching the query's key to it); before
that it sits on a plateau, guessing among the values of the sequence (about 1 / n_pairs). The
plateau is short with few pairs, small vocabularies, dense queries and short sequences: 4 pairs
of 16 keys and 16 values, each key queried 4 times (16 scored predictions per sequence), and
training lengths log-uniform on 64..1024 (the short ones form the circuit, the long ones carry it
to every position and sharpen it over 1024 tokens). Queries are placed uniformly so that
distances fill every bucket up to ``d0512-1023``. Measured (seed 0, 2 CPU cores shared with
another training job, ``OMP_NUM_THREADS=1``) with::

    gtx run --task recall --model lm --pattern full --dim 64 --heads 4 --dim-ff 256 \
        --set dropout=0 --batch-size 32

4 epochs of 125 steps: valid query accuracy at 1024 of 32%, 35%, 99.97%, 100% after each, the
99.97% after 134 s of training; test 100% in every bucket. ``--pattern local:w=32``, the same
command: test 8.7%, 16% and 14% in ``d0000-0031`` and ``d0032-0063``, 5.5-10.7% beyond (chance
6.25%). 8 pairs of 32 keys and 32 values, the same command for 8 epochs: 19% (plateau).
"""

import math
from dataclasses import dataclass, field

import numpy as np

from gtx import Task, Vocab, disjoint_splits, grouped_accuracy, hookimpl, setting

FIRST_BUCKET = 32  # distances 0..31 share the first bucket: within a local:w=32 window
PLACEMENTS = ("power", "uniform")


def bucket(d: int, width: int = 4) -> str:
    """The distance group of ``d`` >= 0: ``d0000-0031``, then [2^j, 2^(j+1) - 1] for 2^j >= 32;
    ``width`` digits (names of one task share it, so they sort by distance)."""
    lo = 0 if d < FIRST_BUCKET else 1 << (d.bit_length() - 1)
    hi = FIRST_BUCKET - 1 if d < FIRST_BUCKET else 2 * lo - 1
    return f"d{lo:0{width}d}-{hi:0{width}d}"


@dataclass
class RecallConfig:
    seq_len: int = setting(1024, "tokens per valid/test sequence and the longest training one", "[1, inf)")
    n_pairs: int = field(default=4, metadata={"help": "key-value pairs at the start of each sequence"})
    n_keys: int = setting(16, "key vocabulary (the keys of a sequence are distinct)", "[1, inf)")
    n_values: int = field(default=16, metadata={"help": "value vocabulary (chance accuracy is 1 / n_values)"})
    queries_per_key: int = field(default=4, metadata={"help": "times each key is queried in a sequence (Zoology: 1)"})
    placement: str = field(
        default="uniform", metadata={"help": "query slots: power (Zoology's power law, 1/(slot+1)) or uniform"}
    )
    train_min_len: int = field(
        default=64,
        metadata={
            "help": "training lengths log-uniform on [train_min_len, seq_len], clipped to what fits (0: all seq_len)"
        },
    )
    n_train: int = setting(4000, range="[1, inf)")
    n_valid: int = setting(200, range="[1, inf)")
    n_test: int = setting(200, range="[1, inf)")
    seed: int = 0

    def min_len(self) -> int:
        """The shortest sequence that holds the pairs and every query: 2 tokens each."""
        return 2 * self.n_pairs * (1 + self.queries_per_key)

    def __post_init__(self) -> None:
        """Raise ValueError naming the bad setting and the fix."""
        if self.n_pairs < 1 or self.queries_per_key < 1:
            raise ValueError(f"n_pairs={self.n_pairs} and queries_per_key={self.queries_per_key} must be >= 1")
        if self.n_pairs > self.n_keys:
            raise ValueError(
                f"n_pairs={self.n_pairs} needs n_keys >= {self.n_pairs} (the keys of a sequence are distinct); raise n_keys or lower n_pairs"
            )
        if self.n_values < 2:
            raise ValueError(
                f"n_values={self.n_values}: need at least 2 values for recall to mean anything; raise n_values"
            )
        if self.seq_len < self.min_len():
            raise ValueError(
                f"seq_len={self.seq_len} is too small for n_pairs={self.n_pairs} with queries_per_key={self.queries_per_key}: "
                f"need seq_len >= {self.min_len()} (2 tokens per pair and per query); raise seq_len or lower n_pairs"
            )
        if self.train_min_len < 0:
            raise ValueError(
                f"train_min_len={self.train_min_len} must be >= 0 (0: every training sequence is seq_len long)"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r}: choose {' or '.join(PLACEMENTS)}")


def keys_values(config: RecallConfig) -> tuple[list[str], list[str]]:
    return [f"k{i}" for i in range(config.n_keys)], [f"v{i}" for i in range(config.n_values)]


def make_example(config: RecallConfig, rng: np.random.Generator, length: int) -> tuple[list[str], list[str]]:
    """One sequence of ``length`` tokens and its groups (one per prediction: length - 1)."""
    keys, values = keys_values(config)
    p, width = config.n_pairs, max(4, len(str(config.seq_len)))
    key_ids = rng.choice(config.n_keys, p, replace=False)
    value_ids = rng.integers(0, config.n_values, p)
    tokens = [values[i] for i in rng.integers(0, config.n_values, length)]  # filler: values, never keys
    groups = [""] * (length - 1)
    for i in range(p):
        tokens[2 * i], tokens[2 * i + 1] = keys[key_ids[i]], values[value_ids[i]]
    slots = (length - 2 * p) // 2
    weights = 1.0 / np.arange(1, slots + 1) if config.placement == "power" else np.ones(slots)
    chosen = np.sort(rng.choice(slots, p * config.queries_per_key, replace=False, p=weights / weights.sum()))
    which = rng.permutation(np.repeat(np.arange(p), config.queries_per_key))
    last = [2 * i for i in range(p)]  # latest occurrence of each pair's key
    for slot, i in zip(chosen.tolist(), which.tolist()):
        q = 2 * p + 2 * slot
        tokens[q], tokens[q + 1] = keys[key_ids[i]], values[value_ids[i]]
        groups[q] = bucket(q - last[i], width)
        last[i] = q
    return tokens, groups


class Recall(Task):
    """Multi-query associative recall (Zoology's MQAR): predict a queried key's value, grouped by distance.

    Scored only at the queries; the module docstring gives the layout and the metrics."""

    form = "lm"
    metric = "query_acc"
    # 128 sequences of up to 1024 tokens (the trainer's default) is a very long CPU step;
    # docs/long-context.md's runs used 32
    train_defaults = {"batch_size": 32, "eval_batch_size": 32}

    def declared_len(self) -> int:
        return self.config.seq_len - 1  # valid and test sequences are seq_len tokens; a model reads all but the last

    def generate(self):
        c = self.config
        rng = np.random.default_rng(c.seed)
        shortest = min(max(c.train_min_len, c.min_len()), c.seq_len) if c.train_min_len else c.seq_len
        lo, hi = math.log(shortest), math.log(c.seq_len)

        def draw(split):
            length = c.seq_len if split != "train" else min(c.seq_len, int(math.exp(rng.uniform(lo, hi)) + 0.5))
            return make_example(c, rng, length)

        return disjoint_splits(draw, {"train": c.n_train, "valid": c.n_valid, "test": c.n_test})

    def vocabularies(self, train):
        keys, values = keys_values(self.config)
        vocab = Vocab(keys + values)  # fixed: every key and value, seen in training or not
        return vocab, vocab

    def phase_metrics(self, loss, groups, split):
        return grouped_accuracy(groups, "query_acc", "distance", "queries")


@hookimpl
def register_tasks(register):
    register("recall", Recall, config=RecallConfig)
