"""bigbird: block sparse window + global + random blocks (Zaheer et al. 2020, HF block_sparse)."""

from functools import lru_cache

import torch

from gtx import Pattern, hookimpl


@lru_cache(maxsize=1024)
def random_blocks(nb_q: int, nb_k: int, r: int, seed: int, causal: bool) -> torch.Tensor:
    """(nb_q, nb_k) bool: r random key blocks per query block outside its window and the global
    blocks (for ``causal``, only earlier blocks). Row i depends only on (seed, i, nb_k), or only on
    (seed, i) when causal, so a decoder's rows do not change as it grows."""
    out = torch.zeros(nb_q, nb_k, dtype=torch.bool)
    for row in range(nb_q):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + row * 1009 + (0 if causal else nb_k))
        candidates = range(1, row - 1) if causal else range(1, nb_k - 1)
        free = torch.tensor([c for c in candidates if abs(c - row) > 1], dtype=torch.long)
        if len(free):
            out[row, free[torch.randperm(len(free), generator=gen)[:r]]] = True
    return out


def bigbird(b: int = 64, r: int = 3, seed: int = 0) -> Pattern:
    """BigBird: blocks of b tokens; each query block sees its neighbours, the global blocks and r random blocks.

    Args:
        b: block size (HF default 64; use a small b for short sequences).
        r: random key blocks per query block (HF default 3).
        seed: seeds the random blocks; the same (seed, lengths) always give the same edges.

    Note:
        Block-level, as in HF ``block_sparse`` (ITC): the first and last blocks are global (they see
        and are seen by all), the sliding window is the previous, current and next block, plus r
        random blocks per query block. ``ed`` evaluates this rule at the aligned source position.
        ``dd`` is the unidirectional form (DeepSpeed's BigBird): the first block global, the window,
        r random earlier blocks, & j <= i; the last block cannot be global there, since a decoder
        does not know where its sequence ends. Self included.

    Checked:
        ``tests/test_patterns.py::test_bigbird_window_global_and_random_blocks``: on every stage its edges
        contain every edge of the window and global blocks of the rule in ``tests/oracles.py``
        (``bigbird_deterministic``); beyond them, in ``ee`` and ``dd``, at most r other key blocks per query
        block, and none in the future in ``dd`` (b 1 to 6, r 0 to 3, lengths 1 to 40); which random blocks
        is not compared with a definition. ``test_bigbird_random_blocks_are_seeded``: the same seed, the
        same blocks; another seed, others.
    """
    if b < 1 or r < 0:
        raise ValueError(f"need b >= 1 and r >= 0, got b={b}, r={r}")

    def rule(q, k, n_q, n_k):
        nb_q, nb_k = -(-n_q // b), -(-n_k // b)
        qb, kb = q // b, k // b
        window = (qb - kb).abs() <= 1
        glob = (qb == 0) | (qb == nb_q - 1) | (kb == 0) | (kb == nb_k - 1)
        return window | glob | random_blocks(nb_q, nb_k, r, seed, False)[qb, kb]

    def decoder_rule(q, k, n_q, n_k):
        nb = -(-n_q // b)
        qb, kb = q // b, k // b
        return ((qb - kb).abs() <= 1) | (qb == 0) | (kb == 0) | random_blocks(nb, nb, r, seed, True)[qb, kb]

    return Pattern.from_rule(rule, decoder_rule)


@hookimpl
def register_patterns(register):
    register("bigbird", bigbird)
