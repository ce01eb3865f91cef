"""sinks: StreamingLLM (Xiao et al. 2024): the first s tokens, the attention sinks, and the w most recent."""

import torch

from gtx import Pattern, align, hookimpl


def sink_and_window(s: int, w: int, stage: str):
    """Edges of the first s keys and the keys less than w from the query (or from its aligned source
    position in ``ed``; only those before it in ``dd``), O(edges): a row's sinks, then its window's
    keys from s on, so rows stay sorted and no key comes twice."""

    def fn(n_q, n_k):
        q = torch.arange(n_q)[:, None]
        centre = align(q, n_q, n_k) if stage == "ed" else q
        k = torch.cat([torch.arange(s).expand(n_q, s), centre + torch.arange(-w + 1, 1 if stage == "dd" else w)], 1)
        sink = torch.arange(k.shape[1])[None, :] < s
        ok = (k >= 0) & (k < n_k) & (sink | (k >= s)) & ((k <= q) if stage == "dd" else True)
        return k[ok], q.expand_as(k)[ok]

    return fn


def sinks(s: int = 4, w: int = 64) -> Pattern:
    """StreamingLLM: each query reads the first s positions (the attention sinks) and the w most
    recent positions, itself included.

    Args:
        s: sink tokens (StreamingLLM's ``start_size``, 4).
        w: recent tokens, the query's own among them (its ``recent_size``).

    Note:
        ``dd``: k < s or 0 <= q - k < w, the keys StreamingLLM's cache (``StartRecentKVCache``) holds
        when it decodes position q. ``ee``: k < s or |q - k| < w; ``ed`` that at the aligned source
        position. A fixed pattern: it needs no choice at run time and serves a key/value cache of s + w
        keys. StreamingLLM's positions within the cache (rolling position ids) are not modelled: a
        pattern chooses edges, the model keeps its own positions. Budget: s + w keys per query.

    Checked:
        ``tests/test_inference_methods.py::test_sinks_equal_streaming_llm_decoding_step_by_step``: each
        query's keys equal the cache a token-by-token decoder keeps (the first s, then the last w); the
        output equals float64 dense attention over them at atol and rtol 1e-5, the q, k, v gradients at
        atol 2e-5 and rtol 1e-5;
        ``tests/test_patterns.py::test_pattern_matches_oracle[sinks]``: its edges on every stage equal the
        rule in ``tests/oracles.py``.
    """
    if s < 0 or w < 1:
        raise ValueError(f"need s >= 0 and w >= 1 (the query itself is among the recent tokens), got s={s}, w={w}")

    def rule(q, k, n_q, n_k):
        return (k < s) | ((q - k).abs() < w)

    p = Pattern.from_rule(rule)
    return Pattern(p.ee, p.dd, p.ed, edge_fns={stage: sink_and_window(s, w, stage) for stage in ("ee", "dd", "ed")})


@hookimpl
def register_patterns(register):
    register("sinks", sinks)
