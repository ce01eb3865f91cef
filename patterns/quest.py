"""quest: Quest (Tang et al. 2024): keys in pages, each page's key range bounding q.k from above; each
query reads its own page and the earlier pages with the highest bound."""

from dataclasses import replace

import torch

from gtx import Pattern, TokenBlockSelection, hookimpl, parse_pattern, selection


def page_bounds(q: torch.Tensor, k: torch.Tensor, p: int) -> torch.Tensor:
    """One sample's q (n, H, D) against its pages of p keys: (n, H, pages), the bound
    sum_d max(q_d min_d, q_d max_d) >= q . k of every key of the page, min and max per dimension over
    the page's keys. (A last page shorter than p is only ever the own page of its queries: never scored.)"""
    pages = selection.pad_samples(k, [len(k)], -(-len(k) // p) * p).view(-1, p, *k.shape[1:])
    low, high = pages.amin(1), pages.amax(1)  # (pages, H, D)
    return torch.einsum("thd,phd->thp", q.clamp(min=0), high) + torch.einsum("thd,phd->thp", q.clamp(max=0), low)


def quest(p: int = 16, k: int = 4) -> Pattern:
    """Quest: keys in pages of p positions; each query reads its own page (causally) and the k earlier
    pages whose upper bound on q.k is highest.

    Args:
        p: page size (Quest's ``page_size``, 16).
        k: earlier pages read besides the own one (Quest's page budget is k + 1, the last page included).

    Note:
        As Quest's kernels choose (``decode_estimate``, ``decode_topk`` under its
        ``InferenceController``): each page keeps the per-dimension minimum and maximum of its keys,
        a query scores each earlier page by sum_d max(q_d min_d, q_d max_d), and the page it is in is
        always read, without a score. Quest decodes a token at a time; here every query chooses so,
        in every layer (Quest's evaluation runs the prompt and its first two layers dense). Per query
        token and head, run as a ``TokenBlockSelection``. Decoder self-attention (``dd``) only, other
        stages keep full attention. The choice has no gradient. Budget: (k + 1)*p keys per query.

    Checked:
        ``tests/test_inference_methods.py::test_quest_chooses_as_its_definition`` (each query's pages,
        exactly, against Quest's page scores written out in plain torch) and
        ``test_quest_attends_over_exactly_its_pages``: the output equals float64 dense attention over the
        pages the definition chooses and the own page, causally, at atol and rtol 1e-5, the q, k, v
        gradients at atol 2e-5 and rtol 1e-5.
    """
    if p < 1 or k < 1:
        raise ValueError(f"need p >= 1 and k >= 1 (earlier pages read besides the own one), got p={p}, k={k}")
    candidates = parse_pattern("full")

    def select(q, keys, edges):
        if edges.stage != "dd":
            return None  # full attention on the other stages
        lens = list(edges.sample_lens()[0])
        width = min(k, max(-(-n // p) for n in lens))
        blocks = torch.zeros(*q.shape[:2], width, dtype=torch.long, device=q.device)
        valid = torch.zeros(blocks.shape, dtype=torch.bool, device=q.device)
        start = 0
        for n in lens:  # a sample at a time: its pages alone, never padded to the longest
            rows = slice(start, start + n)
            score = page_bounds(q[rows], keys[rows], p)
            own = torch.arange(n, device=q.device)[:, None] // p
            later = torch.arange(score.shape[-1], device=q.device)[None, :] >= own  # the own page and after
            values, top = selection.top_later_first(score.masked_fill(later[:, None, :], float("-inf")), k)
            blocks[rows, :, : top.shape[-1]] = top
            valid[rows, :, : top.shape[-1]] = values > float("-inf")
            start += n
        return TokenBlockSelection(p, lens, blocks.masked_fill(~valid, 0), valid)

    return replace(candidates, select=select, budget=(k + 1) * p)


@hookimpl
def register_patterns(register):
    register("quest", quest)
