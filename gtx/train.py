"""The training loop and evaluation: Adam with the Noam schedule, label smoothing, gradient clipping;
teacher-forced loss and token accuracy, decoded sequence accuracy."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gtx.decode import decode
from gtx.model import Seq2SeqModel
from gtx.pattern import STAGES, Pattern
from gtx.task import Batch, Task


@dataclass
class TrainConfig:
    epochs: int = field(default=4, metadata={"help": "passes over the training split"})
    max_steps: int = field(default=0, metadata={"help": "stop after this many optimizer steps (0: no limit)"})
    batch_size: int = field(default=128, metadata={"help": "examples per batch"})
    eval_batch_size: int = 256
    lr_factor: float = field(default=0.5, metadata={"help": "Noam schedule factor"})
    warmup: int = field(default=200, metadata={"help": "Noam warm-up steps"})
    label_smoothing: float = 0.1
    clip_norm: float = field(default=1.0, metadata={"help": "gradient norm clip (0: off)"})
    decode_valid: int = field(default=-1, metadata={"help": "valid examples decoded per epoch for seq_acc (-1: all, 0: none)"})


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
    edges: dict = field(default_factory=dict)  # stage -> [edges, queries]
    wall_s: float = 0.0
    peak_mem_mb: float = float("nan")
    extra: dict = field(default_factory=dict)

    def add(self, out, batch: Batch, loss: torch.Tensor) -> None:
        n = batch.n_target_tokens
        self.loss_sum += float(loss) * n
        self.correct += int((out.logits.argmax(-1) == batch.tgt_out).sum())
        self.tokens += n
        for steps in out.steps:
            self.steps_sum += float(steps.sum())
            self.nodes += steps.numel()
        for stage, e in batch.graph.edges.items():
            total = self.edges.setdefault(stage, [0, 0])
            total[0] += e.num_edges
            total[1] += e.n_dst

    def row(self) -> dict:
        return {
            "loss": self.loss_sum / max(self.tokens, 1),
            "token_acc": self.correct / max(self.tokens, 1),
            "tokens_per_s": self.tokens / self.wall_s if self.wall_s else float("nan"),
            "wall_s": self.wall_s,
            "peak_mem_mb": self.peak_mem_mb,
            "act_mean_steps": self.steps_sum / self.nodes if self.nodes else float("nan"),
            **{f"edges_per_query_{stage}": self.edges_per_query(stage) for stage in STAGES},
        }

    def edges_per_query(self, stage: str) -> float:
        edges, queries = self.edges.get(stage, (0, 0))
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
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20
        else:
            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.wall_s = time.perf_counter() - self.t0


class Trainer:
    """Owns the optimiser and step counter of one run."""

    def __init__(self, model: Seq2SeqModel, config: TrainConfig, dim: int, device: torch.device):
        self.model, self.config, self.dim, self.device = model, config, dim, device
        self.opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=True)  # one kernel for all parameters (CPU and CUDA)
        self.step = 0

    @property
    def done(self) -> bool:
        return bool(self.config.max_steps) and self.step >= self.config.max_steps

    def train_epoch(self, batches: Iterable[Batch], on_batch: Callable[[], None] = lambda: None) -> PhaseStats:
        c, stats = self.config, PhaseStats()
        self.model.train()
        with Meter(self.device) as meter:
            for batch in batches:
                batch = batch.to(self.device)
                out = self.model(batch)
                nll = F.cross_entropy(out.logits, batch.tgt_out)
                loss = F.cross_entropy(out.logits, batch.tgt_out, label_smoothing=c.label_smoothing) if c.label_smoothing else nll
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                if c.clip_norm:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.clip_norm)
                self.step += 1
                for group in self.opt.param_groups:
                    group["lr"] = noam_lr(self.step, self.dim, c.lr_factor, c.warmup)
                self.opt.step()
                stats.add(out, batch, nll.detach())
                on_batch()
                if self.done:
                    break
        stats.wall_s, stats.peak_mem_mb = meter.wall_s, meter.peak_mb
        return stats


@torch.no_grad()
def evaluate(model: Seq2SeqModel, task: Task, batches: Iterable[Batch], pattern: Pattern, device: torch.device,
             decode_limit: int = -1, beam: int = 1) -> PhaseStats:
    """Teacher-forced loss and token accuracy over the batches; then decode up to ``decode_limit``
    examples (-1: all) for sequence accuracy and the task's metrics, timed separately."""
    model.eval()
    stats, hyps, refs, decode_s = PhaseStats(), [], [], 0.0
    examples = task.splits()
    with Meter(device) as meter:
        for batch in batches:
            batch = batch.to(device)
            out = model(batch)
            stats.add(out, batch, F.cross_entropy(out.logits, batch.tgt_out))
            if decode_limit < 0 or len(hyps) < decode_limit:
                t0 = time.perf_counter()
                hyps += [task.tgt_vocab.decode(h) for h in decode(model, task, batch, pattern, beam)]
                decode_s += time.perf_counter() - t0
                refs += [list(examples[batch.split][i][1]) for i in batch.index]
    stats.wall_s, stats.peak_mem_mb = meter.wall_s - decode_s, meter.peak_mb
    if decode_limit:
        if decode_limit > 0:
            hyps, refs = hyps[:decode_limit], refs[:decode_limit]
        stats.extra = {"seq_acc": task.seq_acc(hyps, refs), **task.metrics(hyps, refs), "decoded": len(hyps), "decode_s": decode_s, "beam": beam}
    return stats
