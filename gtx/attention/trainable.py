"""Attention with parameters of its own: the extension point for trainable sparse attention.

A pattern that sets ``trainable`` (``gtx.graph.pattern.Pattern``) brings a ``Trainable`` module.
Every model gets it through the ``Attention`` it receives: built once per layer that calls
``Attention.for_layer()`` (the built-in models do; a model that attends with its one ``Attention``
shares one module across its layers), trained and checkpointed with the model::

    class Gated(Trainable):
        def __init__(self, heads, head_dim):           # what the factory receives
            super().__init__()
            self.gate = torch.nn.Linear(head_dim, 1)

        def forward(self, q, k, v, edges, run):         # (n, H, D) each, q pre-scaled; -> (n, H, Dv)
            out = run.attend(q, k, v, edges)            # the run's backend over any edge set
            run.kept("all", edges.num_edges, edges.n_dst)   # keys read, for the results
            return out * torch.sigmoid(self.gate(q))

It runs on the stages in ``stages`` (default: decoder self-attention, ``dd``); on the others the
pattern's candidate edges go to the backend. ``edges`` are the candidates of whole causal
sequences (``edges.root.structure == "causal"``; decoding recomputes the prefix for such
patterns); an ACT step's subset (``edges.keep``) is applied to the output by the caller.
``run.inputs`` is the layer's input on a self-attention stage, (n, width): the states q, k and v
were projected from (after the layer's normalisation), given by the model (gtx's models and ``hf``
do; None where a caller gives only q, k and v). DSA's indexer reads its index keys there.
``run.loss(name, value)`` adds an auxiliary loss to the training loss (DSA's indexer KL);
``run.freeze_model()`` makes this step train the auxiliary losses alone (a stage with the model
frozen, as DSA's dense one). ``self.from_trained`` says whether the run starts from a trained model
(``starts_trained``), set by the ``Attention`` that builds the module, before its first call. Losses and kept edges are averaged into each results row's ``metrics``. The stage's keys
per query (``gtx.attention.budget``) are the branches' kept edges summed, or, where branches may
read one key twice, what ``run.read`` gives: each query's keys counted once.
"""

from __future__ import annotations

import torch

from gtx.errors import GtxError
from gtx.graph.tokens import EdgeSet


class Trainable(torch.nn.Module):
    """Base class of a pattern's trainable attention; see the module docstring for the contract."""

    stages: tuple[str, ...] = ("dd",)
    from_trained: bool = False  # the run starts from a trained model (``starts_trained``); set by ``Attention``

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edges: EdgeSet, run: Run) -> torch.Tensor:
        raise NotImplementedError

    def budget_text(self, n: int) -> str | None:
        """The keys a query reads at most in a sequence of ``n`` tokens, in words, where the parameters
        fix it (``gtx plot pattern`` states it); None: the pattern's ``budget`` says it, or nothing fixes it."""
        return None

    def check_length(self, n: int) -> str | None:
        """Why this attention should not run on sequences of ``n`` tokens (its cost would follow a
        parameter rather than the sequence), in words naming the fix; None when it can."""
        return None

    def describe(self) -> str | None:
        """The stage this module attends in and what it runs with there, for a method that has stages
        (DSA's dense stage and its ``freeze``), else None."""
        return None


def stages_of(model: torch.nn.Module) -> str | None:
    """What a model's trainable attention runs as (``Trainable.describe``), its layers' distinct answers joined; None without any."""
    seen = dict.fromkeys(m.describe() for m in model.modules() if isinstance(m, Trainable))
    seen.pop(None, None)
    return "; ".join(seen) or None


def starts_trained(model_config) -> bool:
    """Whether a model of this configuration starts from trained weights: a pretrained folder (the
    model setting ``path``, as ``hf``'s). A resumed run is configured as its start was, so it keeps the answer."""
    return bool(getattr(model_config, "path", ""))


def check_untrained(pattern, model_config, doing: str) -> None:
    """A pattern with parameters of its own on a pretrained model (a ``path`` setting) that will not
    train them: one line, unless the model setting ``untrained_attention`` asks for them untrained."""
    path = getattr(model_config, "path", "")
    if getattr(pattern, "trainable", None) is None or not starts_trained(model_config):
        return
    if getattr(model_config, "untrained_attention", False):
        return
    raise GtxError(
        f"pattern {pattern.spec!r} attends with parameters of its own that the pretrained folder {path} lacks; {doing} would "
        "run them as initialised: train them (--epochs 1 or more), or set untrained_attention=true to score them untrained"
    )


class Run:
    """What a ``Trainable`` sees of the run: the backend, the optimizer step, and where its losses
    and kept edges go. Made by ``Attention`` for one call."""

    def __init__(self, owner, spec: str, inputs: torch.Tensor | None = None):
        self._owner, self.spec, self.inputs = owner, spec, inputs
        self.edges = 0.0  # edges one head attended over in this call, summed over the branches (``kept``): its work
        self.branches: list = []  # each ``kept`` call's edges: a number, or per query (n_dst,)
        self.reads = None  # ``read``'s (keys, offered), when given

    @property
    def step(self) -> int:
        """Optimizer steps taken before the latest training forward (``Attention.begin_step``)."""
        return self._owner.step

    @property
    def training(self) -> bool:
        """Whether this forward trains (module in training mode, gradients on)."""
        return self._owner.training and torch.is_grad_enabled()

    def attend(self, q, k, v, edges: EdgeSet) -> torch.Tensor:
        """Softmax attention over ``edges`` on the run's backend (q pre-scaled, (n, H, D))."""
        return self._owner.backend(q, k, v, edges)

    def attend_lse(self, q, k, v, edges: EdgeSet) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attend``, and each query's log-sum-exp of its scores per head, (n_dst, H), without
        gradient, where the backend's kernel computes it anyway (``Backend.with_lse``); else None."""
        return self._owner.backend.with_lse(q, k, v, edges)

    def loss(self, name: str, value: torch.Tensor) -> None:
        """An auxiliary loss: added to the training loss when training; its mean is recorded."""
        if value.dim() != 0 or not value.is_floating_point():
            raise GtxError(
                f"pattern {self.spec!r} reported loss {name!r} as {tuple(value.shape)} {value.dtype}; expected a floating scalar"
            )
        if self.training:
            self._owner.pending.append(value)
        self._owner.record(name, float(value.detach()), 1)

    def kept(self, branch: str, edges, queries: int) -> None:
        """``edges`` one head attended over in ``branch``, summed over ``queries`` queries, or per
        query ((n_dst,), the mean over heads): the results' ``kept_<branch>`` is per query; the sum
        over branches is the call's work, and its keys read unless ``read`` says otherwise. Per
        query, an ACT step's inactive queries are left out of the keys read."""
        total = float(edges.sum()) if isinstance(edges, torch.Tensor) else float(edges)
        self.edges += total
        self.branches.append(edges)
        self._owner.record(f"kept_{branch}", total, queries)

    def read(self, keys, offered=0.0) -> None:
        """The keys one head read in this call, each counted once across branches: per query
        ((n_dst,), the mean over heads) or summed over the queries. ``offered``: keys the method
        makes available beyond the stage's tokens (NSA's compressed keys), per query or summed: they
        count in what the stage allows, so density stays the share of what the queries could read."""
        self.reads = (keys, offered)

    def freeze_model(self) -> None:
        """This training step optimises the auxiliary losses alone: the model's loss is left out."""
        if self.training:
            self._owner.frozen = True


def causal_lens(spec: str, edges: EdgeSet) -> list[int]:
    """The sample lengths of causal candidates over whole sequences; a clear error for anything else."""
    root = edges.root
    lens = list(root.q_lens) if root.q_lens is not None else [root.n_dst]
    single = root.structure == "complete" and root.n_src == root.n_dst == len(lens)  # samples of one token: causal too
    if root.structure != "causal" and not single:
        raise GtxError(
            f"pattern {spec!r} attends over whole causal sequences ({edges.stage}); these candidates are "
            f"{root.structure or 'listed edges'}: use it on a causal stage (dd) of an lm or seq2seq task"
        )
    return lens
