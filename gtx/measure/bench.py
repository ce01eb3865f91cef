"""Benchmarks: attention kernels per (pattern, length, backend) (training throughput: ``train_bench``).

Each attention cell runs in a fresh subprocess so that its peak memory (CPU: growth of the
process's peak RSS; CUDA: peak allocated) belongs to that cell alone, and cells do not warm each
other's caches. Times are medians of ``repeats`` after ``warmup`` calls, forward + backward (or,
with ``forward``, the forward alone without gradients, as inference runs it); the first call, which builds the backend's plan for the edge set, is reported as ``first_ms``. The
pseudo-backend ``sdpa`` (``SDPA``) is plain torch for reference: scaled_dot_product_attention on
(1, H, n, D) tensors, ``is_causal``, unmasked or with a bool mask, whichever the pattern needs;
``flexattention`` is FlexAttention, compiled, called directly with the BlockMask of the ``flex`` backend
(on the CPU: forward only).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch

from gtx.memory import peak_mb, reset_peak

ATTENTION_COLUMNS = [
    "pattern",
    "n",
    "backend",
    "edges",
    "keys_per_query",
    "density",
    "ms",
    "first_ms",
    "peak_mem_mb",
    "choice",
    "device",
    "heads",
    "head_dim",
    "mode",
]


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
    forward: bool = False  # time the forward alone, without gradients

    @property
    def mode(self) -> str:
        return "forward" if self.forward else "fwd+bwd"

    def run(self, forward_fn, grad: torch.Tensor) -> None:
        """One timed call: ``forward_fn()``, then its backward against ``grad`` unless ``forward``."""
        with torch.set_grad_enabled(not self.forward):
            out = forward_fn()
        if not self.forward:
            out.backward(grad)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


SDPA = "sdpa"  # bench attention's plain-torch row (not a gtx backend): what a user would write instead
FLEXATTENTION = "flexattention"  # ... and FlexAttention called directly with flex's BlockMask (CUDA)


def sdpa_mode(edges) -> str:
    """How plain torch runs a one-sequence edge set (unique edges, as patterns give): "is_causal"
    when it is exactly causal (key <= query), "unmasked" when complete, else "bool mask"."""
    if edges.structure is not None:  # declared by the pattern: no edges read
        return {"causal": "is_causal", "complete": "unmasked"}[edges.structure]
    n_q, n_k, e = edges.n_dst, edges.n_src, edges.num_edges
    if e == n_q * n_k:
        return "unmasked"
    if n_q == n_k and e == n_q * (n_q + 1) // 2 and bool((edges.src <= edges.dst).all()):
        return "is_causal"
    return "bool mask"


def _gtx_cell(cell: AttentionCell, edges, device: torch.device, gen: torch.Generator):
    """(step, choice): forward + backward (or forward, ``cell.forward``) of ``propagate_attention`` with
    the cell's backend on (n, H, D) inputs, and what the backend chose (called after the steps)."""
    from gtx.backends import get_backend
    from gtx.graph.tokens import EdgeSet
    from gtx.model.engine import propagate_attention

    backend = get_backend(cell.backend, device)
    q, k, v = (
        torch.randn(cell.n, cell.heads, cell.head_dim, generator=gen).to(device).requires_grad_(not cell.forward)
        for _ in range(3)
    )
    grad = torch.randn(cell.n, cell.heads, cell.head_dim, generator=gen).to(device)
    # one tiny call first: libraries the backend imports lazily must not count as its memory
    tiny = EdgeSet(torch.arange(4, device=device), torch.arange(4, device=device), 4, 4, "ee")
    with torch.no_grad():
        propagate_attention(
            *(torch.randn(4, cell.heads, cell.head_dim, device=device) for _ in range(3)), tiny, backend
        )
    backend.reset_choices()

    def step():
        q.grad = k.grad = v.grad = None
        cell.run(lambda: propagate_attention(q, k, v, edges, backend), grad)

    def choice():
        counts = backend.reset_choices().get("ee", {})
        return max(counts, key=counts.get) if counts else ""

    return step, choice


def _sdpa_cell(cell: AttentionCell, edges, device: torch.device, gen: torch.Generator):
    """(step, choice) of the ``sdpa`` row: torch's scaled_dot_product_attention called directly on
    (1, H, n, D) inputs, ``is_causal``, unmasked or with the (n, n) bool mask (built by the first
    step, as dense builds its own) by ``sdpa_mode``."""
    import torch.nn.functional as F

    mode = sdpa_mode(edges)
    shape = (1, cell.heads, cell.n, cell.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device).requires_grad_(not cell.forward) for _ in range(3))
    grad = torch.randn(shape, generator=gen).to(device)
    tiny = torch.randn(1, cell.heads, 4, cell.head_dim, device=device)
    F.scaled_dot_product_attention(tiny, tiny, tiny, is_causal=True)
    mask = []

    def step():
        if mode == "bool mask" and not mask:
            mask.append(edges.dense())
        q.grad = k.grad = v.grad = None
        cell.run(
            lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[0] if mask else None, is_causal=mode == "is_causal"
            ),
            grad,
        )

    return step, lambda: mode


def _flexattention_cell(cell: AttentionCell, edges, device: torch.device, gen: torch.Generator):
    """(step, choice) of the ``flexattention`` row: torch's FlexAttention, compiled, called directly on
    (1, H, n, D) inputs with the BlockMask that gtx's ``flex`` backend builds for the edges: what the
    ``flex`` rows cost beyond FlexAttention itself."""
    from torch.nn.attention.flex_attention import flex_attention

    from gtx.backends.flex import block_mask

    mask = block_mask(edges)
    shape = (1, cell.heads, mask.seq_lengths[0], cell.head_dim)  # the mask's padded size
    q, k, v = (torch.randn(shape, generator=gen).to(device).requires_grad_(not cell.forward) for _ in range(3))
    grad = torch.randn(shape, generator=gen).to(device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def step():
        q.grad = k.grad = v.grad = None
        cell.run(lambda: compiled(q, k, v, block_mask=mask), grad)

    return step, lambda: "BlockMask"


REFERENCE_CELLS = {SDPA: _sdpa_cell, FLEXATTENTION: _flexattention_cell}


def run_attention_cell(cell: AttentionCell) -> dict:
    """Time one (pattern, n, backend) in this process: forward + backward of ``ee`` attention over
    one sequence of n tokens; backends ``sdpa`` and ``flexattention`` (``REFERENCE_CELLS``) are plain
    torch for reference."""
    prepared = prepare_attention_cell(cell)
    base = reset_peak(prepared.device)  # after the set-up's warm-up call: the peak is the steps' own
    first = prepared.timed()
    for _ in range(cell.warmup):
        prepared.timed()
    times = [prepared.timed() for _ in range(cell.repeats)]
    keys, queries, allowed = prepared.read()
    return {
        "pattern": prepared.spec,
        "n": cell.n,
        "backend": cell.backend,
        "edges": round(keys),
        "keys_per_query": keys / queries,
        "density": keys / allowed,
        "ms": 1000 * statistics.median(times),
        "first_ms": 1000 * first,
        "peak_mem_mb": peak_mb(prepared.device) - base,
        "choice": prepared.choice(),
        "device": str(prepared.device),
        "heads": cell.heads,
        "head_dim": cell.head_dim,
        "mode": cell.mode,
    }


@dataclass
class PreparedCell:
    """An attention cell ready to time: ``step()`` runs one call (forward + backward, or forward);
    ``read()`` is (keys read, queries, pairs allowed) of the calls so far; ``choice()`` what the
    backend chose (read after the steps)."""

    spec: str
    device: torch.device
    step: Callable[[], None]
    choice: Callable[[], str]
    read: Callable[[], tuple[float, int, int]]

    def timed(self) -> float:
        """Seconds of one ``step``, the device's queue drained."""
        t0 = time.perf_counter()
        self.step()
        sync_device(self.device)
        return time.perf_counter() - t0


def prepare_attention_cell(cell: AttentionCell) -> PreparedCell:
    """The cell's inputs, edges and backend, set up (``run_attention_cell`` times it; a script can
    interleave the calls of several cells)."""
    from gtx.graph.spec import parse_pattern
    from gtx.measure.method import method_cell, method_edges
    from gtx.plugins.registry import load_plugins

    load_plugins(dirs=cell.plugins_dirs)
    device = torch.device(cell.device)
    pattern = parse_pattern(cell.pattern)
    gen = torch.Generator(device="cpu").manual_seed(0)
    method = cell.backend not in REFERENCE_CELLS and (pattern.select is not None or pattern.trainable is not None)
    if method:
        step, choice, read = method_cell(cell, pattern, device, gen)
    else:
        # as a batch of training holds them: complete and causal sets by their structure, without edges;
        # others' edges built here, once per lengths as in training, not in the steps' memory
        edges = method_edges(pattern, "ee", cell.n, device)
        count = edges.num_edges
        step, choice = REFERENCE_CELLS.get(cell.backend, _gtx_cell)(cell, edges, device, gen)
        read = lambda: (count, cell.n, cell.n**2)  # noqa: E731 -- the edges are what runs
        if cell.backend in REFERENCE_CELLS and not pattern.plain:
            mode = choice()
            choice = lambda: f"{mode}, its candidates: {cell.backend} chooses nothing"  # noqa: E731
    return PreparedCell(pattern.spec, device, step, choice, read)


def bench_attention(
    patterns,
    lengths,
    backends,
    heads=4,
    head_dim=32,
    repeats=5,
    warmup=1,
    device="cpu",
    plugins_dirs=(),
    timeout_s=900,
    forward=False,
    log=lambda s: None,
) -> pd.DataFrame:
    """Every (pattern, length, backend) cell in its own subprocess, forward + backward or, with
    ``forward``, the forward alone without gradients; a cell that fails or times out is reported
    with ms = NaN and the reason in ``choice``."""
    rows = []
    for pattern in patterns:
        for n in lengths:
            for backend in backends:
                cell = AttentionCell(
                    pattern,
                    n,
                    backend,
                    heads,
                    head_dim,
                    repeats,
                    warmup,
                    device,
                    tuple(map(str, plugins_dirs)),
                    forward,
                )
                try:
                    proc = subprocess.run(
                        [sys.executable, "-m", "gtx.measure.bench", json.dumps(asdict(cell))],
                        capture_output=True,
                        text=True,
                        timeout=timeout_s,
                        env={**os.environ, "PYTHONWARNINGS": "ignore"},
                    )
                    if proc.returncode:
                        raise RuntimeError((proc.stderr.strip().splitlines() or ["failed"])[-1])
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    reason = f"timed out after {timeout_s}s" if isinstance(e, subprocess.TimeoutExpired) else str(e)
                    row = {
                        "pattern": pattern,
                        "n": n,
                        "backend": backend,
                        "ms": float("nan"),
                        "choice": f"error: {reason}",
                        "mode": "forward" if forward else "fwd+bwd",
                    }
                mem = row.get("peak_mem_mb", float("nan"))
                log(
                    f"{row['pattern']:<16} n={n:<6} {backend:<12} {row['ms']:10.1f} ms  {mem:9.1f} MB  {row.get('choice', '')}"
                )
                rows.append(row)
    return pd.DataFrame(rows).reindex(columns=ATTENTION_COLUMNS)


def save(df: pd.DataFrame, results_dir: str | Path, kind: str) -> Path:
    """Write a benchmark table under ``<results>/bench/`` (atomically) and return its path."""
    from gtx.files import atomic_write
    from gtx.records.layout import ResultsFolder

    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = ResultsFolder(results_dir).bench(kind, stamp)
    atomic_write(path, df.to_csv(index=False))
    return path


if __name__ == "__main__":  # one attention cell, for bench_attention's subprocesses
    fields = json.loads(sys.argv[1])
    fields["plugins_dirs"] = tuple(fields["plugins_dirs"])
    print(json.dumps(run_attention_cell(AttentionCell(**fields))))
