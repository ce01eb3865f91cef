"""auto: per edge set, the backend a cost model predicts to be fastest; the default backend.

Candidates: ``dense`` and ``blocksparse`` (block 32 or 64) everywhere; edge-wise ``dgl`` on CPU
and ``torch``; ``flex`` on CUDA. The model predicts forward+backward time from the edge set's
structure (sizes, edges, active blocks) with per-device constants measured by ``gtx bench
attention`` (see docs/benchmarks.md). A plan is made once per edge set and kept with it; an ACT
subset (``EdgeSet.filter_dst``) reuses its full set's plan instead of planning every step.
Choices are counted per stage in ``choices`` (the runner writes them to the results).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from gtx.backends import Backend
from gtx.backends.blocksparse import block_pairs
from gtx.graph import EdgeSet

# Seconds per unit of work, forward + backward, float32, 2-core x86 CPU (gtx bench attention,
# docs/benchmarks.md); per-call overheads in seconds. CUDA constants favour the fused kernels.
COSTS = {
    "cpu": {
        "dense": (2.0e-10, 3e-4),  # per query*key*head*dim
        "blocksparse": (1.2e-10, 1.5e-3),  # per padded block element*head*dim
        "dgl": (1.0e-9, 1e-3),  # per edge*head*dim
        "torch": (6.0e-9, 1e-3),
    },
    "cuda": {
        "dense": (2.0e-13, 5e-5),
        "blocksparse": (4.0e-13, 3e-4),
        "flex": (1.0e-13, 2e-4),
        "torch": (2.0e-12, 2e-4),
    },
}
BLOCKS = (32, 64)


def estimate(edges: EdgeSet, heads: int, dim: int, device: torch.device, available: set[str]) -> dict[str, float]:
    """Predicted seconds per backend (keys like 'blocksparse:32') for one forward + backward."""
    costs = COSTS["cuda" if device.type == "cuda" else "cpu"]
    hd = heads * dim
    out = {}
    if "dense" in available:
        a, o = costs["dense"]
        out["dense"] = a * edges.n_dst * edges.n_src * hd + o
    if "blocksparse" in available:
        a, o = costs["blocksparse"]
        for b in BLOCKS:
            pairs, n_kb = block_pairs(edges, b)
            n_qb = -(-edges.n_dst // b)
            k_max = int(torch.bincount(pairs // n_kb, minlength=n_qb).max()) if len(pairs) else 1
            out[f"blocksparse:{b}"] = a * n_qb * k_max * b * b * hd + o
    for name in ("dgl", "torch", "flex"):
        if name in available and name in costs:
            a, o = costs[name]
            out[name] = a * edges.num_edges * hd + o
    return out


class AutoBackend(Backend):
    """Chooses dense, blocksparse, dgl, torch or flex per edge set with a calibrated cost model."""

    name = "auto"

    def __init__(self):
        self.choices: dict[str, Counter] = defaultdict(Counter)
        self._backends: dict[str, Backend] = {}

    def candidates(self, device: torch.device) -> dict[str, Backend]:
        from gtx.backends.blocksparse import BlockSparseBackend
        from gtx.plugins import BACKENDS

        key = str(device)
        if key not in self._backends:
            usable = {}
            for name in ("dense", "dgl", "torch", "flex"):
                if name in BACKENDS.names() and BACKENDS.get(name).obj.available(device) is None:
                    usable[name] = BACKENDS.get(name).obj
            for b in BLOCKS:
                usable[f"blocksparse:{b}"] = BlockSparseBackend(b)
            self._backends[key] = usable
        return self._backends[key]

    def choose(self, edges: EdgeSet, heads: int, dim: int, device: torch.device) -> str:
        usable = self.candidates(device)
        kinds = {n.split(":")[0] for n in usable}
        predicted = estimate(edges, heads, dim, device, kinds)
        return min((t, n) for n, t in predicted.items() if n in usable)[1]

    def __call__(self, q, k, v, edges):
        root = edges.parent or edges
        name = root.plan(("auto", q.device, q.shape[1], q.shape[2]), lambda: self.choose(root, q.shape[1], q.shape[2], q.device))
        self.choices[edges.stage or "?"][name] += 1
        return self.candidates(q.device)[name](q, k, v, edges)

    def reset_choices(self) -> dict[str, dict[str, int]]:
        """The choices counted since the last reset, per stage, then start counting afresh."""
        out = {stage: dict(c) for stage, c in self.choices.items()}
        self.choices.clear()
        return out
