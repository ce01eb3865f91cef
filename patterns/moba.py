"""moba: Mixture of Block Attention (Lu et al. 2025): each query token reads its own block and the
earlier blocks whose mean key scores highest with it."""

from dataclasses import replace

import torch

from gtx import BlockSelection, Pattern, hookimpl, parse_pattern, selection

GATES = ("token", "block")


def moba(b: int = 64, k: int = 4, gate: str = "token") -> Pattern:
    """MoBA: blocks of b positions; each query reads k blocks in all, its own (causally) and the k-1
    earlier blocks whose mean key scores highest with it (MoBA's top-k = k).

    Note:
        ``gate=token`` is MoBA as its reference code (MoonshotAI/MoBA ``moba_naive.py``) computes
        it: each query token scores the blocks by q_t . mean(keys of the block), per head.
        ``gate=block`` is a cheaper variant: one choice per query block, by the block's mean
        query, run as one block-sparse call. Decoder self-attention (``dd``) only; other stages
        keep full attention. No n x n score matrix is formed. The choice has no gradient (as in
        MoBA); the attention over the chosen blocks does. Budget: k*b keys per query.

    Checked:
        ``tests/test_moba.py::test_moba_equals_its_definition_on_values_and_gradients`` (per token) and
        ``test_block_gating_equals_its_definition_on_values_and_gradients`` (``gate=block``): against MoBA
        written out in float64, the output at atol and rtol 1e-5, the q, k, v gradients at atol 2e-5 and rtol
        1e-5 (per token) or atol and rtol 1e-5 (block-gated).
    """
    if b < 1 or k < 1:
        raise ValueError(f"need b >= 1 and k >= 1 (blocks read in all, the own one included), got b={b}, k={k}")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r}: choose token (MoBA's, per query token) or block (one choice per query block)")
    candidates = parse_pattern("full")

    def select(q, keys, edges):
        if edges.stage != "dd":
            return None  # full attention on the other stages
        lens = list(edges.sample_lens()[0])
        if gate == "token":
            return selection.choose_token_blocks(q, keys, lens, b, k - 1)
        qm, km = selection.block_means(q, lens, b), selection.block_means(keys, lens, b)  # (B, H, n, D)
        n = qm.shape[2]
        score = qm @ km.transpose(-1, -2)  # (B, H, n, n): query block x key block
        earlier = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        score = score.masked_fill(~earlier, float("-inf"))
        top = score.topk(min(k - 1, max(n - 1, 0)), dim=-1)
        own = torch.arange(n, device=q.device).expand(*score.shape[:2], n)[..., None]
        key_blocks = torch.cat([own, top.indices], -1)
        # (B, n)
        real = (
            torch.arange(n, device=q.device)[None, :]
            < torch.tensor([-(-m // b) for m in lens], device=q.device)[:, None]
        )
        # a shorter sample's padding blocks choose nothing
        chosen = (top.values > float("-inf")) & real[:, None, :, None]
        valid = torch.cat([torch.ones_like(own, dtype=torch.bool), chosen], -1)
        return BlockSelection(b, lens, key_blocks.masked_fill(~valid, 0), valid)

    return replace(candidates, select=select, budget=k * b)


@hookimpl
def register_patterns(register):
    # definition 2: each token chooses its blocks, k counting every block read (1 chose per query block: gate=block)
    register("moba", moba, definition=2)
