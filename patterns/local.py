"""local: a sliding window of w positions on each side of the query."""

import torch

from gtx import Pattern, align, hookimpl


def band(lo: int, hi: int, aligned: bool = False):
    """Edges q -> keys at offsets lo..hi from the query (or from its aligned key position), O(n*w)."""

    def fn(n_q, n_k):
        q = torch.arange(n_q)[:, None]
        centre = align(q, n_q, n_k) if aligned else q
        k = centre + torch.arange(lo, hi + 1)[None, :]
        ok = (k >= 0) & (k < n_k)
        return k[ok], q.expand_as(k)[ok]

    return fn


def local(w: int = 4) -> Pattern:
    """Sliding window: keys within w positions of the query (two-sided in ee, causal in dd).

    Args:
        w: window half-width; 0 keeps only the self-edge.

    Note:
        ``ee``: |q - k| <= w (two-sided, 2w+1 keys, self included). ``dd``: 0 <= q - k <= w (the
        causal half, w+1 keys). ``ed``: |align(q) - k| <= w, where ``align(q) = min(q, n_src - 1)``
        is the same position in the source: right for copy-like tasks, a choice for others, and
        independent of the target length, which a decoder cannot know while it generates.

    Checked:
        ``tests/test_patterns.py::test_pattern_matches_oracle[local]``: its edges on ``ee``, ``dd`` and ``ed``
        equal, as sets and exactly, those of the rule written out from the definition in ``tests/oracles.py``,
        over random parameters and lengths 1 to 40.
    """
    if w < 0:
        raise ValueError(f"w must be >= 0, got {w}")

    def rule(q, k, n_q, n_k):
        return (q - k).abs() <= w

    p = Pattern.from_rule(rule)
    return Pattern(p.ee, p.dd, p.ed, edge_fns={"ee": band(-w, w), "dd": band(-w, 0), "ed": band(-w, w, aligned=True)})


@hookimpl
def register_patterns(register):
    register("local", local)
