"""Attention backends: how ``propagate_attention`` is computed for an edge set.

Contract for every backend: ``backend(q, k, v, edges)`` with q (n_dst, H, D) already scaled by
1/sqrt(D), k (n_src, H, D), v (n_src, H, Dv) returns (n_dst, H, Dv): for each query the softmax of
q.k over its incoming edges (numerically stable: max-subtracted) weighting the values. A backend
with ``supports_bias`` also takes ``bias=`` (E, H), added to each edge's score before the softmax. A query with
no incoming edge (a halted ACT node) gets zeros. All backends compute the same function, forward
and gradients, to float tolerance; ``dense`` is the reference. A backend with ``grouped_kv`` also
takes k and v of fewer heads, H_kv dividing H (grouped-query attention, ``repeat_kv``'s order);
``Attention`` repeats them for any other.
"""

from __future__ import annotations

import functools

import torch

from gtx import hookimpl
from gtx.errors import GtxError, PluginError, plugin_code
from gtx.graph.tokens import EdgeSet


class Backend:
    """Base class: subclasses set ``name`` and implement ``__call__``; ``available`` says why not."""

    name = "?"
    supports_bias = False  # True: ``__call__(q, k, v, edges, bias=...)`` adds bias (E, H) to each edge's score
    grouped_kv = False  # True: takes k and v of fewer heads than q (grouped-query attention)

    def available(self, device: torch.device | str = "cpu") -> str | None:
        """None when usable on ``device``, else a one-line reason."""
        return None

    def trains_on(self, device: torch.device | str = "cpu") -> bool:
        """Whether the backend computes gradients on ``device`` (``auto`` offers one that does not only
        to calls without gradients)."""
        return True

    def supports(self, edges: EdgeSet, dtype: torch.dtype) -> bool:
        """Whether the backend runs this edge set in this dtype (``auto`` offers it only where it does)."""
        return True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet) -> torch.Tensor:
        raise NotImplementedError

    def with_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet):
        """``self(q, k, v, edges)`` and, where the kernel computes it anyway (SDPA's CPU flash kernel on
        plain attention), each query's log-sum-exp of its scores per head, (n_dst, H), without
        gradient; else None."""
        return self(q, k, v, edges), None

    def reset_choices(self) -> dict[str, dict[str, int]]:
        """What the backend chose per stage since the last call (backends that choose override this)."""
        return {}


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query keys or values ``x`` (n, H_kv, D) for ``heads`` query heads: each head repeated
    for the ``heads // H_kv`` query heads of its group, in a row (query head h reads head
    h // (heads // H_kv): transformers' ``repeat_kv`` order); ``x`` itself where it has ``heads``."""
    if x.shape[1] == heads:
        return x
    if heads % x.shape[1]:
        raise ValueError(f"{x.shape[1]} key/value heads for {heads} query heads: they must divide them")
    return x.repeat_interleave(heads // x.shape[1], 1)


def float32_sums(call):
    """For a backend's ``__call__`` whose softmax sums and weighted sums run in the inputs' dtype
    (edge-wise scatters): half-precision inputs are computed in float32 and the output returned in
    their dtype. Summed in bfloat16 over a few hundred keys, gradients drift by ~5% (relative norm);
    SDPA-based kernels accumulate in float32 themselves."""

    @functools.wraps(call)
    def wrapper(self, q, k, v, edges, **kw):
        dtype = q.dtype
        if dtype not in (torch.float16, torch.bfloat16):
            return call(self, q, k, v, edges, **kw)
        bias = kw.get("bias")
        if bias is not None:
            kw["bias"] = bias.float()
        return call(self, q.float(), k.float(), v.float(), edges, **kw).to(dtype)

    return wrapper


def get_backend(name: str, device: torch.device | str = "cpu") -> Backend:
    """The registered backend ``name``, checked to be usable on ``device``."""
    from gtx.plugins.registry import BACKENDS

    backend = as_backend(BACKENDS.get(name))
    reason = backend.available(device)
    if reason:
        raise GtxError(
            f"backend {name!r} is unavailable on {device}: {reason}; choose another with --backend ({', '.join(BACKENDS.names())})"
        )
    return backend


def as_backend(entry) -> Backend:
    """A registry Entry's backend: gtx's own as it is, a plugin's as ``PluginBackend``."""
    from gtx.plugins.registry import DEFAULT_PLUGINS

    return entry.obj if entry.plugin in DEFAULT_PLUGINS else PluginBackend(entry)


class PluginBackend(Backend):
    """A plugin's backend, run so that what it raises is one line naming it (``plugin_code``) and an
    output of the wrong shape is caught where it is made, not as a shape error in the next layer."""

    def __init__(self, entry):
        from gtx.plugins.registry import label_of

        self.inner, self.who = entry.obj, f"backend {entry.name!r} of {label_of(entry.plugin)}"
        self.name, self.supports_bias = self.inner.name, getattr(self.inner, "supports_bias", False)

    def available(self, device="cpu"):
        with plugin_code(self.who, "in available(device)"):
            return self.inner.available(device)

    def trains_on(self, device="cpu"):
        with plugin_code(self.who, "in trains_on(device)"):
            return self.inner.trains_on(device)

    def supports(self, edges, dtype):
        with plugin_code(self.who, "in supports(edges, dtype)"):
            return self.inner.supports(edges, dtype)

    def __call__(self, q, k, v, edges, **kw):
        with plugin_code(self.who, f"computing {edges.stage} attention"):
            out = self.inner(q, k, v, edges, **kw)
        want = (q.shape[0], q.shape[1], v.shape[-1])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise PluginError(f"{self.who} returned {got} for {edges.stage} attention, not (n_dst, H, Dv) = {want}")
        return out

    def reset_choices(self):
        with plugin_code(self.who, "in reset_choices()"):
            return self.inner.reset_choices()


@hookimpl
def register_backends(register):
    from gtx.backends.auto import AutoBackend
    from gtx.backends.blocksparse import BlockSparseBackend
    from gtx.backends.dense import DenseBackend
    from gtx.backends.dgl_ops import DGLBackend, DGLSeedBackend
    from gtx.backends.edgewise import TorchBackend
    from gtx.backends.flex import FlexBackend

    register("dense", DenseBackend())
    register("torch", TorchBackend())
    register("dgl", DGLBackend())
    register("dgl-seed", DGLSeedBackend())
    register("blocksparse", BlockSparseBackend())
    register("flex", FlexBackend())
    register("auto", AutoBackend())
    register("auto-tuned", AutoBackend(measure=True))
