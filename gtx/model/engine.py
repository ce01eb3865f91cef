"""The engine's one verb, ``update_graph``, and the attention it propagates.

Node data lives per node type: ``nodes["enc"]["x"]`` is (N_enc, d_model), ``nodes["dec"]["x"]``
(N_dec, d_model). A stage's keys are read from its key type and its queries from its query type
(``gtx.graph.STAGE_TYPES``): ``ee`` enc->enc, ``dd`` dec->dec, ``ed`` enc->dec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence

import torch

from gtx.attention.module import Attention, LayerAttention
from gtx.backends import Backend
from gtx.graph.tokens import STAGE_TYPES, EdgeSet

NodeData = MutableMapping[str, MutableMapping[str, torch.Tensor]]
NodeFn = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
# (function, node type, node ids or None for all nodes of that type)
NodePair = tuple[NodeFn, str, "torch.Tensor | None"]


def propagate_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    edges: EdgeSet,
    backend: Backend,
    inputs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over its incoming edges.

    Args:
        q: (n_dst, H, D) queries; k: (n_src, H, D) keys; v: (n_src, H, Dv) values.
        inputs: the layer's input (n, width) q, k and v were projected from, on a self-attention
            stage: what a pattern's trainable attention may read (``Run.inputs``).
    Returns:
        (n_dst, H, Dv); zeros for a query without incoming edges.
    """
    if edges.pattern is not None and not edges.pattern.plain and not isinstance(backend, (Attention, LayerAttention)):
        # a model built with a bare backend: head groups, fixed biases and selections still apply
        backend = Attention(backend)
    if inputs is not None and isinstance(backend, (Attention, LayerAttention)):
        return backend(q * q.shape[-1] ** -0.5, k, v, edges, inputs=inputs)
    return backend(q * q.shape[-1] ** -0.5, k, v, edges)


class _Rows(Mapping):
    """Read-only view of one node type's fields restricted to some node ids, indexed on access."""

    def __init__(self, data: Mapping[str, torch.Tensor], ids: torch.Tensor | None):
        self.data, self.ids = data, ids

    def __getitem__(self, name):
        t = self.data[name]
        # index_select, not t[ids]: its backward is index_add, where indexing's is a zero-filled
        # accumulate-index_put (~2x slower per call in the UT's step)
        return t if self.ids is None else t.index_select(0, self.ids)

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def apply_nodes(nodes: NodeData, fn: NodeFn, ntype: str, ids: torch.Tensor | None) -> None:
    """Run a node-wise function on some nodes of one type and write back the fields it returns.

    Writing a subset is out of place (``index_copy``), so autograd sees every version."""
    data = nodes[ntype]
    for name, value in fn(_Rows(data, ids)).items():
        if ids is None:
            data[name] = value
        else:
            base = data.get(name)
            if base is None:
                n = next(iter(data.values())).shape[0]
                base = value.new_zeros((n, *value.shape[1:]))
            data[name] = base.index_copy(0, ids, value.to(base.dtype))


def update_graph(
    nodes: NodeData,
    stage: str,
    edges: EdgeSet,
    pre: Sequence[NodePair],
    post: Sequence[NodePair],
    backend: Backend,
) -> None:
    """One attention sub-layer, as in the DGL tutorial: ``pre`` functions compute ``q`` (on the query type)
    and ``k``, ``v`` (on the key type), attention propagates over ``edges`` into ``wv`` on the query
    type, and ``post`` functions finish the layer (output projection, residual, feed-forward).

    q, k, v are (n, H, D) per node; ``wv`` is (n, H, Dv). On a self-attention stage a ``pre`` that
    also writes ``h``, the sub-layer's input (n, d_model) q, k and v are projected from, hands it to
    the attention (``propagate_attention``'s ``inputs``).
    """
    for fn, ntype, ids in pre:
        apply_nodes(nodes, fn, ntype, ids)
    key_type, query_type = STAGE_TYPES[stage]
    keys, queries = nodes[key_type], nodes[query_type]
    inputs = queries.get("h") if key_type == query_type else None
    queries["wv"] = propagate_attention(queries["q"], keys["k"], keys["v"], edges, backend, inputs)
    for fn, ntype, ids in post:
        apply_nodes(nodes, fn, ntype, ids)


class MultiHeadAttention(torch.nn.Module):
    """Projections of a multi-head attention sub-layer: h heads of d_model // h dims.

    ``get(x, fields)`` maps (n, d_model) states to q/k/v of shape (n, h, d_k); ``get_o(wv)`` maps
    (n, h, d_k) back to (n, d_model)."""

    def __init__(self, h: int, d_model: int):
        super().__init__()
        if d_model % h:
            raise ValueError(f"d_model={d_model} must be divisible by heads={h}")
        self.h, self.d_k = h, d_model // h
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d_model, d_model) for _ in range(4))

    def get(self, x: torch.Tensor, fields: str = "qkv") -> dict[str, torch.Tensor]:
        return {f: getattr(self, f)(x).view(-1, self.h, self.d_k) for f in fields}

    def get_o(self, wv: torch.Tensor) -> torch.Tensor:
        return self.o(wv.reshape(wv.shape[0], -1))
