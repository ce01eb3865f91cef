"""dgl: dgl's fused message passing (u_dot_v, edge_softmax, u_mul_e + sum); memory O(E * H)."""

import torch

from gtx.backends import Backend
from gtx.backends.dgl_compat import dgl_error, import_dgl


def bipartite_graph(edges, device):
    """A dgl unit graph with key nodes as sources and query nodes as destinations."""
    dgl = import_dgl()
    g = dgl.heterograph(
        {("key", "attends", "query"): (edges.src, edges.dst)},
        num_nodes_dict={"key": edges.n_src, "query": edges.n_dst},
    )
    return g.to(device)


class DGLBackend(Backend):
    """dgl built-ins: u_dot_v scores, edge_softmax (stable), u_mul_e_sum aggregation."""

    name = "dgl"

    def available(self, device="cpu"):
        err = dgl_error()
        if err:
            return err
        if torch.device(device).type != "cpu":
            dgl = import_dgl()
            try:
                dgl.graph(([0], [0])).to(device)
            except Exception as e:
                return f"this dgl build cannot use {device} ({type(e).__name__}: {e}); install a CUDA build of dgl"
        return None

    def __call__(self, q, k, v, edges):
        dgl = import_dgl()
        from dgl.nn.functional import edge_softmax

        g = edges.plan(("dgl", q.device), lambda: bipartite_graph(edges, q.device))
        score = dgl.ops.u_dot_v(g, k, q)  # (E, H, 1)
        weight = edge_softmax(g, score)
        return dgl.ops.u_mul_e_sum(g, v, weight)  # (n_dst, H, Dv); empty queries sum to 0
