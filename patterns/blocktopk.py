"""blocktopk: block-sparse prefill as the Sparse Frontier runs it (Nawrot et al. 2025, after MInference's
block-sparse kernel): each block of queries reads the key blocks its mean query scores highest."""

from dataclasses import replace

import torch

from gtx import BlockSelection, Pattern, hookimpl, parse_pattern, selection


def blocktopk(b: int = 64, k: int = 8) -> Pattern:
    """Block top-k (the Sparse Frontier's block-sparse prefill): blocks of b positions; each query
    block reads k key blocks, its own (causally), the one before it and the first always, the others
    those whose mean key scores highest with the block's mean query.

    Args:
        b: block size, of queries and of keys alike (the Sparse Frontier's ``chunk_size``).
        k: key blocks each query block reads, the three always-read ones among them (its
            ``top_chunks``; at least 3, as there).

    Note:
        As the Sparse Frontier's ``_build_block_index`` chooses (MInference's ``block_sparse_attention``):
        score(i, j) = mean(queries of block i) . mean(keys of block j) per head, blocks after i
        excluded, the own block, block i - 1 and block 0 scored +inf, the k best read. Run as a
        ``BlockSelection`` (one block-sparse call). Decoder self-attention (``dd``) only, other
        stages keep full attention. A prefill method: a block's choice reads all its queries, so in
        training a query's blocks depend on later tokens of its block. The choice has no gradient.
        Budget: k*b keys per query.

    Checked:
        ``tests/test_inference_methods.py::test_blocktopk_chooses_as_its_definition`` (each query block's
        set of key blocks, exactly, against the Sparse Frontier's choice written out in plain torch) and
        ``test_blocktopk_attends_over_exactly_its_blocks``: the output equals float64 dense attention over the
        blocks the definition chooses, causally, at atol and rtol 1e-5, the q, k, v gradients at atol 2e-5
        and rtol 1e-5.
    """
    if b < 1 or k < 3:
        raise ValueError(
            f"need b >= 1 and k >= 3 (the own, the previous and the first block are always read), got b={b}, k={k}"
        )
    candidates = parse_pattern("full")

    def select(q, keys, edges):
        if edges.stage != "dd":
            return None  # full attention on the other stages
        lens = list(edges.sample_lens()[0])
        score = selection.block_means(q, lens, b) @ selection.block_means(keys, lens, b).transpose(-1, -2)
        n = score.shape[-1]  # (B, H, n, n): query block x key block
        i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
        score = score.masked_fill((j == i - 1) | (j == 0), float("inf")).masked_fill(j >= i, float("-inf"))
        values, top = selection.top_later_first(score, k - 1)  # the own block is slot 0
        blocks = torch.tensor([-(-m // b) for m in lens], device=q.device)
        chosen = (values > float("-inf")) & (i < blocks[:, None, None])[
            :, None
        ]  # a shorter sample's padding chooses nothing
        own = i.expand(*score.shape[:2], n, 1)
        valid = torch.cat([torch.ones_like(own, dtype=torch.bool), chosen], -1)
        return BlockSelection(b, lens, torch.cat([own, top], -1).masked_fill(~valid, 0), valid)

    return replace(candidates, select=select, budget=k * b)


@hookimpl
def register_patterns(register):
    register("blocktopk", blocktopk)
