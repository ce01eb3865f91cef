"""Plain-torch references: gtx's models as a user would write them without gtx, over padded batches.

- ``TorchLM``: the ``lm`` model (not universal) with attention by
  ``F.scaled_dot_product_attention`` on (B, H, n, D): ``is_causal=True`` (the best kernel plain
  torch has for causal attention) or a boolean mask built from a pattern's ``dd`` edges (what a
  plain-torch user writes for a sparse pattern).
- ``TorchTransformer``: the ``transformer`` model as ``torch.nn.Transformer`` with padding masks.

Both read a gtx ``Batch`` and return ``Output`` logits (len(batch.targets), V) flat over samples,
so ``gtx.run.train.Trainer`` trains them with the same optimiser, schedule, loss and clipping as the
gtx models. Padding is built inside ``forward`` and counts as the reference's cost.

``TrainCell`` describes one row of ``gtx bench train`` (a gtx backend, the bound or a reference)
so that a fresh process builds it again: ``python -m gtx.measure.reference JSON`` measures its memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from gtx.backends import Backend, repeat_kv
from gtx.data.batch import batches, make_batch
from gtx.graph.pattern import Pattern
from gtx.graph.spec import forget_parsed, parse_pattern
from gtx.memory import peak_mb, reset_peak
from gtx.model.layers import Dropout, FeedForward, Output, PositionalEncoding

SDPA_CAUSAL, SDPA_MASK, TORCH_TRANSFORMER = "torch SDPA is_causal", "torch SDPA bool mask", "torch.nn"
COMPLETE = ("full", "causal")  # patterns whose dd mask is the causal one: is_causal covers them


def references(model_cls, model_config, specs: list[str]) -> list[tuple[str, str]]:
    """The plain-torch reference rows of a model (the kinds its class declares, ``references``) under
    the patterns ``specs``: (reference, pattern spec) pairs, the first the one every row is compared
    with (``vs_reference``); [] where there is none."""
    rows = []
    for kind in getattr(model_cls, "references", lambda config: ())(model_config):
        if kind == TORCH_TRANSFORMER:
            rows.append((kind, "full"))
        elif kind == SDPA_CAUSAL:
            rows.append((kind, "causal"))
        elif kind == SDPA_MASK:  # a mask stands for fixed patterns only: a selecting or biased one has no single mask
            rows += [(kind, s) for s in specs if s not in COMPLETE and parse_pattern(s).plain]
        else:
            raise ValueError(
                f"unknown reference {kind!r}; references are {SDPA_CAUSAL!r}, {SDPA_MASK!r}, {TORCH_TRANSFORMER!r}"
            )
    return rows


def reference_model(kind: str, model_config, task, pattern: str) -> nn.Module:
    """The reference ``kind`` (``references``) with the sizes of ``model_config``, for ``task``'s
    vocabularies; ``pattern`` is the spec whose edges make the bool mask (``SDPA_MASK``)."""
    c = model_config
    if kind == TORCH_TRANSFORMER:
        return TorchTransformer(len(task.src_vocab), len(task.tgt_vocab), c.layers, c.heads, c.dim, c.dim_ff, c.dropout)
    if kind in (SDPA_CAUSAL, SDPA_MASK):
        return TorchLM(
            len(task.src_vocab),
            c.layers,
            c.heads,
            c.dim,
            c.dim_ff,
            c.dropout,
            c.max_len,
            c.embed_scale,
            parse_pattern(pattern) if kind == SDPA_MASK else None,
        )
    raise ValueError(
        f"unknown reference {kind!r}; references are {SDPA_CAUSAL!r}, {SDPA_MASK!r}, {TORCH_TRANSFORMER!r}"
    )


def _padded_ids(flat: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Flat ids (sum(lens),) -> (B, max(lens)), right-padded with 0 (a view when no sample is short)."""
    n = max(lens)
    return flat.view(len(lens), n) if min(lens) == n else pad_sequence(list(torch.split(flat, lens)), batch_first=True)


def _unpadded(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """(B, n, d) -> (sum(lens), d): the rows of real tokens, sample by sample (gtx's flat order)."""
    if min(lens) == x.shape[1]:
        return x.reshape(-1, x.shape[-1])
    return x[torch.arange(x.shape[1], device=x.device)[None] < torch.tensor(lens, device=x.device)[:, None]]


class _Embed(nn.Module):
    """Token table (times ``scale``, plus sinusoidal positions) tied to the output projection; the
    attribute names are gtx's ``Embeddings``' so that state dicts load across."""

    def __init__(self, vocab: int, dim: int, max_len: int):
        super().__init__()
        self.tgt, self.generator = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.generator.weight = self.tgt.weight
        self.pos = PositionalEncoding(dim, max_len)


class _Layer(nn.Module):
    """Pre-norm self-attention and feed-forward over (B, n, dim): gtx's ``EncoderLayer`` with
    attention by SDPA (names as there, so that its weights load across)."""

    def __init__(self, heads: int, dim: int, dim_ff: int, dropout: float):
        super().__init__()
        if dim % heads:
            raise ValueError(f"d_model={dim} must be divisible by heads={heads}")
        self.heads = heads
        self.attn = nn.Module()
        self.attn.q, self.attn.k, self.attn.v, self.attn.o = (nn.Linear(dim, dim) for _ in range(4))
        self.ff = FeedForward(dim, dim_ff, dropout)
        self.norm_attn, self.norm_ff = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, dim = x.shape
        h = self.norm_attn(x)
        q, k, v = (
            f(h).view(b, n, self.heads, dim // self.heads).transpose(1, 2)
            for f in (self.attn.q, self.attn.k, self.attn.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # scale 1/sqrt(D), as gtx
        x = x + self.dropout(self.attn.o(a.transpose(1, 2).reshape(b, n, dim)))
        return x + self.dropout(self.ff(self.norm_ff(x)))


class TorchLM(nn.Module):
    """gtx's ``lm`` in plain torch: pre-norm layers, sinusoidal positions, embeddings times
    ``embed_scale``, a final LayerNorm and the output projection tied to the embedding. Attention
    is causal (``mask_pattern`` None: SDPA ``is_causal``) or the ``dd`` edges of ``mask_pattern``
    as a bool mask: (n, n) when a batch's samples share one length, else (B, 1, n, n).

    Dropout is gtx's ``Dropout`` (a cheaper CPU mask than ``torch.dropout``'s) so that
    this model and gtx's differ in attention alone. Parameter names are gtx's: a ``lm`` state dict
    without ``embed.src.weight`` (the same tensor as ``embed.tgt.weight``) loads into it."""

    def __init__(
        self,
        vocab: int,
        layers: int,
        heads: int,
        dim: int,
        dim_ff: int,
        dropout: float,
        max_len: int,
        embed_scale: float,
        mask_pattern: Pattern | None = None,
    ):
        super().__init__()
        self.scale, self.mask_pattern = embed_scale, mask_pattern
        self.embed = _Embed(vocab, dim, max_len)
        self.layers = nn.ModuleList(_Layer(heads, dim, dim_ff, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.dropout = Dropout(dropout)
        self._mask_for: tuple | None = None
        for p in self.parameters():  # gtx's init_weights
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def mask(self, lens: list[int], device: torch.device) -> torch.Tensor:
        """The bool mask (row = query, column = key) of samples of ``lens``; kept while the lengths
        repeat, as a user would build it once. A padded query sees itself alone: an all-False row
        would make NaN, and NaN values of padding reach real queries through 0 * NaN."""
        if self._mask_for != (tuple(lens), device):
            n, one = max(lens), len(set(lens)) == 1
            mask = torch.zeros(1 if one else len(lens), n, n, dtype=torch.bool)
            for b, m in enumerate(lens[:1] if one else lens):
                src, dst = self.mask_pattern.edges("dd", m, m)
                mask[b, dst, src] = True
                mask[b, range(m, n), range(m, n)] = True
            self._mask, self._mask_for = (mask[0] if one else mask[:, None]).to(device), (tuple(lens), device)
        return self._mask

    def forward(self, batch) -> Output:
        lens = batch.graph.tgt_lens.tolist()
        ids = _padded_ids(batch.tgt_in, lens)
        x = self.dropout(
            self.embed.tgt(ids) * self.scale + self.embed.pos(torch.arange(ids.shape[1], device=ids.device))
        )
        mask = None if self.mask_pattern is None else self.mask(lens, ids.device)
        for layer in self.layers:
            x = layer(x, mask)
        return Output(self.embed.generator(self.norm(_unpadded(x, lens))))


class TorchTransformer(nn.Module):
    """gtx's ``transformer`` as torch.nn.Transformer over padded batches with masks: the same
    sizes, pre-norm, embeddings + sinusoidal positions and a tied output projection."""

    def __init__(self, vocab_src: int, vocab_tgt: int, layers: int, heads: int, dim: int, dim_ff: int, dropout: float):
        super().__init__()
        self.src, self.tgt = nn.Embedding(vocab_src, dim), nn.Embedding(vocab_tgt, dim)
        self.pos = PositionalEncoding(dim)
        with warnings.catch_warnings():  # "enable_nested_tensor ... norm_first": nested tensors need post-norm
            warnings.simplefilter("ignore", UserWarning)
            self.net = nn.Transformer(dim, heads, layers, layers, dim_ff, dropout, batch_first=True, norm_first=True)
        self.out = nn.Linear(dim, vocab_tgt)
        self.out.weight = self.tgt.weight

    def forward(self, batch) -> Output:
        src_lens, tgt_lens = batch.graph.src_lens.tolist(), batch.graph.tgt_lens.tolist()
        src, tgt = _padded_ids(batch.src, src_lens), _padded_ids(batch.tgt_in, tgt_lens)
        src_pad, tgt_pad = (
            torch.arange(t.shape[1], device=t.device)[None] >= torch.tensor(lens, device=t.device)[:, None]
            for t, lens in ((src, src_lens), (tgt, tgt_lens))
        )
        n = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=tgt.device, dtype=torch.bool)
        pos_s, pos_t = torch.arange(src.shape[1], device=src.device), torch.arange(n, device=tgt.device)
        h = self.net(
            self.src(src) + self.pos(pos_s),
            self.tgt(tgt) + self.pos(pos_t),
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
        return Output(self.out(_unpadded(h, tgt_lens)))


class SkipAttention(Backend):
    """Not a registered backend: an O(n) stand-in for attention that still sends gradients to q, k
    and v, so that a training step keeps every other cost. Its tokens/s bound what any attention
    backend can reach in that model: the step with attention at zero cost."""

    name = "(no attention)"
    grouped_kv = True  # grouped-query k and v read as they come: the ceiling makes no copy a kernel need not

    def __call__(self, q, k, v, edges):
        heads = q.shape[1]
        k_mean, v_mean = (repeat_kv(x.mean(0, keepdim=True), heads)[0] for x in (k, v))
        return v_mean + q.sum(-1, keepdim=True) + k_mean.sum(-1, keepdim=True)  # (n_dst, H, Dv)


# The rows of ``gtx bench train`` (``gtx.measure.bench.bench_train``) as cells a fresh process builds again.

NO_EDGES = "local:w=0"  # the graphs of steps that read no edges (bound, references): one edge per query


@dataclass
class TrainCell:
    """One row of ``bench_train`` in JSON terms, so that a fresh process builds it again (the memory
    pass). ``backend``: a gtx backend, ``SkipAttention.name`` (the bound) or a reference
    (``references``); ``pattern``: the spec its attention follows; ``settings``: model, task and
    train settings as ``--set`` strings."""

    task: str
    model: str
    pattern: str
    backend: str
    settings: dict
    device: str = "cpu"
    plugins_dirs: tuple[str, ...] = ()

    @property
    def gtx(self) -> bool:
        """Attention by a gtx backend over the pattern's edges (else the step reads no edges)."""
        return self.backend not in (SkipAttention.name, SDPA_CAUSAL, SDPA_MASK, TORCH_TRANSFORMER)

    def resolve(self):
        """The cell's ``Resolved`` run; its batches are built under NO_EDGES where the step reads no edges."""
        from gtx.run.runner import DEFAULT_BACKEND, RunConfig, resolve

        pattern, backend = (self.pattern, self.backend) if self.gtx else (NO_EDGES, DEFAULT_BACKEND)
        return resolve(
            RunConfig(
                task=self.task,
                model=self.model,
                pattern=pattern,
                backend=backend,
                device=self.device,
                settings=self.settings,
            )
        )

    def build(self, resolved):
        """(``Trainer`` of the cell's model for the resolved run ``resolved``, its attention backend or None), seeded alike."""
        from gtx.run.build import build_attention
        from gtx.run.train import Trainer

        torch.manual_seed(0)
        be = None
        if self.gtx or self.backend == SkipAttention.name:
            attention = build_attention(resolved) if self.gtx else SkipAttention()
            be = attention.backend if self.gtx else attention
            net = resolved.model_cls(resolved.model_config, resolved.task.src_vocab, resolved.task.tgt_vocab, attention)
        else:
            net = reference_model(self.backend, resolved.model_config, resolved.task, self.pattern)
        return Trainer(
            net.to(resolved.device), resolved.train, getattr(resolved.model_config, "dim", 128), resolved.device
        ), be


def first_batches(resolved, n: int) -> list:
    """The first n training batches of the resolved run ``resolved`` (the split again and again where it
    holds fewer), graphs under NO_EDGES: each variant builds them again under its own pattern."""
    cheap = parse_pattern(NO_EDGES)
    epochs = (
        b
        for epoch in range(n)
        for b in batches(resolved.task, "train", cheap, resolved.train.batch_size, shuffle_seed=epoch)
    )
    return [b for _, b in zip(range(n), epochs)]


def train_cell_memory(cell: TrainCell, steps: int = 3) -> float:
    """Peak memory (MB) of building the cell's model and training it ``steps`` steps on the first
    batches, in this (fresh) process, after one step of a model thrown away: imports, code pages and
    set-ups made once per process are not the variant's: the growth of ``gtx.memory.peak_mb`` over
    the baseline ``reset_peak`` gives before the build."""
    from gtx.plugins.registry import load_plugins

    load_plugins(dirs=cell.plugins_dirs)
    resolved = cell.resolve()
    data = first_batches(resolved, steps)
    trainer, _ = cell.build(resolved)
    trainer.train_epoch([make_batch(resolved.task, data[0].split, data[0].index, resolved.pattern_run)])
    del trainer
    for pattern in (resolved.pattern_run, resolved.pattern_given, parse_pattern(cell.pattern)):
        pattern._cache.clear()  # cached edges are the variant's memory: its steps build them again
    forget_parsed()  # and so are those of patterns it makes for itself (nsa's window)
    base = reset_peak(resolved.device)
    trainer, _ = cell.build(resolved)
    for b in data:
        trainer.train_epoch([make_batch(resolved.task, b.split, b.index, resolved.pattern_run)])
    return peak_mb(resolved.device) - base


def memory_in_subprocess(cell: TrainCell, steps: int = 3, timeout_s: float = 900) -> tuple[float, str]:
    """(``train_cell_memory`` in MB, "") of the cell in a fresh process (``python -m gtx.measure.reference``), or (NaN, why not)."""
    payload = json.dumps({"cell": dataclasses.asdict(cell), "steps": steps})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gtx.measure.reference", payload],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    except subprocess.TimeoutExpired:
        return float("nan"), f"timed out after {timeout_s}s"
    if proc.returncode:
        return float("nan"), (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mem_mb"], ""


if __name__ == "__main__":  # python -m gtx.measure.reference '{"cell": {...}, "steps": n}': one cell's memory, as JSON
    args = json.loads(sys.argv[1])
    print(
        json.dumps(
            {
                "peak_mem_mb": train_cell_memory(
                    TrainCell(**{**args["cell"], "plugins_dirs": tuple(args["cell"]["plugins_dirs"])}), args["steps"]
                )
            }
        )
    )
