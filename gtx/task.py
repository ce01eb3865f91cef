"""Tasks: vocabularies, seeded and cached splits, batching into token graphs, metrics.

Every task is sequence to sequence: a source token sequence and a target token sequence.
Classification (``listops``) is a target of one token. The encoder reads ``source + <eos>`` (as in
tensor2tensor and fairseq: without an end marker a decoder cannot tell where a short source ends),
the decoder reads ``<sos> + target`` and predicts ``target + <eos>`` (tasks with ``eos = False``
predict just the target, fixed length).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gtx.errors import GtxError
from gtx.graph import TokenGraph, build_graph, positions
from gtx.pattern import Pattern

PAD, SOS, EOS, UNK = "<pad>", "<sos>", "<eos>", "<unk>"
SPLITS = ("train", "valid", "test")
Example = tuple[list[str], list[str]]  # (source tokens, target tokens)


class Vocab:
    """Token <-> id; ids 0..3 are <pad>, <sos>, <eos>, <unk>."""

    def __init__(self, tokens: Sequence[str]):
        self.itos = [PAD, SOS, EOS, UNK] + [t for t in dict.fromkeys(tokens) if t not in (PAD, SOS, EOS, UNK)]
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other) -> bool:
        return isinstance(other, Vocab) and self.itos == other.itos

    def encode(self, tokens: Sequence[str]) -> list[int]:
        unk = self.stoi[UNK]
        return [self.stoi.get(t, unk) for t in tokens]

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.itos[i] for i in ids]

    sos, eos, pad = 1, 2, 0


def cache_dir() -> Path:
    """Where generated task data is cached: ``GTX_CACHE_DIR``, else ``~/.cache/gtx``."""
    return Path(os.environ.get("GTX_CACHE_DIR") or Path.home() / ".cache" / "gtx")


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder and rename: readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Task:
    """Base class of task plugins: subclasses implement ``generate`` (the config dataclass is
    registered beside the class: ``register(name, cls, config=Config)``).

    Attributes:
        eos: the target ends with <eos> (False: fixed-length targets, e.g. one class token).
        beam: the decoding used for test metrics is beam search of this width (1 = greedy).
        cache: generated data is cached on disk under ``cache_dir()``, keyed by the config.
    """

    eos = True
    cache = True

    def __init__(self, name: str, config):
        self.name, self.config = name, config
        self._splits: dict[str, list[Example]] | None = None

    def generate(self) -> dict[str, list[Example]]:
        """Build the splits from the config; deterministic given ``config.seed``."""
        raise NotImplementedError

    def splits(self) -> dict[str, list[Example]]:
        if self._splits is None:
            try:
                self._splits = self._load_or_generate()
            except ValueError as e:
                raise GtxError(f"bad settings for task {self.name!r}: {e}") from None
            for split in SPLITS:
                if not self._splits.get(split):
                    raise GtxError(f"task {self.name!r} produced no {split} examples; check its settings")
            self.src_vocab, self.tgt_vocab = self.vocabularies(self._splits["train"])
        return self._splits

    def _load_or_generate(self) -> dict[str, list[Example]]:
        if not self.cache:
            return self.generate()
        key = json.dumps(dataclasses.asdict(self.config), sort_keys=True)
        path = cache_dir() / "data" / self.name / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
        if path.exists():
            data = json.loads(path.read_text())
            return {s: [tuple(e) for e in data[s]] for s in SPLITS}
        data = self.generate()
        atomic_write_text(path, json.dumps({"config": json.loads(key), **data}))
        return data

    def vocabularies(self, train: list[Example]) -> tuple[Vocab, Vocab]:
        """Source and target vocabularies (from the training split unless the task fixes them)."""
        return Vocab(sorted({t for s, _ in train for t in s})), Vocab(sorted({t for _, y in train for t in y}))

    def max_decode_len(self, src_len: int) -> int:
        """Most target tokens greedy/beam decoding may emit for a source of this length (with <eos>)."""
        return 2 * src_len + 10

    def metrics(self, hypotheses: list[list[str]], references: list[list[str]]) -> dict[str, float]:
        """Task-specific metrics of decoded outputs, beyond sequence accuracy."""
        return {}

    def seq_acc(self, hypotheses, references) -> float:
        return sum(h == r for h, r in zip(hypotheses, references)) / max(len(references), 1)


@dataclass
class Batch:
    """A batch of examples as flat node tensors (no padding) and its token graph.

    ``src`` (N_enc,) ids of source + <eos>, ``tgt_in`` (N_dec,) = <sos> + target, ``tgt_out`` (N_dec,) = target (+ <eos>);
    ``src_pos``/``tgt_pos`` are positions within each sample."""

    src: torch.Tensor
    src_pos: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    tgt_pos: torch.Tensor
    graph: TokenGraph
    split: str
    index: list[int]  # example indices in the split

    @property
    def n_target_tokens(self) -> int:
        return int(self.tgt_out.numel())

    def to(self, device) -> Batch:
        move = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if f.name not in ("graph", "split", "index")}
        return Batch(**move, graph=self.graph.to(device), split=self.split, index=self.index)


def make_batch(task: Task, split: str, index: list[int], pattern: Pattern) -> Batch:
    """The batch of examples ``index`` of a split, with its token graph under ``pattern``."""
    examples = [task.splits()[split][i] for i in index]
    srcs = [task.src_vocab.encode(s) + [Vocab.eos] for s, _ in examples]
    tgts = [task.tgt_vocab.encode(t) for _, t in examples]
    eos = [Vocab.eos] if task.eos else []
    tgt_out = [t + eos for t in tgts]
    tgt_in = [([Vocab.sos] + t)[:-1] for t in tgt_out]  # teacher forcing: the output shifted right
    src_lens = torch.tensor([len(s) for s in srcs])
    tgt_lens = torch.tensor([len(t) for t in tgt_out])
    return Batch(
        src=torch.tensor([i for s in srcs for i in s]),
        src_pos=positions(src_lens),
        tgt_in=torch.tensor([i for t in tgt_in for i in t]),
        tgt_out=torch.tensor([i for t in tgt_out for i in t]),
        tgt_pos=positions(tgt_lens),
        graph=build_graph(pattern, src_lens.tolist(), tgt_lens.tolist()),
        split=split,
        index=index,
    )


def batches(task: Task, split: str, pattern: Pattern, batch_size: int, shuffle_seed: int | None = None) -> Iterator[Batch]:
    """Batches of ``batch_size`` examples; shuffled by ``shuffle_seed`` (None keeps the order)."""
    data = task.splits()[split]
    order = list(range(len(data)))
    if shuffle_seed is not None:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    for i in range(0, len(order), batch_size):
        yield make_batch(task, split, order[i : i + batch_size], pattern)


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
            raise GtxError(f"only {len(examples)} distinct {split} examples of {n} could be drawn; ask for fewer or longer ones")
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
