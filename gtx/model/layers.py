"""Building blocks shared by model plugins, and the interface the runner expects of a model.

A model is a ``torch.nn.Module`` (``GraphModel``) whose ``forward(batch) -> Output`` gives logits
for ``batch.targets``, and whose ``forms`` name the task forms it serves (``gtx.data.task``). A
sequence-to-sequence model (``Seq2SeqModel``) has::

    encode(src, src_pos, graph) -> Encoded          # encoder states (N_enc, d) and ACT statistics
    decode(encoded, tgt_in, tgt_pos, graph) -> Output  # logits (N_dec, V) over target tokens

and ``forward(batch)`` is ``decode(encode(...))``. Decoding token by token reuses one ``encode``.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from gtx import native
from gtx.data.vocab import Vocab
from gtx.model.engine import MultiHeadAttention


@dataclass
class Encoded:
    """Encoder output: states (N_enc, d); for ACT models also per-node remainders (N_enc, 1) and
    step counts (N_enc,)."""

    x: torch.Tensor
    remainders: torch.Tensor | None = None
    steps: torch.Tensor | None = None


@dataclass
class Output:
    """Model output: logits (len(batch.targets), V); ``aux_loss`` is added to the training loss (ACT's ponder
    cost); ``steps`` holds per-node step counts of encoder and decoder nodes (ACT models)."""

    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None
    steps: list[torch.Tensor] = field(default_factory=list)


POSITIONS = 4096  # rows of the sinusoidal table of a model whose config sets no max_len


class PositionalEncoding(nn.Module):
    """Sinusoidal table, indexed by position (or ACT step): (n,) int64 -> (n, d)."""

    def __init__(self, dim: int, max_len: int = POSITIONS):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
        pe = torch.zeros(max_len, dim)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)[:, : dim // 2]
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.numel() and int(positions.max()) >= self.pe.shape[0]:
            raise ValueError(f"position {int(positions.max())} beyond the table of {self.pe.shape[0]}")
        return self.pe[positions]


class Dropout(nn.Module):
    """Dropout with masks cheap to draw on the CPU. float32 on the CPU: the C kernel
    ``dropout_kernel.c`` keeps element i where a 16-bit lane of a counter-based generator
    (SplitMix64 of a seed and i / 4) is at least round(p * 65536), one seed per call drawn from
    torch's CPU generator (``torch.manual_seed`` and a checkpoint's random state reproduce it); the
    backward draws the mask again from the seed, so nothing is kept. Elsewhere on the CPU (other
    dtypes, no C compiler): one full-range 64-bit draw of torch's generator gives four 16-bit lanes,
    compared alike. Either way the keep probability is exact to 1/65536. ``torch.dropout``'s CPU
    mask (a Bernoulli draw per element) cost ~18% of a small model's training step; the torch lanes
    a quarter of that, the kernel a tenth of theirs. CUDA uses ``torch.dropout``."""

    def __init__(self, p: float):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if x.is_cuda:
            return torch.dropout(x, self.p, True)
        threshold = round(self.p * 65536)
        if native.kernel(KERNEL, x) is not None:
            return _HashedMask.apply(x, int(_random_words(1)[0]), threshold, 1 / (1 - self.p))
        n = x.numel()
        lanes = _random_words(-(-n // 4), x.device).view(torch.int16)[:n]  # uniform on [-2^15, 2^15)
        scale = (lanes >= threshold - 32768).to(x.dtype).mul_(1 / (1 - self.p))
        return x * scale.view_as(x)


KERNEL = "dropout_kernel"


def _random_words(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """n int64 draws of the device's torch generator, every bit uniform (from = int64 min, to = None:
    its full 64-bit range)."""
    return torch.empty(n, dtype=torch.int64, device=device).random_(-(2**63), None)


def hashed_mask(x: torch.Tensor, seed: int, threshold: int, scale: float) -> torch.Tensor:
    """x (float32, CPU) times ``scale`` where the kernel's lane for (``seed``, element) is at least
    ``threshold``, else 0 (``dropout_kernel.c``)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    parts = native.parts(x.numel() // 4096)
    native.check(
        native.load(KERNEL).gtx_dropout(
            *native.ints(parts, x.numel()),
            native.pointer(x),
            native.pointer(out),
            ctypes.c_uint64(seed % 2**64),
            *native.ints(threshold),
            ctypes.c_float(scale),
        )
    )
    return out


class _HashedMask(torch.autograd.Function):
    """Dropout by the kernel: the gradient is masked by the same lanes, drawn again from the seed."""

    @staticmethod
    def forward(ctx, x, seed, threshold, scale):
        ctx.mask = seed, threshold, scale
        return hashed_mask(x, seed, threshold, scale)

    @staticmethod
    def backward(ctx, grad):
        return hashed_mask(grad, *ctx.mask), None, None, None


class FeedForward(nn.Module):
    def __init__(self, dim: int, dim_ff: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim_ff), nn.ReLU(), Dropout(dropout), nn.Linear(dim_ff, dim))

    def forward(self, x):
        return self.net(x)


class Embeddings(nn.Module):
    """Token embedding times ``scale`` plus sinusoidal position, then dropout; source and target
    share one table (and the output projection) when ``share`` and the vocabularies are equal.

    The DGL tutorial multiplies by sqrt(d) (11.3 at d = 128): with xavier-initialised tables that drowns the
    unit-amplitude positions, which copy/sort must learn to attend by first; no scale leaves the
    token content faint. Copy, 1 layer, 1 head, 128 dims, 4 epochs, seed 0, valid token / greedy
    sequence accuracy: scale 11.3: 99.55% / 93.5%; 1: 99.74% / 97.5%; 4 (default): 99.89% / 98.5%."""

    def __init__(
        self,
        src_vocab: Vocab,
        tgt_vocab: Vocab,
        dim: int,
        dropout: float,
        share: bool,
        scale: float,
        max_len: int = POSITIONS,
    ):
        super().__init__()
        self.dim, self.scale = dim, scale
        self.tgt = nn.Embedding(len(tgt_vocab), dim)
        self.src = self.tgt if share and src_vocab == tgt_vocab else nn.Embedding(len(src_vocab), dim)
        self.generator = nn.Linear(dim, len(tgt_vocab))
        if share:
            self.generator.weight = self.tgt.weight
        self.pos = PositionalEncoding(dim, max_len)
        self.dropout = Dropout(dropout)

    def token(self, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return table(ids) * self.scale

    def embed(self, table: nn.Embedding, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.token(table, ids) + self.pos(pos))


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward sub-layers, pre-norm: ``x + dropout(f(LN(x)))``; node functions
    for update_graph: ``pre`` -> q, k, v and their input h; ``post`` finishes the layer from ``wv``."""

    def __init__(self, heads: int, dim: int, dim_ff: int, dropout: float):
        super().__init__()
        self.attn = MultiHeadAttention(heads, dim)
        self.ff = FeedForward(dim, dim_ff, dropout)
        self.norm_attn, self.norm_ff = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = Dropout(dropout)

    def pre(self, nodes):
        h = self.norm_attn(nodes["x"])
        return {**self.attn.get(h), "h": h}

    def post(self, nodes):
        x = nodes["x"] + self.dropout(self.attn.get_o(nodes["wv"]))
        return {"x": x + self.dropout(self.ff(self.norm_ff(x)))}


class DecoderLayer(nn.Module):
    """Self-attention (dd), cross attention (ed: queries from the decoder, keys/values from the
    normalised encoder output) and feed-forward sub-layers, pre-norm."""

    def __init__(self, heads: int, dim: int, dim_ff: int, dropout: float):
        super().__init__()
        self.self_attn, self.cross_attn = MultiHeadAttention(heads, dim), MultiHeadAttention(heads, dim)
        self.ff = FeedForward(dim, dim_ff, dropout)
        self.norm_self, self.norm_cross, self.norm_ff = (nn.LayerNorm(dim) for _ in range(3))
        self.dropout = Dropout(dropout)

    def pre_self(self, nodes):
        h = self.norm_self(nodes["x"])
        return {**self.self_attn.get(h), "h": h}

    def post_self(self, nodes):
        return {"x": nodes["x"] + self.dropout(self.self_attn.get_o(nodes["wv"]))}

    def pre_query(self, nodes):
        return self.cross_attn.get(self.norm_cross(nodes["x"]), "q")

    def pre_memory(self, nodes):  # encoder output, already normalised
        return self.cross_attn.get(nodes["x"], "kv")

    def post_cross(self, nodes):
        x = nodes["x"] + self.dropout(self.cross_attn.get_o(nodes["wv"]))
        return {"x": x + self.dropout(self.ff(self.norm_ff(x)))}


def _renamed_attention(state_dict, prefix, *args) -> None:
    """Checkpoints written when the attribute was ``backend`` load into ``attention``."""
    for key in [k for k in state_dict if k.startswith(f"{prefix}backend.")]:
        state_dict[f"{prefix}attention.{key[len(prefix) + len('backend.') :]}"] = state_dict.pop(key)


class GraphModel(nn.Module):
    """Base class of model plugins: holds the run's ``Attention`` module (``attention``); ``forward(batch) -> Output``."""

    #: the task forms (``seq2seq``, ``lm``, ``classify``: ``gtx.data.task``) the model serves
    forms: tuple[str, ...] = ("seq2seq",)
    #: a modifier pattern the runner wraps around the chosen one (ACT), or None; see ``modifier``
    dynamic_pattern: str | None = None

    #: plain-torch models ``gtx bench train`` times this one against (``gtx.measure.reference``): ``"torch.nn"``
    #: (nn.Transformer), ``"torch SDPA is_causal"`` and ``"torch SDPA bool mask"`` (a causal LM); the first is the one compared with
    torch_references: tuple[str, ...] = ()
    #: settings ``gtx bench train`` also times as variants of the model: label -> settings (ut: ``[act=false]``)
    bench_variants: dict[str, dict[str, str]] = {}

    @classmethod
    def references(cls, config) -> tuple[str, ...]:
        """The plain-torch references of a model of this config (``torch_references`` by default)."""
        return cls.torch_references

    @classmethod
    def tokenizer(cls, config):
        """The ``gtx.data.vocab.Tokenizer`` a model of this config reads text with (a pretrained
        model's own), or None: the task's vocabulary is the model's. Tasks written in text
        (``Task.text``) then write their examples with it; other tasks are refused."""
        return None

    @classmethod
    def modifier(cls, config) -> str | None:
        """The modifier pattern for a model of this config (models whose halting is a setting
        override this); by default ``dynamic_pattern``."""
        return cls.dynamic_pattern

    def __init__(self, attention):
        super().__init__()
        self.attention = attention  # gtx.attention.Attention: a submodule, so that learned biases train and are saved
        self._register_load_state_dict_pre_hook(_renamed_attention)

    @property
    def backend(self):
        """The name models used before ``attention`` (plugins written then still use it)."""
        return self.attention

    @backend.setter
    def backend(self, value) -> None:
        self.attention = value

    def init_weights(self) -> None:
        """Xavier-uniform for every matrix, as in the DGL tutorial (embeddings too: with the sqrt(d) scale and
        a tied output projection, N(0, 1) embeddings give huge initial logits)."""
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)


def model_forms(model_cls) -> tuple[str, ...]:
    """The task forms a model class serves; seq2seq for a plugin that does not say (models need
    not subclass ``GraphModel``)."""
    return getattr(model_cls, "forms", ("seq2seq",))


class Seq2SeqModel(GraphModel):
    """Base class of encoder-decoder models: ``forward(batch)`` is ``decode(encode(...))``."""

    def encode(self, src, src_pos, graph) -> Encoded:
        raise NotImplementedError

    def decode(self, encoded: Encoded, tgt_in, tgt_pos, graph) -> Output:
        raise NotImplementedError

    def forward(self, batch) -> Output:
        return self.decode(self.encode(batch.src, batch.src_pos, batch.graph), batch.tgt_in, batch.tgt_pos, batch.graph)

    # Incremental decoding (optional): a model that keeps per-token state between decoding steps
    # returns it from ``start_decoding``; ``gtx.model.decode`` then feeds one token per hypothesis per
    # step instead of recomputing the whole prefix. Models returning None are decoded by recomputing.

    def start_decoding(self, encoded: Encoded, pattern):
        """The decoding state for these encoder states (one hypothesis per sample of ``encoded``) under
        ``pattern`` (the run's, as in ``graph.pattern``), or None when the model only decodes by
        recomputing the prefix."""
        return None

    def decode_next(self, state, tokens: torch.Tensor, pos: torch.Tensor, edges: dict):
        """Logits (n, V) for the next token of n hypotheses, given their latest tokens (n,) at
        position ``pos`` (n,), and the updated state. ``edges["dd"]`` holds the latest tokens' edges
        (queries 0..n-1, keys numbered hypothesis * length + position over the prefix);
        ``edges["ed"]`` the same queries over the encoder nodes."""
        raise NotImplementedError

    def reorder_decoding(self, state, origin: torch.Tensor):
        """The state of the hypotheses ``origin`` (n,) (beam search keeps the best continuations).
        This default serves a state dict whose lists ``k`` and ``v`` hold (n, L, H, D) caches
        (``append_keys``); the rest of the state is shared by all hypotheses of a sample."""
        return {**state, "k": [k[origin] for k in state["k"]], "v": [v[origin] for v in state["v"]]}


def append_keys(cache: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Per-hypothesis keys or values of a growing prefix: (n, L, H, D) plus (n, H, D) -> (n, L+1, H, D)."""
    return new[:, None] if cache is None else torch.cat([cache, new[:, None]], 1)
