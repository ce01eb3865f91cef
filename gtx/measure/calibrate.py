"""``gtx bench calibrate``: time every candidate of the ``auto`` backend on a small suite and fit its
cost constants (seconds = a * work + overhead per candidate), saved where ``auto`` reads them."""

from __future__ import annotations

import json
import time

import torch

from gtx.measure.bench import sync_device

CALIBRATION_SUITE = [
    ("full", [256]),
    ("full", [1024]),
    ("causal", [2048]),
    ("local:w=8", [2048]),
    ("local:w=32", [4096]),
    ("local:w=32", [8192]),
    ("local:w=64", [2048]),
    ("strided:l=64", [4096]),
    ("strided:l=32", [2048]),
    ("full", [16] * 128),
    ("local:w=2", [16] * 128),
]


def calibrate(
    device="cpu", heads=4, head_dim=32, repeats=3, forward=True, log=lambda s: None
) -> dict[str, dict[str, tuple[float, float]]]:
    """Time every auto candidate on a small suite (one long sequence and batches of short ones; the
    fastest of ``repeats`` calls after a first one), forward + backward, and with ``forward`` also the forward alone without gradients (where more
    candidates may run: flex on the CPU); fit seconds = a * work + overhead per candidate (least
    relative squared error) and save each table where ``auto`` reads it. Returns the fitted
    constants per table ("cpu", "cpu-forward", ...)."""
    from gtx.backends.auto import costs_path, table_name
    from gtx.errors import GtxError
    from gtx.files import lasting_cache

    dev = torch.device(device)
    lasting_cache("gtx bench calibrate")  # before minutes of measuring, not after them
    for grad in (True, False) if forward else (True,):
        if (path := costs_path(table_name(dev, grad))).exists() and not path.is_file():
            raise GtxError(f"{path} is not a file, so no calibration can be saved there: move it away, then calibrate")
    out = {}
    for grad in (True, False) if forward else (True,):
        table = table_name(dev, grad)
        out[table] = _fit(_samples(dev, heads, head_dim, repeats, grad, log), table, log)
    return out


def _samples(dev, heads, head_dim, repeats, grad, log) -> dict[str, list[tuple[float, float]]]:
    """(units of work, median seconds) per candidate over the suite, forward + backward or forward."""
    from gtx.backends.auto import AutoBackend, work
    from gtx.graph.spec import parse_pattern
    from gtx.graph.tokens import build_graph
    from gtx.model.engine import propagate_attention

    candidates = AutoBackend().candidates(dev, grad)
    kinds = {n.split(":")[0] for n in candidates}
    samples: dict[str, list[tuple[float, float]]] = {}
    for spec, lens in CALIBRATION_SUITE:
        edges = build_graph(parse_pattern(spec), lens).edges["ee"].to(dev)
        units = work(edges, heads, head_dim, kinds)
        q, k, v = (torch.randn(edges.n_dst, heads, head_dim, device=dev, requires_grad=grad) for _ in range(3))
        for name, backend in candidates.items():
            too_slow = name == "torch" and edges.num_edges > 2_000_000
            if too_slow or not backend.supports(edges, q.dtype):  # or a set the candidate cannot run
                continue
            times = []
            for i in range(repeats + 1):
                sync_device(dev)
                t0 = time.perf_counter()
                with torch.set_grad_enabled(grad):
                    out = propagate_attention(q, k, v, edges, backend)
                    if grad:
                        out.sum().backward()
                sync_device(dev)
                if i:  # the first call builds the plan (and compiles flex)
                    times.append(time.perf_counter() - t0)
            # the fastest repeat: a shared machine's slow spells only add time (as auto-tuned times candidates)
            samples.setdefault(name, []).append((units[name], min(times)))
            mode = "fwd+bwd" if grad else "forward"
            log(f"{mode} {spec:<12} x{len(lens):<4} {name:<15} {1000 * min(times):9.2f} ms")
    return samples


def _fit(samples, table: str, log) -> dict[str, tuple[float, float]]:
    """Constants (a, overhead) per candidate, saved as ``table``'s calibration file."""
    import numpy as np

    from gtx.backends.auto import costs, costs_path
    from gtx.files import atomic_write

    fitted = {}
    for kind, points in samples.items():
        w, t = np.array(points).T
        # least squares on relative error: small and large cases count alike
        (a, o), *_ = np.linalg.lstsq(np.stack([w / t, 1 / t], 1), np.ones_like(t), rcond=None)
        fitted[kind] = (max(float(a), 1e-15), max(float(o), 0.0))
    path = costs_path(table)
    atomic_write(path, json.dumps(fitted, indent=1))
    costs.cache_clear()
    log(f"wrote {path}")
    return fitted
