"""Tasks: vocabularies, seeded and cached splits, batching into token graphs, metrics.

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
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gtx.errors import GtxError, plugin_code
from gtx.graph.pattern import Pattern
from gtx.graph.tokens import TokenGraph, build_graph, positions
from gtx.plugins import checks

PAD, SOS, EOS, UNK = "<pad>", "<sos>", "<eos>", "<unk>"
SPLITS = ("train", "valid", "test")
IGNORE = -100  # a target left out of the loss and the accuracy (cross_entropy's ignore_index)
Example = tuple[Sequence[str], Sequence[str]]  # per form: (source, target), (tokens, groups) or (tokens, [label])


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


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write through a temporary file in the same folder and rename: readers never see a partial
    file, and a kill leaves the previous one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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
    """

    form = "seq2seq"
    metric = "token_acc"
    eos = True
    cache = True
    train_defaults: dict = {}

    def __init__(self, name: str, config):
        self.name, self.config = name, config
        self._splits: dict[str, list[Example]] | None = None

    def generate(self) -> dict[str, list[Example]]:
        """Build the splits from the config; deterministic given ``config.seed``."""
        raise NotImplementedError

    def splits(self) -> dict[str, list[Example]]:
        if self._splits is None:
            with plugin_code(f"task {self.name!r}", "while making its data", settings=f"task {self.name!r}"):
                self._splits = self._load_or_generate()
            checks.examples(f"task {self.name!r}", self._splits)
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
        atomic_write(path, json.dumps({"config": json.loads(key), **data}))
        return data

    def vocabularies(self, train: list[Example]) -> tuple[Vocab, Vocab]:
        """Source and target vocabularies (from the training split unless the task fixes them); an
        ``lm`` task reads and predicts one vocabulary."""
        src = Vocab(sorted({t for s, _ in train for t in s}))
        return (src, src) if self.form == "lm" else (src, Vocab(sorted({t for _, y in train for t in y})))

    def context_len(self) -> int:
        """The longest sequence a model reads at once (positions it needs), over every split."""
        longest = max(len(x) for split in self.splits().values() for x, _ in split)
        return longest - 1 if self.form == "lm" else longest + (self.form == "seq2seq")  # lm: inputs; seq2seq: + <eos>

    def phase_metrics(self, loss: float, groups: dict[str, tuple[int, int]]) -> dict:
        """Task metrics of one phase of teacher-forced predictions (train or evaluation): ``loss`` is
        the mean cross-entropy (nats) per scored target, ``groups`` maps each group name to
        (correct, scored) targets (lm tasks with groups)."""
        return {}

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

    ``src`` (N_enc,) encoder input ids (seq2seq: source + <eos>; classify: the tokens), None for
    lm; ``tgt_in`` (N_dec,) decoder input ids (seq2seq: <sos> + target; lm: tokens[:-1]), None for
    classify; ``src_pos``/``tgt_pos`` positions within each sample. ``targets`` are what the
    logits predict: (N_dec,) next tokens (``IGNORE`` where not scored) or (B,) labels (classify).
    ``group_ids`` (len(targets),) index ``group_names`` per target, -1 for none (lm tasks with groups)."""

    src: torch.Tensor | None
    src_pos: torch.Tensor | None
    tgt_in: torch.Tensor | None
    tgt_pos: torch.Tensor | None
    targets: torch.Tensor
    graph: TokenGraph
    split: str
    index: list[int]  # example indices in the split
    group_ids: torch.Tensor | None = None
    group_names: list[str] = dataclasses.field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Tokens the model computes per pass: decoder tokens (seq2seq, lm), else source tokens."""
        return int((self.tgt_in if self.tgt_in is not None else self.src).numel())

    def to(self, device) -> Batch:
        tensors = ("src", "src_pos", "tgt_in", "tgt_pos", "targets", "group_ids")
        move = {f: None if getattr(self, f) is None else getattr(self, f).to(device) for f in tensors}
        return dataclasses.replace(self, **move, graph=self.graph.to(device))


def _flat(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Concatenated ids, positions within each sequence, and lengths."""
    lens = [len(x) for x in seqs]
    return torch.tensor([i for x in seqs for i in x], dtype=torch.long), positions(torch.tensor(lens)), lens


def make_batch(task: Task, split: str, index: list[int], pattern: Pattern) -> Batch:
    """The batch of examples ``index`` of a split, with its token graph under ``pattern``."""
    examples = [task.splits()[split][i] for i in index]
    if task.form == "lm":
        ids = [task.src_vocab.encode(x) for x, _ in examples]
        tgt_in, tgt_pos, lens = _flat([x[:-1] for x in ids])
        targets = torch.tensor([i for x in ids for i in x[1:]], dtype=torch.long)
        group_ids, names = _groups([g for _, g in examples], lens)
        if group_ids is not None:
            targets[group_ids == -2] = IGNORE
            group_ids[group_ids == -2] = -1
        graph = build_graph(pattern, None, lens)
        return Batch(None, None, tgt_in, tgt_pos, targets, graph, split, index, group_ids, names)
    src, src_pos, src_lens = _flat([task.src_vocab.encode(s) + ([] if task.form == "classify" else [Vocab.eos]) for s, _ in examples])
    if task.form == "classify":
        targets = torch.tensor([task.tgt_vocab.encode(y)[0] for _, y in examples], dtype=torch.long)
        return Batch(src, src_pos, None, None, targets, build_graph(pattern, src_lens), split, index)
    eos = [Vocab.eos] if task.eos else []
    tgt_out = [task.tgt_vocab.encode(t) + eos for _, t in examples]
    tgt_in, tgt_pos, tgt_lens = _flat([([Vocab.sos] + t)[:-1] for t in tgt_out])  # teacher forcing: the output shifted right
    targets = torch.tensor([i for t in tgt_out for i in t], dtype=torch.long)
    return Batch(src, src_pos, tgt_in, tgt_pos, targets, build_graph(pattern, src_lens, tgt_lens), split, index)


def _groups(groups: list[Sequence[str]], lens: list[int]) -> tuple[torch.Tensor | None, list[str]]:
    """Per-target group ids of lm examples: -2 for "" (not scored), -1 for no group at all."""
    if not any(groups):
        return None, []
    names = sorted({g for gs in groups for g in gs if g})
    code = {g: i for i, g in enumerate(names)} | {"": -2}
    ids = []
    for gs, n in zip(groups, lens):
        if gs and len(gs) != n:
            raise GtxError(f"an lm example has {len(gs)} groups for {n} predictions; give one per prediction or none")
        ids += [code[g] for g in gs] if gs else [-1] * n
    return torch.tensor(ids, dtype=torch.long), names


def batches(task: Task, split: str, pattern: Pattern, batch_size: int, shuffle_seed: int | None = None,
            part: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
    """Batches of ``batch_size`` examples; shuffled by ``shuffle_seed`` (None keeps the order).
    ``part=(r, n)``: examples r, r + n, ... of each batch (data-parallel rank r of n); a last batch
    with fewer than n examples is left out then, since every rank must take a step."""
    data = task.splits()[split]
    order = list(range(len(data)))
    if shuffle_seed is not None:
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    rank, size = part
    for i in range(0, len(order), batch_size):
        chunk = order[i : i + batch_size]
        if len(chunk) >= size:
            yield make_batch(task, split, chunk[rank::size], pattern)


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
