"""dsa: DeepSeek Sparse Attention (DeepSeek-V3.2-Exp, 2025; the V3.2 report).

A lightning indexer scores every earlier token for each query,
``I(t, s) = sum_j w(t, j) * relu(q(t, j) . k(s))`` (a few heads j of small dimension, one key per
token and the weights from the layer's input, the queries from the attention's queries, part of
each index query and key turned by its position), the top k tokens are kept, and the main
attention runs over them. The indexer learns by KL divergence to the main attention: first a dense stage of ``dense``
optimizer steps (the main attention dense; the model frozen or training, ``freeze``), then sparse training with the KL
restricted to the kept tokens. Its inputs are detached: the main loss never trains it, its KL
never trains the model.

``b > 1`` moves the same method from tokens to blocks of ``b`` positions (the corner of the
granularity x scoring-proxy frame that MiniMax's MSA takes): the indexer scores a block by its mean
index key, each token reads its own block (causally) and the ``k / b - 1`` earlier blocks it scores
highest, on MoBA's per-token block kernel, and the KL targets are the main attention's mass per block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gtx import (
    GtxError,
    KeySelection,
    TokenBlockSelection,
    Trainable,
    attend_selection,
    causal_lens,
    hookimpl,
    parse_pattern,
    selection,
)

# dsa's definition version (results rows and figure tables record it): 1 took the index keys from the attention's keys
# and turned nothing by position; 2 takes index keys and head weights from the layer's input and turns a rope share
DEFINITION = 2
# query rows per block of the dense stage's KL: a block's buffers are a few rows x keys (its scores
# per head, targets, index scores), one block per torch thread at a time, so small blocks keep the
# peak near the model without attention's at long lengths
DENSE_KL_ROWS = 64


@dataclass(frozen=True)
class DSAConfig:
    k: int  # tokens kept per query
    index_heads: int
    index_dim: int
    dense: int  # optimizer steps of the dense stage
    freeze: bool | None  # the model frozen during the dense stage (the report's stage 1); None: the run's start decides
    b: int = 1  # 1: tokens are chosen (DSA); > 1: blocks of b positions (MSA's corner), k / b of them read
    rope: int = 0  # leading index dimensions turned by position (DeepSeek: 64 of 128)
    precision: str = "float32"  # what the choice scores in (``selection.indexer.top_indexed``); the KL stays in float32


class Indexer(nn.Module):
    """The lightning indexer, as DeepSeek-V3.2-Exp's ``Indexer`` in float32 (no FP8 and no Hadamard
    rotation, which leaves dot products as they are): index keys (LayerNorm-ed) and head weights
    from the layer's input, index queries from the attention's queries (gtx's models have no query
    latent); the first ``rope`` dimensions of each index query and key turned by the token's
    position (``gtx.selection.indexer.rotate``), the rest as they are."""

    def __init__(self, query_dim: int, input_dim: int, heads: int, dim: int, rope: int):
        super().__init__()
        self.heads, self.dim, self.rope = heads, dim, rope
        self.wq = nn.Linear(query_dim, heads * dim, bias=False)  # DeepSeek's linears have no bias
        self.wk = nn.Linear(input_dim, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6)
        self.weights = nn.Linear(input_dim, heads, bias=False)
        # the definition a checkpoint's indexer was trained under: its rotated dimensions (see ``_check_definition``)
        self.register_buffer("rotated", torch.tensor(rope))

    def forward(self, queries: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor):
        """(n, query_dim) queries, (n, input_dim) layer inputs, (n,) positions -> index queries
        (n, heads, dim), weights (n, heads), keys (n, dim)."""
        angles = selection.indexer.rotary_angles(positions, self.rope)
        w = self.weights(inputs) * (self.heads**-0.5 * self.dim**-0.5)
        iq = selection.indexer.rotate(self.wq(queries).unflatten(-1, (self.heads, self.dim)), angles)
        return iq, w, selection.indexer.rotate(self.k_norm(self.wk(inputs)), angles)


class SparseIndexed(Trainable):
    """One layer's DSA: its indexer, the top-k choice, the main attention over the kept tokens."""

    def __init__(self, heads: int, head_dim: int, config: DSAConfig):
        super().__init__()
        self.config = config
        self.indexer = Indexer(heads * head_dim, heads * head_dim, config.index_heads, config.index_dim, config.rope)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # steps trained
        # the stage training reached: a checkpoint is evaluated in it, whatever dense stage its evaluation's spec states
        self.register_buffer("sparse", torch.tensor(config.dense == 0))
        self._register_load_state_dict_pre_hook(_check_definition, with_module=True)

    def forward(self, q, k, v, edges, run):
        c = self.config
        lens = causal_lens(run.spec, edges)
        x = run.inputs
        if x is None or tuple(x.shape) != (len(q), self.indexer.wk.in_features):
            got = "none" if x is None else f"{tuple(x.shape)}"
            raise GtxError(
                f"pattern {run.spec!r} reads the layer's input for its index keys, {len(q)} x {self.indexer.wk.in_features} here, "
                f"and got {got}: call the attention with inputs= (gtx's models do; gtx.Run.inputs)"
            )
        sparse = run.step >= c.dense if run.training else bool(self.sparse)
        if run.training:  # the steps trained with this one, and the stage the next one (or an evaluation) runs in
            self.steps.fill_(run.step + 1)
            self.sparse.fill_(run.step + 1 >= c.dense)
        # the indexer's input: detached
        iq, w, ik = self.indexer(q.detach().flatten(1), x.detach(), positions_of(lens, q.device))
        blocks = BlockIndex(ik, lens, c.b) if c.b > 1 else None
        if not sparse:
            run.kept("dense", edges.num_edges, edges.n_dst)
            if not run.training:
                return run.attend(q, k, v, edges)
            out, lse = run.attend_lse(q, k, v, edges)  # the fused kernel's log-sum-exp: the KL's target in one pass
            run.loss("indexer_kl_dense", self.dense_kl(q, k, lse, iq, w, ik, lens, blocks))
            if self.freeze:
                run.freeze_model()
            return out
        if blocks is not None:
            with torch.no_grad():
                sel = blocks.top(iq, w, c.k // c.b - 1, q.shape[1], c.precision)
            out, mass = attend_selection(q, k, v, edges, sel, weights=True)
            if run.training:
                run.loss("indexer_kl_sparse", blocks.sparse_kl(mass, iq, w, sel))
            run.kept("selected", sel.per_query(), edges.n_dst)
            return out
        with torch.no_grad():
            keys, valid = selection.indexer.top_indexed(iq, w, ik, edges, c.k, c.precision)
        # one choice for all heads: a group of them all, each key's heads read as one span
        out, p = attend_selection(
            q, k, v, edges, KeySelection(keys[:, None], valid[:, None], group=q.shape[1]), weights=True
        )
        if run.training:
            run.loss("indexer_kl_sparse", self.sparse_kl(p, iq, w, ik, keys, valid))
        run.kept("selected", valid.sum(-1), edges.n_dst)
        return out

    @property
    def freeze(self) -> bool:
        """Whether the model is frozen in the dense stage: ``freeze`` as given, else whether the run starts trained."""
        return self.from_trained if self.config.freeze is None else self.config.freeze

    def describe(self) -> str:
        why = "given" if self.config.freeze is not None else "a trained start" if self.from_trained else "from scratch"
        return (
            f"{'sparse' if bool(self.sparse) else 'dense'} stage, indexer trained {int(self.steps)} steps, "
            f"freeze={str(self.freeze).lower()} ({why})"
        )

    def dense_kl(self, q, k, lse, iq, w, ik, lens, blocks: BlockIndex | None = None) -> torch.Tensor:
        """The dense stage's KL: the main attention's distribution averaged over heads against the
        indexer's softmax over every candidate, per query, averaged (``selection.indexer.dense_index_kl``; ``lse``: the main
        attention's log-sum-exp per query and head, or None); with ``blocks``, both as masses per block
        (a query's own block and those before it)."""
        keys, size = (ik, 1) if blocks is None else (blocks.keys, blocks.size)
        return selection.indexer.dense_index_kl(q, k, lse, iq, w, keys, lens, DENSE_KL_ROWS, size) / q.shape[0]

    def sparse_kl(self, p, iq, w, ik, keys, valid) -> torch.Tensor:
        """After the dense stage: the main attention over the kept tokens (averaged over heads) against
        the indexer's softmax over the same tokens, per query, averaged."""
        return selection.indexer.index_kl(p, iq, w, ik, keys, valid) / len(keys)


def positions_of(lens: list[int], device) -> torch.Tensor:
    """Each token's position in its sample, for samples of ``lens`` tokens packed in a row."""
    starts = torch.cumsum(torch.as_tensor([0, *lens[:-1]], device=device), 0)
    return torch.arange(sum(lens), device=device) - torch.repeat_interleave(
        starts, torch.as_tensor(lens, device=device)
    )


def _check_definition(module, state_dict, prefix, *args) -> None:
    """A checkpoint's indexer must have been trained under this definition: its index keys from the
    layer's input and the same rotated dimensions; else one line, before any weight is copied."""
    key, rotated = f"{prefix}indexer.rotated", module.config.rope
    if f"{prefix}indexer.wk.weight" not in state_dict or (key in state_dict and int(state_dict[key]) == rotated):
        return
    was = (
        f"under definition {DEFINITION - 1} (index keys from the attention's keys, nothing turned by position)"
        if key not in state_dict
        else f"turning {int(state_dict[key])} index dimensions by position"
    )
    raise GtxError(
        f"the checkpoint's dsa indexer ({prefix}indexer) was trained {was}; this pattern's (definition {DEFINITION}) reads "
        "the layer's input and turns "
        f"{rotated} of {module.config.index_dim}: its choices would mean something else; train under this pattern, or evaluate "
        "the checkpoint under one without an indexer"
    )


class BlockIndex:
    """The indexer over blocks of ``size`` positions (``dsa:b``): a block's index key is the mean of
    its tokens' (``keys``: (B, n_blocks, index_dim) per sample of ``lens``), its score for a query
    I(t, block) = sum_j w(t, j) relu(q(t, j) . mean key)."""

    def __init__(self, ik: torch.Tensor, lens: list[int], size: int):
        self.size, self.lens = size, lens
        self.keys = selection.block_means(ik[:, None], lens, size)[:, 0]
        self.length = self.keys.shape[1] * size

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) rows of the samples -> (B, n_blocks * size, ...), zero-padded."""
        return (
            selection.pad_samples(x[..., None], self.lens, self.length)[..., 0]
            if x.dim() == 2
            else selection.pad_samples(x, self.lens, self.length)
        )

    def after(self, hidden: torch.Tensor) -> torch.Tensor:
        """A (rows, keys) mask of keys after each query -> the same per block (a block after the query's own)."""
        return hidden[:, :: self.size]

    def top(self, iq, w, count: int, heads: int, precision: str = "float32") -> TokenBlockSelection:
        """Per token, the ``count`` earlier blocks with the highest index score (its own it reads anyway),
        one choice shared by all ``heads`` (a selection of one row, group=heads); scored a block of
        query rows at a time, never n x n."""
        size, lens = self.size, self.lens
        iqp, wp = self.pad(iq), self.pad(w)
        n_blocks = self.keys.shape[1]
        blocks = torch.zeros(len(lens), self.length, count, dtype=torch.long, device=iq.device)
        valid = torch.zeros(len(lens), self.length, count, dtype=torch.bool, device=iq.device)
        later = (
            torch.arange(n_blocks, device=iq.device)[None, :]
            >= (torch.arange(self.length, device=iq.device) // size)[:, None]
        )
        for i, n in enumerate(lens):
            for r0 in range(0, n, selection.indexer.ROWS):
                r = slice(r0, min(r0 + selection.indexer.ROWS, n))
                score = selection.choice.int8_scores if precision == "int8" else selection.indexer.index_scores
                values, indices = selection.top_later_first(
                    score(iqp[i, r], wp[i, r], self.keys[i]).masked_fill(later[r], float("-inf")), count
                )
                blocks[i, r, : indices.shape[-1]] = indices
                valid[i, r, : indices.shape[-1]] = values > float("-inf")
        blocks, valid = (selection.unpad_samples(x, lens)[:, None] for x in (blocks.masked_fill(~valid, 0), valid))
        return TokenBlockSelection(size, list(lens), blocks, valid, heads)

    def sparse_kl(self, mass: torch.Tensor, iq, w, sel: TokenBlockSelection) -> torch.Tensor:
        """After the dense stage: the main attention's mass on each block a token reads (``mass``: its own
        block first, then the chosen ones, averaged over heads, as ``attend_selection`` gives it)
        against the indexer's softmax over the same blocks, per query, averaged."""
        n_blocks = self.keys.shape[1]
        sample = torch.repeat_interleave(
            torch.arange(len(self.lens), device=iq.device), torch.as_tensor(self.lens, device=iq.device)
        )
        pos = torch.cat([torch.arange(n, device=iq.device) for n in self.lens])
        # (n, 1 + K) rows of keys
        idx = sample[:, None] * n_blocks + torch.cat([(pos // self.size)[:, None], sel.blocks[:, 0]], 1)
        read = torch.cat([torch.ones_like(sel.valid[:, :1, 0]), sel.valid[:, 0]], 1)
        keys = self.keys.reshape(-1, self.keys.shape[-1])
        total = iq.new_zeros(())
        for r0 in range(0, len(idx), selection.indexer.ROWS):
            r = slice(r0, r0 + selection.indexer.ROWS)
            total = total + checkpoint(_block_kl, mass[r], iq[r], w[r], keys, idx[r], read[r], use_reentrant=False)
        return total / len(idx)


def _block_kl(p, iq, w, keys, idx, read):
    return selection.indexer.kl_to(p, selection.indexer.index_scores(iq, w, keys[idx]), read)


def dsa(
    k: int = 256,
    index_heads: int = 2,
    index_dim: int = 32,
    rope: float = 0.5,
    dense: int = 100,
    freeze: str = "auto",
    b: int = 1,
    index_precision: str = "float32",
):
    """DSA: per query the k earlier tokens a lightning indexer scores highest (itself included);
    with b > 1, the k / b blocks of b positions (its own and the best earlier ones: MSA's corner).

    Note:
        Decoder self-attention (``dd``) of whole causal sequences; other stages keep full
        attention. Budget: k keys per query (queries with fewer earlier tokens keep all). The
        indexer has ``index_heads`` heads of ``index_dim`` dimensions, as DeepSeek's: index keys
        and head weights from the layer's input, the leading ``rope`` share of each index query's
        and key's dimensions turned by position (DeepSeek's angles; it turns 64 of 128); index
        queries from the layer's attention queries, where DeepSeek's read its query latent,
        which gtx's models do not have. Two stages: for the first ``dense`` optimizer steps
        attention is dense and the indexer is fitted by KL to it (``dense=0``: sparse from the
        first step); after, attention is sparse and the KL covers the kept tokens. ``freeze``:
        whether the model is frozen in the dense stage (the indexer trains alone). ``auto``
        follows the run: frozen when it starts from a trained model (a pretrained folder,
        ``--set path=DIR``, as DeepSeek adapts a trained model; a resumed run keeps its start's),
        training from scratch (a frozen random model would learn nothing); ``true`` or ``false``
        decides. The run records the value it ran with in the trained attention's state
        (``attention_stage`` in each results row's metrics, the state its phase left it in; the note a
        dense stage prints). Results:
        ``indexer_kl_dense``, ``indexer_kl_sparse``, ``kept_selected`` (keys per query).
        DeepSeek-V3.2 keeps 2048 of up to 128k tokens with 64 indexer heads of 128. ``b > 1``:
        blocks scored by their mean index key, read on MoBA's per-token block kernel, the KL over
        block masses; k a multiple of b, at least 2b. ``index_precision=int8``: the choice ranks
        by scores of index queries and keys quantised per token to int8 (symmetric, a float scale
        each), as DeepSeek's indexer runs in FP8; on the CPU on int8 dot products (VNNI where the
        CPU has it); the KL losses stay in float32. ``warmup``, the dense stage's earlier name,
        is refused with the new one.

    Checked:
        ``tests/test_dsa.py::test_the_indexer_scores_equal_deepseeks_indexer_with_its_rotary_angles``: index
        scores against DeepSeek's ``Indexer`` written out in float64 at rtol 1e-5 (atol 1e-5 of the largest
        score); ``test_dsa_equals_its_definition_indexer_choice_values_gradients_and_kl``: the choice (as a top
        set), the output at atol and rtol 1e-5, the q, k, v gradients at atol 2e-5 and rtol 1e-5, the sparse KL
        at atol and rtol 1e-5 and its indexer gradients at atol 1e-5 and rtol 1e-4, against DSA written out in
        float64;
        ``test_the_dense_stage_is_dense_fits_the_indexer_to_the_dense_attention_and_freezes_the_model``: the
        dense stage's output and KL at torch's float32 tolerance (atol 1e-5, rtol 1.3e-6);
        ``test_blocks_chosen_by_the_indexer_equal_their_definition``: ``b > 1`` at the tolerances of tokens.
    """
    if k < 1:
        raise ValueError(f"k={k}: dsa keeps k >= 1 tokens per query")
    if index_heads < 1 or index_dim < 1 or dense < 0:
        raise ValueError(f"need index_heads >= 1, index_dim >= 1, dense >= 0; got {index_heads}, {index_dim}, {dense}")
    if freeze not in FREEZE:
        raise ValueError(
            f"freeze={freeze}: write freeze=auto (frozen in the dense stage when the run starts from a trained model), "
            "freeze=true or freeze=false"
        )
    if b < 1 or (b > 1 and (k % b or k < 2 * b)):
        raise ValueError(
            f"b={b}, k={k}: blocks of b >= 1 positions; with b > 1, k (keys read) must be a multiple of b and at least 2b "
            f"(the own block and one chosen), e.g. k={2 * max(b, 1)}"
        )
    turned = round(rope * index_dim)
    if not 0 <= rope <= 1 or abs(rope * index_dim - turned) > 1e-4 or turned % 2:
        raise ValueError(
            f"rope={rope} of index_dim={index_dim}: the share of index dimensions turned by position, in [0, 1], must turn an "
            f"even number of them (pairs), e.g. rope={2 * (index_dim // 4) / index_dim:g} ({2 * (index_dim // 4)} of {index_dim})"
        )
    if index_precision not in selection.choice.PRECISIONS:
        raise ValueError(f"index_precision={index_precision}: one of {', '.join(selection.choice.PRECISIONS)}")
    config = DSAConfig(k, index_heads, index_dim, dense, FREEZE[freeze], b, turned, index_precision)
    return replace(
        parse_pattern("full"), trainable=lambda heads, head_dim: SparseIndexed(heads, head_dim, config), budget=k
    )


dsa.renamed = {"warmup": "dense"}  # the learning rate's warm-up is --set warmup: the dense stage has a name of its own
# ``freeze``'s spellings: one each, so that the canonical spec names an experiment once
FREEZE = {"auto": None, "true": True, "false": False}


@hookimpl
def register_patterns(register):
    register("dsa", dsa, definition=DEFINITION)
