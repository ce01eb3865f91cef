"""nsa: Native Sparse Attention (DeepSeek, Yuan et al. 2025, arXiv 2502.11089).

Three branches per query and head, mixed by learned sigmoid gates (the paper's eq. 5):
compressed blocks of keys, selected blocks chosen from the compressed branch's weights, and a
sliding window. Trained end to end; the choice of blocks has no gradient (as in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gtx import (
    GtxError,
    TokenBlockSelection,
    Trainable,
    attend_selection,
    batch_edges,
    causal_lens,
    hookimpl,
    parse_pattern,
    selection,
)

PHI = ("mlp", "mean")


@dataclass(frozen=True)
class NSAConfig:
    l: int  # compression block (keys per compressed key)
    d: int  # compression stride
    s: int  # selection block
    n: int  # selected blocks per query, the first and the two local ones included
    w: int  # sliding window: the query and the w - 1 keys before it
    phi: str  # how a block is compressed: mlp (the paper's) or mean pooling
    g: int  # heads per group sharing one selection


class Compressor(nn.Module):
    """The paper's phi: a block of l keys (l, D) plus a learned intra-block position encoding, through
    a two-layer MLP, to one key (D). Shared by the heads, one per layer for keys and one for values."""

    def __init__(self, size: int, stride: int, dim: int):
        super().__init__()
        self.size, self.stride = size, stride
        self.pos = nn.Parameter(torch.zeros(size, dim))
        self.mlp = nn.Sequential(nn.Linear(size * dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """(n, H, D) rows of samples ``lens``, each at least l long -> (B, m, H, D), one key per block
        of l positions at the stride over the zero-padded samples. The first linear map over a
        flattened block is a convolution (kernel l, stride d) and the position encoding a constant it
        adds per block."""
        first = self.mlp[0]
        # (2D, D, l): [o, c, p] = W[o, p * D + c]
        kernel = first.weight.view(-1, self.size, x.shape[-1]).transpose(1, 2)
        bias = first.bias + first.weight @ self.pos.flatten()
        hidden = _StridedConv.apply(x, lens, kernel, bias, self.stride)  # (B, m, H, 2D)
        # the rest again in the backward (one activation and one linear map over m rows): the backward keeps
        # the hidden rows alone, not also the activation's output and the copy the strided rows make for it
        return checkpoint(self._tail, hidden, use_reentrant=False)

    def _tail(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp[2](self.mlp[1](hidden))


CONV_OUTPUTS = 128  # compressed keys per convolution call: its unfolded input stays a few MB at any length


class _StridedConv(torch.autograd.Function):
    """conv1d over each sample's sequence, per head: (n, H, D) rows -> (B, m, H, O), ``CONV_OUTPUTS``
    outputs at a time, so that the channels-first copy of the rows and conv1d's unfolded input
    (l times the rows) exist for one span of rows at a time. The backward keeps the rows themselves
    (which the other branches keep too) and lays out each span for the convolution again."""

    @staticmethod
    def forward(ctx, x, lens, kernel, bias, stride):
        ctx.lens, ctx.stride = lens, stride
        ctx.save_for_backward(x, kernel)
        padded = selection.pad_samples(x, lens, max(lens))  # (B, L, H, D): a view for one sample of its full length
        m = (padded.shape[1] - kernel.shape[-1]) // stride + 1
        hidden = x.new_empty(len(lens), x.shape[1], kernel.shape[0], m)
        with _float32_convolutions():
            for outputs, rows in _spans(m, stride, kernel.shape[-1]):
                hidden[..., outputs] = F.conv1d(_channels_first(padded[:, rows]), kernel, bias, stride=stride).view(
                    *hidden.shape[:3], -1
                )
        return hidden.permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad):
        x, kernel = ctx.saved_tensors
        padded = selection.pad_samples(x, ctx.lens, max(ctx.lens))
        dx = torch.zeros_like(padded) if ctx.needs_input_grad[0] else None
        dkernel = torch.zeros_like(kernel) if ctx.needs_input_grad[2] else None
        dbias = kernel.new_zeros(kernel.shape[0]) if ctx.needs_input_grad[3] else None
        with _float32_convolutions():
            for outputs, rows in _spans(grad.shape[1], ctx.stride, kernel.shape[-1]):
                g = grad[:, outputs].permute(0, 2, 3, 1).reshape(-1, grad.shape[3], outputs.stop - outputs.start)
                dxs, dks, dbs = torch.ops.aten.convolution_backward(
                    g,
                    _channels_first(padded[:, rows]),
                    kernel,
                    [kernel.shape[0]],
                    [ctx.stride],
                    [0],
                    [1],
                    False,
                    [0],
                    1,
                    [dx is not None, dkernel is not None, dbias is not None],
                )
                if dx is not None:  # spans overlap by l - d rows: added
                    dx[:, rows] += dxs.view(len(ctx.lens), x.shape[1], x.shape[2], -1).permute(0, 3, 1, 2)
                if dkernel is not None:
                    dkernel += dks
                if dbias is not None:
                    dbias += dbs
        return None if dx is None else selection.unpad_samples(dx, ctx.lens), None, dkernel, dbias, None


def _spans(m: int, stride: int, size: int):
    """(output slice, input row slice) per ``CONV_OUTPUTS`` outputs of a convolution of kernel ``size``."""
    for j0 in range(0, m, CONV_OUTPUTS):
        j1 = min(j0 + CONV_OUTPUTS, m)
        yield slice(j0, j1), slice(j0 * stride, (j1 - 1) * stride + size)


def _float32_convolutions():
    """cuDNN's convolutions in float32 as asked: by torch's default they run in TF32 (10 bits of
    mantissa), which moved the compressed scores by ~1e-3 on an H200 and the block choice with them."""
    c = torch.backends.cudnn
    return c.flags(enabled=c.enabled, benchmark=c.benchmark, deterministic=c.deterministic, allow_tf32=False)


def _channels_first(padded: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) zero-padded samples -> (B * H, D, L): conv1d's layout (a copy)."""
    return padded.permute(0, 2, 3, 1).reshape(-1, padded.shape[-1], padded.shape[1])


class NativeSparse(Trainable):
    """One layer's NSA: phi for keys and values, the gates, the three branches."""

    def __init__(self, heads: int, head_dim: int, config: NSAConfig):
        super().__init__()
        if heads % config.g:
            raise GtxError(
                f"nsa: g={config.g} heads per group does not divide the model's {heads} heads; choose a divisor of {heads}"
            )
        self.config = config
        if config.phi == "mlp":
            self.phi_k, self.phi_v = Compressor(config.l, config.d, head_dim), Compressor(config.l, config.d, head_dim)
        self.gate = nn.Linear(heads * head_dim, 3 * heads)  # from the query token (q is a linear map of its state)
        self.window = parse_pattern(f"local:w={config.w - 1}")

    def check_length(self, n: int) -> str | None:
        """Blocks far longer than the sequence are padding whose cost follows l or s (s=100000 on 64
        tokens did not finish): refused past twice the sequence, the defaults always allowed."""
        c = self.config
        over = [(k, getattr(c, k)) for k, default in (("l", 32), ("s", 64)) if getattr(c, k) > max(2 * n, default)]
        if not over:
            return None
        said = " and ".join(f"{k}={v}" for k, v in over)
        return f"{said}: blocks of that many positions on sequences of {n} tokens are padding; choose at most {max(2 * n, 64)}"

    def budget_text(self, n: int) -> str:
        """The last query's branches at ``n`` tokens (the docstring's budget): compressed keys, selected and window keys."""
        c = self.config
        compressed, selected, window = max(0, (n - c.l) // c.d + 1), min(c.n * c.s, n), min(c.w, n)
        return (
            f"at most {compressed} compressed + {selected} selected + {window} window keys per query "
            f"(selected and window tokens overlap: at most {min(n, selected + window)} tokens)"
        )

    def compress(self, x: torch.Tensor, lens: list[int], phi: Compressor | None) -> torch.Tensor:
        """(n, H, D) rows of the samples -> (B, m, H, D), one key per block (``selection.compressed.sliding_blocks``)."""
        c, length = self.config, max(lens)
        if phi is None or length < c.l:
            return selection.compressed.sliding_blocks(x, lens, c.l, c.d).mean(
                2
            )  # no block at all when shorter than one
        return phi(x, lens)

    def forward(self, q, k, v, edges, run):
        c, heads = self.config, q.shape[1]
        lens = causal_lens(run.spec, edges)
        kc = self.compress(k, lens, getattr(self, "phi_k", None))  # (B, m, H, D)
        vc = self.compress(v, lens, getattr(self, "phi_v", None))
        ends = selection.compressed.block_ends(kc.shape[1], c.l, c.d, q.device)
        with torch.no_grad():
            chosen = choose_blocks(q.detach(), kc.detach(), lens, ends, c)
        window = window_edges(edges, self.window, lens, q.device)
        gates = torch.sigmoid(self.gate(q.flatten(1))).view(-1, heads, 3, 1)
        # one buffer for the sum, added to in place (a sum of products made four): the selected branch's
        # gated output first, whose rows are contiguous, where the compressed branch's are strided and the
        # output projection would copy (and keep) a strided sum to make it contiguous. Its gate goes into
        # the branch, whose backward weighs its parts by it: a gated copy of the gradient held 1 q-size more
        out = (
            attend_selection(q, k, v, edges, chosen, gate=gates[:, :, 1])
            .addcmul_(run.attend(q, k, v, window), gates[:, :, 2])
            .add_(selection.compressed.attend_compressed(q, kc, vc, lens, ends, gates[:, :, 0, 0]))
        )
        queries = sum(lens)
        run.kept("compressed", selection.compressed.compressed_keys_seen(lens, ends), queries)
        run.kept("selected", chosen.edges_per_head(), queries)
        run.kept("window", window.num_edges, queries)
        tokens, compressed = keys_read(chosen, lens, c, len(ends))
        run.read(tokens + compressed, offered=compressed)  # a key both selected and in the window is read once
        return out


def keys_read(
    chosen: TokenBlockSelection, lens: list[int], c: NSAConfig, blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query (the mean over heads): the distinct tokens its selected and window branches read
    (its own block's causal part, the window, and each chosen earlier block less what the window
    holds of it), and the compressed keys it sees (those of blocks ending at or before it)."""
    device = chosen.valid.device
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    own = pos - pos % c.s
    low = (pos - c.w + 1).clamp_min(0)
    near = pos - torch.minimum(own, low) + 1
    start = chosen.blocks * c.s  # (n, H // g, K), each chosen block before the own one
    end = torch.minimum(start + c.s - 1, (own - 1)[:, None, None])
    overlap = (end - torch.maximum(start, low[:, None, None]) + 1).clamp_min(0)
    far = ((c.s - overlap) * chosen.valid).sum(-1).to(torch.float64).mean(1)
    compressed = ((pos - c.l + 1).div(c.d, rounding_mode="floor") + 1).clamp(0, blocks).to(torch.float64)
    return near + far, compressed


WINDOWS = 4  # batches whose window edges (and their block plan) are kept, for all layers alike


def window_edges(edges, window, lens: list[int], device):
    """The sliding window's edges of a batch of samples ``lens``, kept with the pattern being run
    (``edges.pattern``) for the last few batches' lengths and shared by the layers: the layers of a
    step, and the steps of fixed-length data, build them (and the backend its plan of them) once.
    Each layer once kept its own, for every batch's lengths up to 256: 13 GB on recall at 4096
    tokens, where lengths vary every batch."""
    return edges.pattern.memo(
        "nsa windows",
        (window.spec, tuple(lens), str(device)),
        lambda: batch_edges(window, "dd", lens, lens).to(device),
        WINDOWS,
    )


def choose_blocks(
    q: torch.Tensor, kc: torch.Tensor, lens: list[int], ends: torch.Tensor, c: NSAConfig
) -> TokenBlockSelection:
    """Per query token, the selected blocks of ``c.s`` positions besides its own: importance is the
    compressed branch's weight on the compressed blocks that overlap a selection block (eq. 9, for
    any l, d and s), summed over the ``c.g`` heads of a group; the first block and the one before
    the query's own always kept; the best of the rest up to ``c.n`` blocks in all (own included)."""
    heads, length = q.shape[1], max(lens)
    n_sel = -(-length // c.s)
    j = torch.arange(n_sel, device=q.device)
    # the selection blocks each compressed block overlaps: first..last
    first, last = (
        (ends - c.l + 1) // c.s,
        ends // c.s,
    )
    # the o-th selection block each compressed block overlaps, or n_sel (a column dropped after) where it
    # overlaps fewer: an index_add of all the weights into it, where picking the real ones copied them
    spans = [
        (first + o).masked_fill_(first + o > last, n_sel)
        for o in range(int((last - first).max()) + 1 if len(ends) else 0)
    ]
    width = min(c.n - 1, n_sel)
    # one choice per group of heads: (B, L, heads // g, width), each row read by its g heads
    blocks = torch.zeros(len(lens), length, heads // c.g, width, dtype=torch.long, device=q.device)
    valid = torch.zeros(len(lens), length, heads // c.g, width, dtype=torch.bool, device=q.device)
    for r0, r1, take, weights in selection.compressed.compressed_weights(q, kc, lens, ends):
        # (B, H, rows, n_sel): eq. 9, each weight added where its block overlaps
        score = weights.new_zeros(*weights.shape[:-1], n_sel + 1)
        seen = weights.shape[-1]  # the compressed blocks that end before r1
        # a compressed block spans at most ceil(l / s) + 1 selection blocks: a few index_adds, not a matmul
        for target in spans:
            score.index_add_(-1, target[:seen], weights)
        score = score[..., :n_sel]
        if c.g > 1:
            score = score.unflatten(1, (heads // c.g, c.g)).sum(2)
        own = (torch.arange(r0, r1, device=q.device) // c.s)[:, None]
        earlier = j[None, :] < own
        forced = earlier & ((j[None, :] == 0) | (j[None, :] == own - 1))
        score = score.masked_fill(forced, float("inf")).masked_fill_(~earlier, float("-inf"))
        values, indices = selection.top_later_first(score, width)
        blocks[take.rows, r0:r1] = indices.transpose(1, 2)
        valid[take.rows, r0:r1] = values.transpose(1, 2) > float("-inf")
    return TokenBlockSelection(
        c.s, list(lens), selection.unpad_samples(blocks, lens), selection.unpad_samples(valid, lens), c.g
    )


def nsa(l: int = 32, d: int = 16, s: int = 64, n: int = 4, w: int = 128, phi: str = "mlp", g: int = 1):
    """NSA: compressed blocks of l keys at stride d, n selected blocks of s keys, a window of w keys.

    Note:
        Decoder self-attention (``dd``) of whole causal sequences; other stages keep full
        attention. Budget per query at position t: about t/d compressed keys, n*s selected keys
        (the first block, the two local ones and the n-3 best others), w window keys: at the
        defaults 1024 + 256 + 128 at 16k tokens, 256 + 256 + 128 at 4k, 64 + 256 + 128 at 1k.
        ``phi=mlp`` compresses a block by the paper's MLP with intra-block positions,
        ``phi=mean`` by mean pooling (fla-org/native-sparse-attention's choice). ``g`` heads
        share one selection (the paper's GQA group). Gates: sigmoid of a linear map of the
        query, per head and branch. The paper's 64k-token setting is l=32, d=16, s=64, n=16, w=512.

    Checked:
        ``tests/test_nsa.py::test_nsa_equals_its_definition_on_values_and_every_gradient``: against NSA written
        out in float64, the output at atol and rtol 1e-5, the gradients of q, k, v and every parameter at atol
        2e-5 and rtol 1e-4; ``test_selected_and_window_branches_equal_naive_nsa_given_blocks_and_gates``: those
        two branches at atol and rtol 1e-5, their gradients at atol 2e-5 and rtol 1e-5.
    """
    if min(l, d, s, w, g) < 1:
        raise ValueError(f"l, d, s, w and g must be >= 1, got l={l}, d={d}, s={s}, w={w}, g={g}")
    if d > l:
        raise ValueError(
            f"stride d={d} is larger than the compression block l={l}: keys between blocks would be skipped; choose d <= l"
        )
    if n < 4:
        raise ValueError(
            f"n={n}: n counts the selected blocks including the first and the two local ones, which are always kept; "
            "choose n >= 4 so that the content chooses at least one"
        )
    if phi not in PHI:
        raise ValueError(f"phi={phi!r}: choose mlp (the paper's learned compression) or mean (mean pooling)")
    config = NSAConfig(l, d, s, n, w, phi, g)
    return replace(parse_pattern("full"), trainable=lambda heads, head_dim: NativeSparse(heads, head_dim, config))


@hookimpl
def register_patterns(register):
    register("nsa", nsa)
