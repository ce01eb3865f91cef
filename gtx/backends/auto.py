"""auto: per edge set, the backend a cost model predicts to be fastest; the default backend.

An edge set that is plain attention (every sample complete or causal) runs as SDPA's own kernels
(``gtx.backends.flash``), chosen before any model (no candidate beats them); its choice reads
``flash-complete`` or ``flash-causal``, counted as ``packed-complete`` or ``packed-causal`` where
flash runs it on its packed kernel (unequal short samples on the CPU). Other sets choose among the
candidates: ``dense`` (the masked kernel) and ``blocksparse`` (blocks of 16, 32 or 64)
everywhere; edge-wise ``dgl`` on CPU and ``torch``; ``packed`` on the CPU in float32 where each
query reads one contiguous run of its sample's keys (``gtx.backends.packed``); ``flex`` on CUDA,
and on the CPU for calls without gradients (its CPU kernel has no backward). The model predicts the call's time from the edge set's structure (sizes, edges,
active blocks) with per-device constants fitted by ``gtx bench calibrate`` (see
docs/benchmarks.md): forward + backward where the inputs need gradients, the forward alone (its own
constants, ``<device>-forward``) where they do not, as in ``gtx eval`` and a prefill. A plan is made once per edge set and kept with it; an ACT
subset (``EdgeSet.filter_dst``) reuses its full set's plan instead of planning every step.
Choices are counted per stage in ``choices`` (the runner writes them to the results).

A cost model with one term per candidate misjudges some structures (a strided pattern whose every
block row touches every block is one, docs/benchmarks.md). ``auto-tuned`` (``measure=True``)
does not trust close predictions: when several candidates are predicted within
``MEASURE_WITHIN`` of the best, it times them on the first call's own inputs (forward, and
backward when gradients are on; ``time_candidates``) and keeps the fastest for that shape class.
Its choices then depend on timings, so two runs of one command can pick different kernels and
(float rounding differing) train to slightly different numbers; ``auto``, the default, decides
from the model alone and is reproducible. A timed first call of a shape class costs a few extra
calls, and its peak memory is that of the largest close candidate.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from gtx.backends import Backend, repeat_kv
from gtx.backends.blocksparse import block_pairs
from gtx.backends.flash import flash_attention, flash_plan, flash_structure
from gtx.backends.packed import QUERY_WORK
from gtx.errors import GtxError
from gtx.graph.tokens import EdgeSet

# Seconds per unit of work and per call, float32, forward + backward ("cpu", "cuda") and forward
# alone ("cpu-forward"; a device without such a table uses its forward + backward one): the built-in
# calibration, measured with ``gtx bench calibrate`` on the machines named in docs/benchmarks.md.
# Running it writes this device kind's tables to <cache>/costs-<table>.json, which then take precedence.
COSTS = {
    "cpu": {
        "dense": (2.49e-10, 0.0),
        "dgl": (2.65e-09, 0.0018),
        "torch": (2.36e-08, 0.0),
        "blocksparse:16": (1.86e-10, 0.0017),
        "blocksparse:32": (1.42e-10, 0.0008),
        "blocksparse:64": (1.18e-10, 0.00065),
        # packed: timed side by side with blocksparse:32 (windows of 16 to 256 at 1k to 16k tokens) and
        # scaled to this table by blocksparse:32's constants (the machine reads slower on some days)
        "packed": (1.15e-10, 0.0002),
    },
    "cpu-forward": {
        "dense": (1.47e-10, 0.0),
        "dgl": (8.41e-10, 0.00043),
        "torch": (4.57e-09, 0.0),
        "flex": (8.66e-11, 0.0009),
        "blocksparse:16": (4.73e-11, 0.00043),
        "blocksparse:32": (3.74e-11, 0.00034),
        "blocksparse:64": (3.33e-11, 0.00036),
        "packed": (3.4e-11, 0.0001),  # as above
    },
    "cuda": {
        "dense": (2.0e-13, 5e-5),
        "blocksparse": (4.0e-13, 3e-4),
        "flex": (1.0e-13, 2e-4),
        "torch": (2.0e-12, 2e-4),
    },
}
BLOCKS = (16, 32, 64)
FLASH = "flash-"  # choice prefix: plain attention, run by gtx.backends.flash
PACKED = "packed-"  # ... and counted so where flash runs it on the packed kernel (short unequal samples)
MEASURE_WITHIN = 1.5  # candidates predicted within this factor of the best are timed, once per shape class


def table_name(device: torch.device, grad: bool = True) -> str:
    """The cost table of calls on ``device``: "cpu" or "cuda" (forward + backward), "<that>-forward"
    without gradients."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    return kind if grad else f"{kind}-forward"


def costs_path(table: str) -> Path:
    from gtx.files import cache_dir

    return cache_dir() / f"costs-{table}.json"


@lru_cache(maxsize=8)
def costs(table: str) -> dict[str, tuple[float, float]]:
    """The constants of a table ("cpu", "cpu-forward", ...): the calibration file if there is one, else
    the built-ins; a forward table with neither is its device's forward + backward table."""
    path = costs_path(table)
    if table.endswith("-forward") and not COSTS.get(table) and not path.exists():
        return costs(table.removesuffix("-forward"))
    table = dict(COSTS.get(table, {}))
    if path.exists():
        table.update(_calibrated(path))
    return table


def _calibrated(path: Path) -> dict[str, tuple[float, float]]:
    """A calibration file's constants: per candidate, two finite numbers >= 0 (seconds per unit of
    work, seconds per call); anything else is one line (a NaN or a negative cost chose no candidate)."""
    try:
        found = json.loads(path.read_text())
        pairs = {str(k): (float(a), float(b)) for k, (a, b) in found.items()}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as e:
        raise GtxError(
            f"{path} is not a calibration table ({type(e).__name__}): delete it, or write it again with gtx bench calibrate"
        ) from None
    for kind, pair in pairs.items():
        if not all(math.isfinite(x) and x >= 0 for x in pair):
            raise GtxError(
                f"{path} is not a calibration table ({kind}'s costs {pair[0]}, {pair[1]} are not finite numbers >= 0): "
                "delete it, or write it again with gtx bench calibrate"
            )
    return pairs


def work(edges: EdgeSet, heads: int, dim: int, kinds: set[str]) -> dict[str, float]:
    """Units of work per candidate ('dense', 'blocksparse:32', 'dgl', ...): query*key*head*dim for
    dense, padded block elements*head*dim for blocksparse, edges*head*dim for edge-wise kernels,
    (edges + QUERY_WORK * queries)*head*dim for packed, and the elements of the active blocks of 128 (``gtx.backends.flex.BLOCK``) *head*dim for flex."""
    hd = heads * dim
    out = {}
    if "dense" in kinds:
        out["dense"] = float(edges.n_dst * edges.n_src * hd)
    if "blocksparse" in kinds:
        for b in BLOCKS:
            pairs, n_kb = block_pairs(edges, b)
            n_qb = -(-edges.n_dst // b)
            k_max = int(torch.bincount(pairs // n_kb, minlength=n_qb).max()) if len(pairs) else 1
            out[f"blocksparse:{b}"] = float(n_qb * k_max * b * b * hd)
    if "flex" in kinds:
        from gtx.backends.flex import BLOCK

        out["flex"] = float(len(block_pairs(edges, BLOCK)[0]) * BLOCK * BLOCK * hd)
    for name in ("dgl", "torch"):
        if name in kinds:
            out[name] = float(edges.num_edges * hd)
    if "packed" in kinds:
        out["packed"] = float((edges.num_edges + QUERY_WORK * edges.n_dst) * hd)
    return out


def estimate(
    edges: EdgeSet, heads: int, dim: int, device: torch.device, kinds: set[str], grad: bool = True
) -> dict[str, float]:
    """Predicted seconds per candidate for one forward + backward (``grad``), or one forward."""
    table = costs(table_name(device, grad))
    out = {}
    for name, units in work(edges, heads, dim, kinds).items():
        constants = table.get(name) or table.get(name.split(":")[0])  # per block size, else per kind
        if constants:
            a, o = constants
            out[name] = a * units + o
    return out


class AutoBackend(Backend):
    """Per edge set, the kernel a calibrated cost model predicts fastest (reproducible).

    Plain attention (every sample complete or causal) runs as SDPA's own kernels; other sets choose
    among dense, blocksparse, dgl, torch, packed and flex (on the CPU: calls without gradients); with
    ``measure`` (``auto-tuned``) the candidates predicted close to the best are timed once per shape class."""

    name = "auto"

    def __init__(self, measure: bool = False):
        self.measure = measure
        self.name = "auto-tuned" if measure else "auto"
        if measure:  # what `gtx backends` shows
            self.__doc__ = "Like auto, but times the candidates predicted within 1.5x of the best, once per shape class (not reproducible)."
        self.choices: dict[str, Counter] = defaultdict(Counter)
        self.measured: dict[tuple, dict[str, float]] = {}  # shape class -> seconds per timed candidate
        self._backends: dict[str, Backend] = {}
        self._by_shape: dict[tuple, str] = {}

    def candidates(self, device: torch.device, grad: bool = True) -> dict[str, Backend]:
        """The usable kernels on ``device``; with ``grad``, only those that have a backward there."""
        usable = self._usable(device)
        return {n: b for n, b in usable.items() if not grad or b.trains_on(device)}

    def _usable(self, device: torch.device) -> dict[str, Backend]:
        from gtx.backends.blocksparse import BlockSparseBackend
        from gtx.backends.dense import DenseBackend
        from gtx.backends.packed import PackedBackend
        from gtx.plugins.registry import BACKENDS

        key = str(device)
        if key not in self._backends:
            usable = {"dense": DenseBackend(flash=False)}  # plain attention never gets this far
            for name in ("dgl", "torch", "flex"):
                if name in BACKENDS.names() and BACKENDS.get(name).obj.available(device) is None:
                    usable[name] = BACKENDS.get(name).obj
            for b in BLOCKS:
                usable[f"blocksparse:{b}"] = BlockSparseBackend(b)
            if PackedBackend().available(device) is None:
                usable["packed"] = PackedBackend()
            self._backends[key] = usable
        return self._backends[key]

    def choose(
        self,
        edges: EdgeSet,
        heads: int,
        dim: int,
        device: torch.device,
        inputs=None,
        biased: bool = False,
        grad: bool = True,
    ) -> str:
        """The candidate for this edge set (or ``flash-<structure>``); ``inputs`` (q, k, v) allow
        timing close candidates; ``biased``: only candidates that add score biases; ``grad``: the call
        needs gradients (only candidates with a backward on ``device``, timed forward + backward)."""
        structure = None if biased else flash_structure(edges)
        if structure is not None:
            return f"{FLASH}{structure}"
        # Batches of one task differ edge by edge but not in shape: decide once per shape class
        # (sizes, edges per query to within ~20%, the candidates that cannot run it), not for every batch.
        dtype = torch.float32 if inputs is None else inputs[0].dtype
        unfit = frozenset(n for n, b in self._usable(device).items() if not b.supports(edges, dtype))
        shape = (
            edges.stage,
            str(device),
            heads,
            dim,
            round(4 * math.log2(edges.n_dst)),
            round(4 * math.log2(edges.n_src)),
            round(4 * math.log2(edges.num_edges + 1)),
            biased,
            grad,
            unfit,
        )
        if shape not in self._by_shape:
            self._by_shape[shape] = self._best(shape, edges, heads, dim, device, inputs, biased, grad)
        return self._by_shape[shape]

    def _best(self, shape, edges, heads, dim, device, inputs, biased, grad) -> str:
        usable = {
            n: b
            for n, b in self.candidates(device, grad).items()
            if (b.supports_bias or not biased) and n not in shape[-1]
        }
        kinds = {n.split(":")[0] for n in usable}
        predicted = {n: t for n, t in estimate(edges, heads, dim, device, kinds, grad).items() if n in usable}
        best = min(predicted.values())
        close = sorted((n for n, t in predicted.items() if t <= MEASURE_WITHIN * best), key=predicted.get)
        if len(close) == 1 or inputs is None or not self.measure:
            return close[0]
        self.measured[shape] = time_candidates({n: usable[n] for n in close}, inputs, edges, biased)
        return min(self.measured[shape], key=self.measured[shape].get)

    supports_bias = True  # routed to the candidates that take biases
    grouped_kv = True  # plain attention's SDPA takes the groups; the other candidates get them repeated

    def _chosen(self, q, k, v, edges, bias) -> str:
        """The choice for this call (planned once per edge set), counted."""
        root, biased = edges.root, bias is not None
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
        name = root.plan(
            ("auto", q.device, q.shape[1], q.shape[2], biased, grad),
            lambda: self.choose(root, q.shape[1], q.shape[2], q.device, (q, *_heads(q, k, v), bias), biased, grad),
        )
        ran = name
        if name.startswith(FLASH) and flash_plan(q, k, v, root, name.removeprefix(FLASH)).ranges is not None:
            ran = PACKED + name.removeprefix(FLASH)
        self.choices[edges.stage or "?"][ran] += 1
        return name

    def with_lse(self, q, k, v, edges):
        name = self._chosen(q, k, v, edges, None)
        if name.startswith(FLASH) and edges.parent is None:
            return flash_attention(q, k, v, edges, name.removeprefix(FLASH), lse=True)
        return self._run(name, q, k, v, edges, None), None

    def __call__(self, q, k, v, edges, bias=None):
        return self._run(self._chosen(q, k, v, edges, bias), q, k, v, edges, bias)

    def _run(self, name, q, k, v, edges, bias):
        if name.startswith(FLASH):  # a subset of a plain-attention set too: flash_attention zeroes dropped queries
            return flash_attention(q, k, v, edges, name.removeprefix(FLASH))
        backend = self._usable(q.device)[name]
        k, v = _heads(q, k, v)
        return backend(q, k, v, edges) if bias is None else backend(q, k, v, edges, bias=bias)

    def reset_choices(self) -> dict[str, dict[str, int]]:
        """The choices counted since the last reset, per stage, then start counting afresh."""
        out = {stage: dict(c) for stage, c in self.choices.items()}
        self.choices.clear()
        return out


def time_candidates(
    backends: dict[str, Backend],
    inputs,
    edges: EdgeSet,
    biased: bool = False,
    rounds: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Seconds per call of each backend on copies of ``inputs`` (q, k, v), backward included when
    gradients are on: the fastest of ``rounds`` calls, taken in turns so that a slow spell of a shared
    machine hits every candidate; a first untimed call builds each backend's plan for the edges.
    ``clock``: seconds, read before and after each call."""
    bias = inputs[3].detach() if biased else None  # timing must not add gradient to learned biases
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs[:3])
    q, k, v = (t.detach().requires_grad_(grad) for t in inputs[:3])

    def call(backend):
        out = backend(q, k, v, edges, bias=bias) if biased else backend(q, k, v, edges)
        if grad:
            out.sum().backward()
        if q.device.type == "cuda":
            torch.cuda.synchronize()

    best = {}
    for round_ in range(rounds + 1):
        for name, backend in backends.items():
            t0 = clock()
            call(backend)
            if round_:
                best[name] = min(best.get(name, math.inf), clock() - t0)
    return best


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with q's heads (``repeat_kv``): what every candidate but plain attention's SDPA takes."""
    return repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
