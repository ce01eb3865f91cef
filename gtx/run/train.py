"""The training loop and evaluation: Adam with the Noam schedule, label smoothing, gradient clipping;
teacher-forced loss and token accuracy (over scored targets), decoded sequence accuracy (seq2seq),
classification accuracy (classify), the task's own metrics per phase."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gtx.attention.module import Attention
from gtx.data.batch import IGNORE, Batch
from gtx.data.task import Task
from gtx.errors import GtxError
from gtx.graph.pattern import STAGES, Pattern
from gtx.graph.tokens import possible_edges
from gtx.memory import peak_mb
from gtx.model.decode import decode
from gtx.model.layers import GraphModel
from gtx.plugins import checks
from gtx.run.cost import BACKWARD, FlopCount
from gtx.run.distributed import World
from gtx.run.generation import generates, generation_metrics
from gtx.values import setting


@dataclass
class TrainConfig:
    epochs: int = setting(
        4,
        "passes over the training split; 0: score the model as built or loaded (a pretrained one) on valid and test",
        "[0, inf)",
    )
    max_steps: int = setting(0, "stop after this many optimizer steps (0: no limit)", "[0, inf)")
    batch_size: int = setting(128, "examples per batch", "[1, inf)")
    eval_batch_size: int = setting(256, range="[1, inf)")
    lr_factor: float = setting(0.5, "Noam schedule factor", "(0, inf)")
    warmup: int = setting(200, "Noam warm-up steps", "[1, inf)")
    label_smoothing: float = setting(0.1, range="[0, 1)")
    clip_norm: float = setting(1.0, "gradient norm clip (0: off)", "[0, inf)")
    decode_valid: int = setting(
        -1,
        "valid examples decoded per epoch for seq_acc, or generated for a task scored by generation (-1: all, 0: none)",
        "[-1, inf)",
    )
    decode_pattern: str = setting(
        "",
        "the pattern each generated token's query reads its keys by, where a task is scored by generation "
        "(the prompt is read under the run's pattern); empty: the run's pattern",
    )
    precision: str = setting(
        "float32",
        "float32, or bfloat16: autocast, matrix products and attention in bfloat16, weights, "
        "optimizer and losses in float32",
    )


PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16}


def check_precision(precision: str) -> torch.dtype | None:
    """The autocast dtype of a ``precision`` setting (None: float32 throughout)."""
    if precision not in PRECISIONS:
        raise GtxError(f"--set precision={precision}: choose {' or '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def forward_pass(model, batch: Batch, device: torch.device, precision: str):
    """The model's output on ``batch`` at ``precision`` (bfloat16: under ``torch.autocast``); its
    logits in float32 either way, so that losses and accuracies are computed alike."""
    dtype = check_precision(precision)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        out = model(batch)
    out.logits = out.logits.float()
    return out


def noam_lr(step: int, dim: int, factor: float, warmup: int) -> float:
    """factor * dim^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al.)."""
    step = max(step, 1)
    return factor * dim**-0.5 * min(step**-0.5, step * warmup**-1.5)


@dataclass
class PhaseStats:
    """Sums over one phase (an epoch of training, or an evaluation)."""

    loss_sum: float = 0.0
    correct: int = 0
    tokens: int = 0
    steps_sum: float = 0.0
    nodes: int = 0
    processed: int = 0  # tokens computed (``Batch.n_tokens``): the throughput's numerator
    context_len: int = 0  # the longest sequence seen
    edges: dict = field(default_factory=dict)  # stage -> [keys read, queries, keys allowed] (gtx.attention.budget)
    groups: dict = field(default_factory=dict)  # group name -> [correct, scored]
    wall_s: float = 0.0
    peak_mem_mb: float = float("nan")
    flops: float = 0.0  # counted (gtx.run.cost), a training step's backward included
    attn_flops: float = 0.0  # the attention's share of them; NaN for a model that attends by itself
    extra: dict = field(default_factory=dict)
    split: str = ""  # the split the batches came from

    def add(self, out, batch: Batch, loss: torch.Tensor, read: dict | None = None) -> None:
        """Add one batch; ``loss`` is the mean cross-entropy over its scored targets; ``read``: its
        forward's keys per stage as the model's ``Attention`` counted them (``take_reads``)."""
        scored = batch.targets != IGNORE
        n = int(scored.sum())
        self.split = batch.split
        hit = (out.logits.argmax(-1) == batch.targets) & scored
        self.loss_sum += float(loss) * n
        self.correct += int(hit.sum())
        self.tokens += n
        self.processed += batch.n_tokens
        if batch.group_ids is not None:
            ids = batch.group_ids[scored]
            correct = torch.bincount(ids[hit[scored]] + 1, minlength=len(batch.group_names) + 1)[1:].tolist()
            count = torch.bincount(ids + 1, minlength=len(batch.group_names) + 1)[1:].tolist()
            for name, c, k in zip(batch.group_names, correct, count):
                total = self.groups.setdefault(name, [0, 0])
                total[0] += c
                total[1] += k
        for steps in out.steps:
            self.steps_sum += float(steps.sum())
            self.nodes += steps.numel()
        self.graph_only(batch, read)

    def graph_only(self, batch: Batch, read: dict | None = None) -> None:
        """Add a batch's lengths and its keys read per stage: ``read``'s where the model's attention
        counted them (every layer and step), else the graph's edges (a model that attends by itself)."""
        graph = batch.graph
        for lens in (graph.src_lens, graph.tgt_lens):
            if lens is not None:
                self.context_len = max(self.context_len, int(lens.max()))
        for stage, e in graph.edges.items():
            counts = (read or {}).get(stage) or (e.num_edges, e.n_dst, possible_edges(e))
            total = self.edges.setdefault(stage, [0, 0, 0])
            for i, x in enumerate(counts):
                total[i] += x

    def row(self) -> dict:
        edges, possible = (sum(t[i] for t in self.edges.values()) for i in (0, 2))
        return {
            "loss": self.loss_sum / max(self.tokens, 1),
            "token_acc": self.correct / max(self.tokens, 1),
            "tokens_per_s": self.processed / self.wall_s if self.wall_s else float("nan"),
            "wall_s": self.wall_s,
            "peak_mem_mb": self.peak_mem_mb,
            "flops": self.flops,
            "attn_flops": self.attn_flops,
            "act_mean_steps": self.steps_sum / self.nodes if self.nodes else float("nan"),
            "context_len": self.context_len,
            "density": edges / possible if possible else float("nan"),
            **{f"edges_per_query_{stage}": self.edges_per_query(stage) for stage in STAGES},
        }

    @classmethod
    def merged(cls, parts: list[PhaseStats]) -> PhaseStats:
        """One phase's statistics from its ranks' parts: sums added; wall time and memory the slowest rank's."""
        if len(parts) == 1:
            return parts[0]
        out = cls(split=parts[0].split)
        for p in parts:
            for name in ("loss_sum", "correct", "tokens", "steps_sum", "nodes", "processed", "flops", "attn_flops"):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            out.context_len = max(out.context_len, p.context_len)
            for table, src in ((out.edges, p.edges), (out.groups, p.groups)):
                for key, values in src.items():
                    table[key] = [a + b for a, b in zip(table.get(key, [0] * len(values)), values)]
        out.wall_s = max(p.wall_s for p in parts)
        out.peak_mem_mb = max(p.peak_mem_mb for p in parts)
        return out

    def density(self, stage: str) -> float:
        """Keys read over the keys the stage allows (``gtx.attention.budget``): 1.0 is full attention."""
        edges, _, possible = self.edges.get(stage, (0, 0, 0))
        return edges / possible if possible else float("nan")

    def task_metrics(self, task: Task) -> dict:
        groups = {g: tuple(v) for g, v in self.groups.items()}
        return checks.metrics(
            f"task {task.name!r} phase_metrics",
            task.phase_metrics(self.loss_sum / max(self.tokens, 1), groups, self.split),
        )

    def edges_per_query(self, stage: str) -> float:
        edges, queries, _ = self.edges.get(stage, (0, 0, 0))
        return edges / queries if queries else float("nan")


class Meter:
    """Wall time and peak memory of a phase (CUDA: allocator peak; CPU: process peak RSS)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.peak_mb = peak_mb("cuda" if self.cuda else "cpu")
        self.wall_s = time.perf_counter() - self.t0


class NonFiniteLoss(GtxError):
    """A split's loss became NaN or infinite: training's at optimizer step ``step``, or an evaluation's
    after ``step`` steps (its weights no longer finite; the runner adds the epoch)."""

    def __init__(self, step: int, value: float, split: str = "train"):
        self.step, self.value, self.split = step, value, split
        at = f"at step {step}" if split == "train" else f"after step {step}"
        super().__init__(f"{'training' if split == 'train' else split} loss is {value} {at}")


class Trainer:
    """Owns the optimiser and step counter of one run (of this rank, under data parallelism)."""

    def __init__(
        self,
        model: GraphModel,
        config: TrainConfig,
        dim: int,
        device: torch.device,
        task: Task | None = None,
        world: World | None = None,
    ):
        self.model, self.config, self.dim, self.device, self.task, self.world = (
            model,
            config,
            dim,
            device,
            task,
            world or World(),
        )
        self.forward = self.world.wrap(model)
        # one kernel for all parameters (CPU and CUDA)
        self.opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)
        self.step = 0

    @property
    def done(self) -> bool:
        return bool(self.config.max_steps) and self.step >= self.config.max_steps

    def train_epoch(self, batches: Iterable[Batch], on_batch: Callable[[], None] = lambda: None) -> PhaseStats:
        """One pass; raises NonFiniteLoss before stepping on a NaN or infinite loss (on every rank).
        The returned statistics are summed over ranks."""
        c, stats = self.config, PhaseStats()
        self.forward.train()
        with Meter(self.device) as meter, FlopCount(self.model) as flops:
            attention = getattr(self.model, "attention", None)
            attention = attention if isinstance(attention, Attention) else None  # plain-torch references have none
            for batch in batches:
                batch = batch.to(self.device)
                if attention is not None:
                    attention.begin_step(self.step)
                out = forward_pass(self.forward, batch, self.device, c.precision)
                read = attention.take_reads() if attention is not None else None
                if self.task:  # plain-torch references in benchmarks train without a task
                    checks.model_output(self.model, out, len(batch.targets), len(self.task.tgt_vocab))
                # sum over this rank's scored targets / the global count (x ranks: DDP averages): the global mean's gradient
                summed = F.cross_entropy(
                    out.logits, batch.targets, ignore_index=IGNORE, label_smoothing=c.label_smoothing, reduction="sum"
                )
                scored = (batch.targets != IGNORE).sum()
                count, bad = self.world.sum(torch.stack([scored, (~summed.isfinite()).long()]).cpu()).tolist()
                if bad:
                    raise NonFiniteLoss(self.step + 1, float(summed.detach()))
                loss = summed * (self.world.size / max(count, 1))
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss
                aux, frozen = attention.take_losses() if attention is not None else (None, False)
                # a trainable pattern's own losses (DSA's indexer); alone while it freezes the model
                if aux is not None:
                    loss = aux if frozen else loss + aux
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                if c.clip_norm:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.clip_norm)
                self.step += 1
                for group in self.opt.param_groups:
                    group["lr"] = noam_lr(self.step, self.dim, c.lr_factor, c.warmup)
                self.opt.step()
                with torch.no_grad():  # the statistics' loss is this rank's mean cross-entropy, without smoothing
                    nll = (
                        F.cross_entropy(out.logits, batch.targets, ignore_index=IGNORE)
                        if c.label_smoothing
                        else summed / scored.clamp_min(1)
                    )
                    stats.add(out, batch, nll, read)
                on_batch()
                if self.done:
                    break
        stats.wall_s, stats.peak_mem_mb = meter.wall_s, meter.peak_mb
        stats.flops, stats.attn_flops = ((1 + BACKWARD) * f for f in (flops.total, flops.attention))
        stats = PhaseStats.merged(self.world.gather(stats))
        stats.extra = stats.task_metrics(self.task) if self.task else {}
        return stats

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = state["step"]


@torch.no_grad()
def evaluate(
    model: GraphModel,
    task: Task,
    batches: Iterable[Batch],
    pattern: Pattern,
    device: torch.device,
    decode_limit: int = -1,
    beam: int = 1,
    precision: str = "float32",
    on_batch: Callable[[], None] = lambda: None,
    decode_pattern: Pattern | None = None,
    on_sample: Callable[[int], Callable[[], None]] = lambda count: lambda: None,
) -> PhaseStats:
    """Teacher-forced loss and token accuracy over the batches, and the task's phase metrics; for
    seq2seq tasks then decode up to ``decode_limit`` examples (-1: all) for sequence accuracy and
    the task's metrics of decoded outputs, timed separately. For classify, ``seq_acc`` is the
    accuracy (one target per sample). A task scored by generation, with a model that generates,
    has up to ``decode_limit`` of its prompts continued, each new token under ``decode_pattern``
    (None: ``pattern``), and the texts scored (``gtx.run.generation``), timed separately; ``on_sample(count)``
    gives the callback called after each generated sample (progress)."""
    model.eval()
    attention = getattr(model, "attention", None)
    attention = attention if isinstance(attention, Attention) else None
    stats, hyps, refs, decode_s = PhaseStats(), [], [], 0.0
    examples = task.splits()
    generate_limit = decode_limit if generates(model, task) else 0
    decode_limit = decode_limit if task.form == "seq2seq" else 0
    with Meter(device) as meter:
        for batch in batches:
            batch = batch.to(device)
            with FlopCount(model) as flops:  # the teacher-forced pass alone: decoding is timed and costed apart
                out = forward_pass(model, batch, device, precision)
            stats.flops += flops.total
            stats.attn_flops += flops.attention
            # the teacher-forced pass's, not decoding's
            read = attention.take_reads() if attention is not None else None
            checks.model_output(model, out, len(batch.targets), len(task.tgt_vocab))
            stats.add(out, batch, F.cross_entropy(out.logits, batch.targets, ignore_index=IGNORE), read)
            if decode_limit < 0 or len(hyps) < decode_limit:
                t0 = time.perf_counter()
                hyps += [task.tgt_vocab.decode(h) for h in decode(model, task, batch, pattern, beam)]
                decode_s += time.perf_counter() - t0
                if attention is not None:
                    attention.take_reads()
                refs += [list(examples[batch.split][i][1]) for i in batch.index]
            on_batch()
    stats.wall_s, stats.peak_mem_mb = meter.wall_s - decode_s, meter.peak_mb
    stats.extra = stats.task_metrics(task)
    if task.form == "classify":
        stats.extra["seq_acc"] = stats.row()["token_acc"]
    if decode_limit:
        if decode_limit > 0:
            hyps, refs = hyps[:decode_limit], refs[:decode_limit]
        decoded = checks.metrics(
            f"task {task.name!r} metrics", {"seq_acc": task.seq_acc(hyps, refs), **task.metrics(hyps, refs)}
        )
        stats.extra.update(**decoded, decoded=len(hyps), decode_s=decode_s, beam=beam)
    if generate_limit:  # at the run's precision, as the teacher-forced pass
        dtype = check_precision(precision)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            generated = generation_metrics(
                model, task, stats.split, pattern, decode_pattern or pattern, generate_limit, on_sample
            )
        stats.extra.update(generated)
        if attention is not None:
            attention.take_reads()  # the teacher-forced pass's reads are the row's, not generation's
    return stats
