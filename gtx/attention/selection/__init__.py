"""The selection contract: how a method that chooses keys from the content hands its choice to the
kernels (public as ``gtx.selection`` and, for the kinds and the call, ``from gtx import ...``).

A pattern's ``select(q, k, edges)`` (or a ``Trainable``'s forward) returns one of the kinds:

- ``KeySelection``: per query and head, the keys it reads (``topk``, DSA): ``keys`` (n, H', K);
- ``TokenBlockSelection``: per query token and head, its own block (causally) and the earlier blocks
  of ``block`` positions it reads (MoBA, NSA's selected branch, ``dsa:b``): ``blocks`` (n, H', K);
- ``BlockSelection``: per sample, head and query block, the key blocks it reads (block-gated MoBA):
  ``key_blocks`` (B, H', n_blocks, K), slot 0 the own block;

each with ``valid`` beside it (a slot that reads nothing) and ``group``: the heads that share one
choice, H' = H // group (head h reads row h // group). ``attend_selection`` runs any of them on the
fused kernels (C on the CPU in float32, Triton on CUDA or under ``GTX_KERNELS=triton``; torch ops
elsewhere; ``kernels``), never forming an n x n matrix. Each kind's ``per_query()`` is the keys each
query read, which a ``Trainable`` reports with ``run.kept``. A bool keep mask (E, H) over candidate
edges stays the simple form for small experiments: any backend runs it, slowly.

The toolkits the built-in methods choose with live here too: ``choice`` (the best keys by a score,
ties to the later key), ``blocks`` (block means, padding samples to blocks, MoBA's gate),
``indexer`` (DSA's lightning indexer: scores, top-k, the KL to the attention), ``compressed``
(NSA's compressed keys and branch).
"""

from __future__ import annotations

import torch

from gtx.attention.selection import blocks, choice, compressed, indexer, kernels, keys
from gtx.attention.selection.blocks import (
    BlockSelection,
    TokenBlockSelection,
    attend_blocks,
    attend_token_blocks,
    block_means,
    choose_token_blocks,
    pad_samples,
    top_per_query,
    unpad_samples,
)
from gtx.attention.selection.choice import top_keys, top_later_first, top_scored
from gtx.attention.selection.keys import KeySelection, attend_keys
from gtx.errors import GtxError
from gtx.graph.tokens import EdgeSet

KINDS = (KeySelection, TokenBlockSelection, BlockSelection)


def attend_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    edges: EdgeSet,
    sel,
    weights: bool = False,
    gate: torch.Tensor | None = None,
):
    """Softmax attention of each query and head over what ``sel`` chose: q (n, H, D) pre-scaled,
    k (N, H, D), v (N, H, Dv) rows of the stage's samples -> (n, H, Dv); rows of queries outside
    ``edges.keep`` (an ACT step's inactive ones) are zero. ``gate`` (n, H, 1): each output row
    scaled by it, inside the kernel (NSA's gates). ``weights``: also return, without gradient, the
    attention's share per slot averaged over the heads, the target a learned chooser trains towards:
    (n, K) per selected key for a ``KeySelection``, (n, 1 + K) per block for a
    ``TokenBlockSelection`` (its own block first); a ``BlockSelection`` has none."""
    if isinstance(sel, KeySelection):
        out = attend_keys(q, k, v, edges, sel, probs=weights)
        if gate is None:
            return out
        return (out[0] * gate, out[1]) if weights else out * gate
    if isinstance(sel, TokenBlockSelection):
        return attend_token_blocks(q, k, v, edges, sel, masses=weights, gate=gate)
    if isinstance(sel, BlockSelection):
        if weights:
            raise GtxError(
                "a BlockSelection's attention has no per-slot weights: choose per token (TokenBlockSelection)"
            )
        out = attend_blocks(q, k, v, edges, sel)
        return out if gate is None else out * gate
    raise GtxError(f"attend_selection takes a {', '.join(kind.__name__ for kind in KINDS)}; got {type(sel).__name__}")


__all__ = [
    "BlockSelection",
    "KINDS",
    "KeySelection",
    "TokenBlockSelection",
    "attend_blocks",
    "attend_keys",
    "attend_selection",
    "attend_token_blocks",
    "block_means",
    "blocks",
    "choice",
    "choose_token_blocks",
    "compressed",
    "indexer",
    "kernels",
    "keys",
    "pad_samples",
    "top_keys",
    "top_later_first",
    "top_per_query",
    "top_scored",
    "unpad_samples",
]
