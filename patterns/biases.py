"""Score biases: ALiBi (fixed, per-head slopes) and T5's learned relative-position buckets."""

import math

import torch

from gtx import hookimpl


class ALiBi(torch.nn.Module):
    """ALiBi: score - slope_h * |query - key| (Press et al. 2022); slopes 2^(-8h/H), not learned.

    Checked:
        ``tests/test_attention.py::test_every_backend_agrees_with_dense_on_values_and_gradients``: every backend
        applies it as the dense reference does (output and q, k, v gradients at atol and rtol 1e-5); no test
        compares its slopes with the paper's formula written out.
    """

    def __init__(self, heads: int):
        super().__init__()
        slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, q_pos, k_pos, stage, heads):
        return -(q_pos - k_pos).abs().to(self.slopes.dtype)[:, None] * self.slopes[heads]


def t5_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key - query): exact below half the buckets (per
    direction), logarithmic up to ``max_distance``, the last bucket beyond."""
    n = -relative
    offset = torch.zeros_like(n)
    if bidirectional:
        buckets //= 2
        offset = (n < 0).long() * buckets
        n = n.abs()
    else:
        n = n.clamp_min(0)
    exact = buckets // 2
    log = (
        exact + (torch.log(n.float().clamp_min(1) / exact) / math.log(max_distance / exact) * (buckets - exact)).long()
    )
    return offset + torch.where(n < exact, n, log.clamp_max(buckets - 1))


class RelBias(torch.nn.Module):
    """T5 relative-position buckets: a learned score per (bucket, head), one table per self-attention stage.

    Checked:
        ``tests/test_attention.py::test_t5_buckets_match_the_reference_formula``: the buckets of nine offsets,
        both directions and causal, equal those of T5's formula (32 buckets, max distance 128), exactly;
        ``test_every_backend_agrees_with_dense_on_values_and_gradients``: every backend applies it as the dense
        reference does, the tables' gradients included, at atol and rtol 1e-5.
    """

    def __init__(self, heads: int, buckets: int = 32, max_distance: int = 128):
        super().__init__()
        if buckets < 4 or max_distance <= buckets // 2:
            raise ValueError(
                f"need buckets >= 4 and max_distance > buckets / 2, got buckets={buckets}, max_distance={max_distance}"
            )
        self.buckets, self.max_distance = buckets, max_distance
        # zeros: training starts from the unbiased model, as T5's tables effectively do at small init
        self.tables = torch.nn.ParameterDict({s: torch.nn.Parameter(torch.zeros(buckets, heads)) for s in ("ee", "dd")})

    def forward(self, q_pos, k_pos, stage, heads):
        if stage not in self.tables:
            return None  # T5 biases self-attention only
        bucket = t5_bucket(k_pos - q_pos, stage == "ee", self.buckets, self.max_distance)
        return self.tables[stage][bucket][:, heads]


@hookimpl
def register_biases(register):
    register("alibi", ALiBi)
    register("relbias", RelBias)
