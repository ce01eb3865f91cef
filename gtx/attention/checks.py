"""What a pattern's run-time selection must be, checked at every call: a keep mask bool (E, H) that
leaves each query an edge, or a selection that lists no edges (keys, token blocks, blocks) naming
only candidates. Each failure is one ``PluginError`` line naming the pattern."""

from __future__ import annotations

import torch

from gtx.attention.selection.blocks import BlockSelection, TokenBlockSelection
from gtx.attention.selection.keys import KeySelection
from gtx.errors import PluginError
from gtx.graph.tokens import EdgeSet


def check_keep(spec: str, keep, edges: EdgeSet, heads: int) -> torch.Tensor:
    """A selection mask must be bool (E, H) on the edges' device and leave every query that has
    candidates at least one edge in every head."""
    if (
        not isinstance(keep, torch.Tensor)
        or keep.dtype != torch.bool
        or tuple(keep.shape) != (edges.num_edges, heads)
        or keep.device != edges.device
    ):
        got = (
            f"{keep.dtype} {tuple(keep.shape)} on {keep.device}"
            if isinstance(keep, torch.Tensor)
            else type(keep).__name__
        )
        raise PluginError(
            f"pattern {spec!r} selected {got}; expected a bool mask ({edges.num_edges}, {heads}) over its candidate edges "
            f"on {edges.device}"
        )
    kept = torch.zeros(edges.n_dst, heads, dtype=torch.long, device=keep.device).index_add_(0, edges.dst, keep.long())
    has = edges.in_degree() > 0
    empty = (kept[has] == 0).nonzero()
    if len(empty):
        q, h = (int(x) for x in empty[0])
        raise PluginError(
            f"pattern {spec!r} left query {int(has.nonzero()[q])} without an edge in head {h} ({edges.stage}); "
            "a selection must keep at least one candidate per query"
        )
    return keep


def check_selection(spec: str, chosen, edges: EdgeSet, heads: int) -> None:
    """A selection that does not list edges must still name only candidates: each query's keys within
    its own sample (and, for causal candidates, at or before it), block selections causal, slot 0 the
    query's own block. A keep mask is checked by ``check_keep``. One PluginError line naming the pattern."""

    def bad(what: str):
        raise PluginError(
            f"pattern {spec!r} selected {what} ({edges.stage}); a selection must stay within its candidate edges"
        )

    if isinstance(chosen, KeySelection):
        keys, valid, group = chosen.keys, chosen.valid, chosen.group
        if not isinstance(group, int) or group < 1 or heads % group:
            bad(f"a head group of {group!r}; a group is a whole number of heads that divides the {heads} heads")
        if (
            keys.dtype not in (torch.long, torch.int32)
            or valid.dtype != torch.bool
            or keys.dim() != 3
            or keys.shape != valid.shape
            or keys.shape[:2] != (edges.n_dst, heads // group)
        ):
            bad(
                f"keys {tuple(keys.shape)} {keys.dtype} / valid {tuple(valid.shape)} {valid.dtype}, expected "
                f"({edges.n_dst}, {heads // group}, K) int64 or int32 / bool ({heads} heads in groups of {group})"
            )
        root = edges.root
        q_lens = torch.as_tensor(root.q_lens if root.q_lens is not None else [root.n_dst], device=keys.device)
        k_lens = torch.as_tensor(root.k_lens if root.k_lens is not None else [root.n_src], device=keys.device)
        sample = torch.repeat_interleave(torch.arange(len(q_lens), device=keys.device), q_lens)[:, None, None]
        k_start = (torch.cumsum(k_lens, 0) - k_lens)[sample]
        position = keys - k_start
        outside = (position < 0) | (position >= k_lens[sample])
        if root.structure == "causal":
            outside |= (
                position
                > (torch.arange(edges.n_dst, device=keys.device) - (torch.cumsum(q_lens, 0) - q_lens)[sample[:, 0, 0]])[
                    :, None, None
                ]
            )
        if (outside & valid).any():
            q, h, j = (int(x) for x in (outside & valid).nonzero()[0])
            heads_of = f"head {h}" if group == 1 else f"heads {h * group}..{h * group + group - 1}"
            bad(f"key {int(keys[q, h, j])} for query {q} in {heads_of}, outside the query's sample or after it")
    elif isinstance(chosen, TokenBlockSelection):
        blocks, valid = chosen.blocks, chosen.valid
        rows = _group_rows(chosen.group, heads, bad)
        if (
            blocks.dtype != torch.long
            or valid.dtype != torch.bool
            or blocks.shape != valid.shape
            or blocks.shape[:-1] != (edges.n_dst, rows)
        ):
            bad(
                f"blocks {tuple(blocks.shape)} {blocks.dtype} / valid {tuple(valid.shape)} {valid.dtype}, expected ({edges.n_dst}, {rows}, K) long / bool"
            )
        if tuple(chosen.lens) != edges.sample_lens()[0]:
            bad(
                f"blocks over samples of {list(chosen.lens)} tokens, but its queries come in samples of {list(edges.sample_lens()[0])}"
            )
        lens = torch.as_tensor(chosen.lens, device=blocks.device)
        position = torch.arange(edges.n_dst, device=blocks.device) - torch.repeat_interleave(
            torch.cumsum(lens, 0) - lens, lens
        )
        if ((blocks >= (position // chosen.block)[:, None, None]) & valid).any() or ((blocks < 0) & valid).any():
            bad("a block that is not before the query's own block")
    elif isinstance(chosen, BlockSelection):
        rows = _group_rows(chosen.group, heads, bad)
        kb, valid = chosen.key_blocks, chosen.valid
        if kb.dim() != 4 or kb.shape != valid.shape or tuple(kb.shape[:2]) != (len(chosen.lens), rows):
            bad(
                f"key blocks {tuple(kb.shape)} / valid {tuple(valid.shape)}, expected ({len(chosen.lens)}, {rows}, n_blocks, K)"
            )
        n = chosen.key_blocks.shape[2]
        own = chosen.key_blocks[..., 0] == torch.arange(n, device=chosen.key_blocks.device)
        earlier = chosen.key_blocks[..., 1:] < torch.arange(n, device=chosen.key_blocks.device)[:, None]
        if (
            not bool(own.all())
            or not bool((earlier | ~chosen.valid[..., 1:]).all())
            or not bool(chosen.valid[..., 0].all())
        ):
            bad("a block other than the query's own in slot 0, or a later block")


def _group_rows(group, heads: int, bad) -> int:
    """The rows a block selection of heads in groups of ``group`` has: heads // group, group dividing heads."""
    if not isinstance(group, int) or group < 1 or heads % group:
        bad(f"a choice shared by groups of {group} heads, which does not divide the {heads} heads")
    return heads // group
