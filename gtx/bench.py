"""Benchmarks: attention kernels per (pattern, length, backend), and training throughput per backend.

Each attention cell runs in a fresh subprocess so that its peak memory (CPU: growth of the
process's peak RSS; CUDA: peak allocated) belongs to that cell alone, and cells do not warm each
other's caches. Times are medians of ``repeats`` after ``warmup`` calls, forward + backward; the
first call, which builds the backend's plan for the edge set, is reported as ``first_ms``.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch

from gtx.backends import Backend
from gtx.errors import GtxError

ATTENTION_COLUMNS = ["pattern", "n", "backend", "edges", "density", "ms", "first_ms", "peak_mem_mb", "choice", "device", "heads", "head_dim"]
TRAIN_COLUMNS = ["task", "model", "pattern", "backend", "tokens_per_s", "step_ms", "attention_ms", "data_ms", "steps", "rounds", "device", "choice"]


@dataclass
class AttentionCell:
    pattern: str
    n: int
    backend: str
    heads: int = 4
    head_dim: int = 32
    repeats: int = 5
    warmup: int = 1
    device: str = "cpu"
    plugins_dirs: tuple[str, ...] = ()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_attention_cell(cell: AttentionCell) -> dict:
    """Time one (pattern, n, backend) in this process: forward + backward of ``ee`` attention over
    one sequence of n tokens."""
    from gtx.backends import get_backend
    from gtx.engine import propagate_attention
    from gtx.graph import EdgeSet
    from gtx.pattern import parse_pattern
    from gtx.plugins import load_plugins

    load_plugins(dirs=cell.plugins_dirs)
    device = torch.device(cell.device)
    backend = get_backend(cell.backend, device)
    src, dst = parse_pattern(cell.pattern).edges("ee", cell.n, cell.n)
    edges = EdgeSet(src.to(device), dst.to(device), cell.n, cell.n, "ee")
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(cell.n, cell.heads, cell.head_dim, generator=gen).to(device).requires_grad_() for _ in range(3))
    grad = torch.randn(cell.n, cell.heads, cell.head_dim, generator=gen).to(device)
    # one tiny call first: libraries the backend imports lazily must not count as its memory
    tiny = EdgeSet(torch.arange(4, device=device), torch.arange(4, device=device), 4, 4, "ee")
    propagate_attention(*(torch.randn(4, cell.heads, cell.head_dim, device=device) for _ in range(3)), tiny, backend)
    backend.reset_choices()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = _peak_mb(device) if device.type == "cpu" else 0.0

    def step():
        q.grad = k.grad = v.grad = None
        propagate_attention(q, k, v, edges, backend).backward(grad)
        _sync(device)

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    for _ in range(cell.warmup):
        step()
    times = []
    for _ in range(cell.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    counts = backend.reset_choices().get("ee", {})
    choice = max(counts, key=counts.get) if counts else ""
    return {
        "pattern": parse_pattern(cell.pattern).spec, "n": cell.n, "backend": cell.backend, "edges": int(src.numel()),
        "density": src.numel() / cell.n**2, "ms": 1000 * statistics.median(times), "first_ms": 1000 * first,
        "peak_mem_mb": _peak_mb(device) - base, "choice": choice, "device": str(device), "heads": cell.heads, "head_dim": cell.head_dim,
    }


def bench_attention(patterns, lengths, backends, heads=4, head_dim=32, repeats=5, warmup=1, device="cpu",
                    plugins_dirs=(), timeout_s=900, log=lambda s: None) -> pd.DataFrame:
    """Every (pattern, length, backend) cell in its own subprocess; a cell that fails or times out
    is reported with ms = NaN and the reason in ``choice``."""
    rows = []
    for pattern in patterns:
        for n in lengths:
            for backend in backends:
                cell = AttentionCell(pattern, n, backend, heads, head_dim, repeats, warmup, device, tuple(map(str, plugins_dirs)))
                try:
                    proc = subprocess.run(
                        [sys.executable, "-m", "gtx.bench", json.dumps(asdict(cell))],
                        capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"},
                    )
                    if proc.returncode:
                        raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    reason = f"timed out after {timeout_s}s" if isinstance(e, subprocess.TimeoutExpired) else str(e)
                    row = {"pattern": pattern, "n": n, "backend": backend, "ms": float("nan"), "choice": f"error: {reason}"}
                mem = row.get("peak_mem_mb", float("nan"))
                log(f"{row['pattern']:<16} n={n:<6} {backend:<12} {row['ms']:10.1f} ms  {mem:9.1f} MB  {row.get('choice', '')}")
                rows.append(row)
    return pd.DataFrame(rows).reindex(columns=ATTENTION_COLUMNS)


class TorchTransformerBaseline(torch.nn.Module):
    """What a user would pick instead: torch.nn.Transformer over padded batches with masks,
    the same sizes, pre-norm, embeddings + sinusoidal positions and a tied output projection."""

    def __init__(self, vocab_src: int, vocab_tgt: int, layers: int, heads: int, dim: int, dim_ff: int, dropout: float):
        super().__init__()
        from gtx.model import PositionalEncoding

        self.src, self.tgt = torch.nn.Embedding(vocab_src, dim), torch.nn.Embedding(vocab_tgt, dim)
        self.pos = PositionalEncoding(dim)
        with warnings.catch_warnings():  # "enable_nested_tensor ... norm_first": nested tensors need post-norm
            warnings.simplefilter("ignore", UserWarning)
            self.net = torch.nn.Transformer(dim, heads, layers, layers, dim_ff, dropout, batch_first=True, norm_first=True)
        self.out = torch.nn.Linear(dim, vocab_tgt)

    def forward(self, src, tgt, src_pad, tgt_pad):
        n = tgt.shape[1]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(n, device=tgt.device, dtype=torch.bool)
        pos_s, pos_t = torch.arange(src.shape[1], device=src.device), torch.arange(n, device=tgt.device)
        h = self.net(self.src(src) + self.pos(pos_s), self.tgt(tgt) + self.pos(pos_t), tgt_mask=causal,
                     src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
        return self.out(h)


def _padded(batch):
    """Flat node tensors -> padded (B, T) tensors and padding masks."""
    from torch.nn.utils.rnn import pad_sequence

    def split(flat, lens):
        return pad_sequence(list(torch.split(flat, lens.tolist())), batch_first=True)

    src_lens, tgt_lens = batch.graph.src_lens, batch.graph.tgt_lens
    src, tgt_in, tgt_out = split(batch.src, src_lens), split(batch.tgt_in, tgt_lens), split(batch.targets, tgt_lens)
    src_pad = torch.arange(src.shape[1])[None] >= src_lens[:, None]
    tgt_pad = torch.arange(tgt_in.shape[1])[None] >= tgt_lens[:, None]
    return src, tgt_in, tgt_out, src_pad, tgt_pad


class SkipAttention(Backend):
    """Not a registered backend: an O(n) stand-in for attention that still sends gradients to q, k
    and v, so that a training step keeps every other cost. Its tokens/s bound what any attention
    backend can reach in that model: the step with attention at zero cost."""

    name = "(no attention)"

    def __call__(self, q, k, v, edges):
        return v.mean(0) + q.sum(-1, keepdim=True) + k.mean(0).sum(-1, keepdim=True)  # (n_dst, H, Dv)


def bench_train(task="copy", model="transformer", pattern="full", backends=("auto",), steps=30, warmup_steps=3,
                settings=None, device="cpu", baseline=True, bound=True, rounds=3, log=lambda s: None) -> pd.DataFrame:
    """Training tokens/s per backend on the same batches (target tokens per second of wall time,
    graph building included), and the same model as torch.nn.Transformer with padded dense masks.

    Every variant is built first, then timed in ``rounds`` interleaved rounds of ``steps`` steps
    (a variant's round runs after every other variant's previous round), so that a slow spell of a
    shared machine hits all of them alike; a row reports the median round. ``bound`` adds the model
    with attention skipped (``SkipAttention``): the ceiling for every backend. ``data_ms`` is the
    part of a step spent building batches and graphs; ``attention_ms`` is the step minus the
    bound's step."""
    import torch.nn.functional as F

    from gtx.backends import get_backend
    from gtx.runner import RunConfig, resolve
    from gtx.task import batches
    from gtx.train import Trainer

    # (row fields, step function, resolved run, backend or None)
    variants = []
    extras = [{}, {"act": "false"}] if model == "ut" else [{}]  # ut: also with halting disabled, same max depth
    names = [(b, extra) for extra in extras for b in [*backends, *([SkipAttention.name] if bound else [])]]
    for backend, extra in names:
        r = resolve(RunConfig(task=task, model=model, pattern=pattern, backend="auto", device=device, settings={**(settings or {}), **extra}))
        torch.manual_seed(0)
        be = SkipAttention() if backend == SkipAttention.name else get_backend(backend, r.device)
        net = r.model_cls(r.model_config, r.task.src_vocab, r.task.tgt_vocab, be).to(r.device)
        trainer = Trainer(net, r.train, getattr(r.model_config, "dim", 128), r.device)
        fields = {"model": model + ("[act=false]" if extra else ""), "pattern": r.chosen.spec, "backend": backend}
        variants.append((fields, lambda b, trainer=trainer: trainer.train_epoch([b]), r, be))
    if baseline and model == "transformer":
        c = r.model_config
        torch.manual_seed(0)
        net = TorchTransformerBaseline(len(r.task.src_vocab), len(r.task.tgt_vocab), c.layers, c.heads, c.dim, c.dim_ff, c.dropout).to(r.device)
        net.out.weight = net.tgt.weight
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)

        def baseline_step(batch, r=r):
            src, tgt_in, tgt_out, src_pad, tgt_pad = (t.to(r.device) for t in _padded(batch))
            logits = net(src, tgt_in, src_pad, tgt_pad)
            loss = F.cross_entropy(logits[~tgt_pad], tgt_out[~tgt_pad], label_smoothing=r.train.label_smoothing)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()

        net.train()
        variants.append(({"model": "torch.nn.Transformer", "pattern": "full (padded, masked)", "backend": "torch.nn"}, baseline_step, r, None))

    # the training split again and again when it holds fewer batches than the steps asked for
    data = list(_take((b for epoch in range(steps + warmup_steps) for b in batches(r.task, "train", r.pattern, r.train.batch_size, shuffle_seed=epoch)),
                      steps + warmup_steps))
    timings = [[] for _ in variants]  # per variant: (tokens, wall_s, data_s) per round
    for round_ in range(rounds):
        for (fields, step, run, be), times in zip(variants, timings):
            if be is not None and round_ == 0:
                be.reset_choices()
            times.append(_time_steps(step, data if round_ == 0 else data[warmup_steps:], warmup_steps if round_ == 0 else 0, run))
            tokens, wall, _ = times[-1]
            log(f"round {round_ + 1}/{rounds}  {fields['model']:<20} {fields['backend']:<16} {tokens / wall:10,.0f} tokens/s")
    rows = []
    for (fields, _, run, be), times in zip(variants, timings):
        tokens, wall, data_s = sorted(times, key=lambda t: t[1])[len(times) // 2]
        n = len(data) - warmup_steps
        rows.append({"task": task, **fields, "tokens_per_s": tokens / wall, "step_ms": 1000 * wall / n, "data_ms": 1000 * data_s / n,
                     "steps": n, "rounds": rounds, "device": str(run.device), "choice": json.dumps(be.reset_choices()) if be else ""})
    df = pd.DataFrame(rows)
    floor = df[df.backend == SkipAttention.name].set_index("model").step_ms
    df["attention_ms"] = df.step_ms - df.model.map(floor)
    return df.reindex(columns=TRAIN_COLUMNS)


def _take(iterator, n):
    for i, item in enumerate(iterator):
        if i >= n:
            return
        yield item


def _time_steps(step, data, warmup_steps, r):
    """Run the first ``warmup_steps`` batches untimed, then time the rest. Every batch is rebuilt
    from its examples with the run's pattern, inside the timed region, so that data cost is counted."""
    from gtx.task import make_batch

    tokens, data_s = 0, 0.0
    for i, batch in enumerate(data):
        if i == warmup_steps:
            _sync(r.device)
            t0 = time.perf_counter()
        d0 = time.perf_counter()
        fresh = make_batch(r.task, batch.split, batch.index, r.pattern)
        if i >= warmup_steps:
            data_s += time.perf_counter() - d0
            tokens += fresh.n_tokens
        step(fresh)
    _sync(r.device)
    return tokens, time.perf_counter() - t0, data_s


CALIBRATION_SUITE = [("full", [256]), ("full", [1024]), ("causal", [2048]), ("local:w=8", [2048]), ("local:w=32", [4096]),
                     ("local:w=32", [8192]), ("local:w=64", [2048]), ("strided:l=64", [4096]), ("strided:l=32", [2048]),
                     ("full", [16] * 128), ("local:w=2", [16] * 128)]


def calibrate(device="cpu", heads=4, head_dim=32, repeats=3, log=lambda s: None) -> dict[str, tuple[float, float]]:
    """Time every auto candidate on a small suite (one long sequence and batches of short ones),
    fit seconds = a * work + overhead per candidate (least relative squared error), and save the constants where
    ``auto`` reads them. Returns the fitted constants."""
    import numpy as np

    from gtx.backends.auto import AutoBackend, costs, costs_path, work
    from gtx.engine import propagate_attention
    from gtx.graph import build_graph
    from gtx.pattern import parse_pattern
    from gtx.task import atomic_write_text

    dev = torch.device(device)
    auto = AutoBackend()
    candidates = auto.candidates(dev)
    kinds = {n.split(":")[0] for n in candidates}
    samples: dict[str, list[tuple[float, float]]] = {}
    for spec, lens in CALIBRATION_SUITE:
        edges = build_graph(parse_pattern(spec), lens).edges["ee"].to(dev)
        units = work(edges, heads, head_dim, kinds)
        q, k, v = (torch.randn(edges.n_dst, heads, head_dim, device=dev, requires_grad=True) for _ in range(3))
        for name, backend in candidates.items():
            if name.split(":")[0] in ("torch",) and edges.num_edges > 2_000_000:
                continue
            times = []
            for i in range(repeats + 1):
                _sync(dev)
                t0 = time.perf_counter()
                propagate_attention(q, k, v, edges, backend).sum().backward()
                _sync(dev)
                if i:  # the first call builds the plan
                    times.append(time.perf_counter() - t0)
            samples.setdefault(name, []).append((units[name], statistics.median(times)))
            log(f"{spec:<12} x{len(lens):<4} {name:<15} {1000 * statistics.median(times):9.2f} ms")
    fitted = {}
    for kind, points in samples.items():
        w, t = np.array(points).T
        # least squares on relative error: small and large cases count alike
        (a, o), *_ = np.linalg.lstsq(np.stack([w / t, 1 / t], 1), np.ones_like(t), rcond=None)
        fitted[kind] = (max(float(a), 1e-15), max(float(o), 0.0))
    path = costs_path(dev.type)
    atomic_write_text(path, json.dumps(fitted, indent=1))
    costs.cache_clear()
    log(f"wrote {path}")
    return fitted


def save(df: pd.DataFrame, results_dir: str | Path, kind: str) -> Path:
    """Write a benchmark table under ``<results>/bench/`` (atomically) and return its path."""
    from gtx.task import atomic_write_text

    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(results_dir) / "bench" / f"{kind}-{stamp}.csv"
    atomic_write_text(path, df.to_csv(index=False))
    return path


def plot_attention(df: pd.DataFrame, path: Path) -> Path:
    """Time against length per backend, log-log, one panel per pattern (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GtxError("plotting needs matplotlib: pip install -e '.[plot]' (the CSV was written)") from None
    patterns = list(dict.fromkeys(df.pattern))
    fig, axes = plt.subplots(1, len(patterns), figsize=(5 * len(patterns), 4), squeeze=False)
    for ax, pattern in zip(axes[0], patterns):
        for backend, rows in df[df.pattern == pattern].groupby("backend"):
            rows = rows.dropna(subset=["ms"]).sort_values("n")
            ax.plot(rows.n, rows.ms, marker="o", label=backend)
        ax.set(xscale="log", yscale="log", xlabel="tokens n", ylabel="forward + backward (ms)", title=pattern)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":  # one attention cell, for bench_attention's subprocesses
    fields = json.loads(sys.argv[1])
    fields["plugins_dirs"] = tuple(fields["plugins_dirs"])
    print(json.dumps(run_attention_cell(AttentionCell(**fields))))
