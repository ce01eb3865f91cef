"""listops: Long Range Arena ListOps, regenerated from the published procedure (Tay et al. 2021).

Written from a prose description of LRA's generator (google-research/long-range-arena,
``lra_benchmarks/data/listops.py``), not from its code: trees of MIN, MAX,
MED (median, truncated) and SM (sum mod 10) over digits, rejection-sampled on token length and
deduplicated. Classification with 10 classes, in either form: ``form=seq2seq`` (default) decodes
one output token (the label, no <eos>) with an encoder-decoder (``transformer``, ``ut``);
``form=classify`` pools an encoder (``--model encoder``), as LRA does. Either way sequence accuracy
is classification accuracy. ``preset=lra`` takes the paper's sizes: 500-2000 tokens, 96,000 /
2,000 / 2,000 examples (any of them can still be set).
"""

import random
from dataclasses import dataclass, field

from gtx import Task, Vocab, hookimpl, setting

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"


@dataclass
class ListOpsConfig:
    n_train: int = setting(10000, "LRA: 96000", "[1, inf)")
    n_valid: int = setting(1000, "LRA: 2000", "[1, inf)")
    n_test: int = setting(1000, "LRA: 2000", "[1, inf)")
    min_len: int = setting(20, "token length > min_len (LRA: 500)", "[0, inf)")
    max_len: int = setting(100, "token length < max_len (LRA: 2000)", "[1, inf)")
    max_depth: int = setting(10, range="[1, inf)")
    max_args: int = setting(10, range="[1, inf)")
    seed: int = 0
    form: str = field(default="seq2seq", metadata={"help": "seq2seq (transformer, ut) or classify (encoder)"})
    preset: str = field(
        default="", metadata={"help": "lra: the paper's lengths and sizes, for settings left at their defaults"}
    )

    def __post_init__(self):
        if self.form not in ("seq2seq", "classify"):
            raise ValueError(f"form={self.form!r}: choose seq2seq or classify")
        if self.preset not in ("", "lra"):
            raise ValueError(f"preset={self.preset!r}: the only preset is lra")
        if self.preset == "lra":
            defaults = ListOpsConfig()
            for name, value in LRA.items():
                if getattr(self, name) == getattr(defaults, name):
                    setattr(self, name, value)


# Trees are drawn until enough fall within min_len..max_len: a window that few trees reach (1 in 10^4
# for 5000..6000 tokens at depth 10) would take hours, so the rate is checked every CHECK_EVERY draws
# and a projection past DRAWS_MAX (about half an hour here) is refused. The LRA preset needs ~1.2M.
CHECK_EVERY, DRAWS_MAX = 100_000, 20_000_000

#: the LRA generator's defaults (paper_tables.md 1.5)
LRA = {"n_train": 96000, "n_valid": 2000, "n_test": 2000, "min_len": 500, "max_len": 2000}


def sample_tree(rng: random.Random, depth: int, max_depth: int, max_args: int):
    """A tree and its token count, drawing random numbers in the reference generator's order."""
    r = rng.random() if depth < max_depth else 1.0
    if r > 0.25:
        return rng.choice(range(10)), 1
    k = rng.randint(2, max_args)
    children, length = [], 2
    for _ in range(k):
        child, n = sample_tree(rng, depth + 1, max_depth, max_args)
        children.append(child)
        length += n
    return (rng.choice(OPERATORS), tuple(children)), length


def evaluate(tree) -> int:
    if isinstance(tree, int):
        return tree
    op, children = tree
    values = sorted(evaluate(c) for c in children)
    if op == "[MIN":
        return values[0]
    if op == "[MAX":
        return values[-1]
    if op == "[MED":
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) // 2
    return sum(values) % 10


def tokens(tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    op, children = tree
    return [op] + [t for c in children for t in tokens(c)] + [CLOSE]


class ListOps(Task):
    """ListOps (LRA): evaluate nested MIN/MAX/MED/SM lists of digits; 10 classes (--set form=classify: encoder)."""

    metric = "seq_acc"

    eos = False

    def __init__(self, name, config):
        super().__init__(name, config)
        self.form = config.form

    def generate(self):
        c = self.config
        if c.min_len + 1 >= c.max_len:
            raise ValueError(f"need min_len + 1 < max_len, got {c.min_len}, {c.max_len}")
        rng = random.Random(c.seed)
        total = c.n_train + c.n_valid + c.n_test
        trees = {}  # insertion-ordered set: deduplicates identical trees, reproducible order
        draws = 0
        while len(trees) < total:
            tree, n = sample_tree(rng, 1, c.max_depth, c.max_args)
            if c.min_len < n < c.max_len:
                trees.setdefault(tree, None)
            draws += 1
            if draws % CHECK_EVERY == 0 and draws * total > DRAWS_MAX * max(len(trees), 1):
                raise ValueError(
                    f"{len(trees):,} of {draws:,} trees drawn (max_depth={c.max_depth}, max_args={c.max_args}) have "
                    f"{c.min_len} < length < {c.max_len}: {total:,} would take more than {DRAWS_MAX:,} draws; "
                    "widen min_len..max_len, or change max_depth or max_args"
                )
        examples = [(tokens(t), [str(evaluate(t))]) for t in trees]
        rng.shuffle(examples)
        return {
            "train": examples[: c.n_train],
            "valid": examples[c.n_train : c.n_train + c.n_valid],
            "test": examples[c.n_train + c.n_valid :],
        }

    def vocabularies(self, train):
        return Vocab([*OPERATORS, CLOSE, *map(str, range(10))]), Vocab([str(d) for d in range(10)])

    def max_decode_len(self, src_len):
        return 1

    def declared_len(self) -> int:
        return self.config.min_len + 1 + (self.form == "seq2seq")  # every tree is longer than min_len


@hookimpl
def register_tasks(register):
    register("listops", ListOps, config=ListOpsConfig)
