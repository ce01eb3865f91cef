"""What a model attends with: a backend, plus the run-time parts of the run's pattern.

A plain pattern's edges go straight to the backend. Beyond that a pattern may (``Pattern``):

- split the heads into groups, one pattern each (``heads(a,b)``): each group's heads attend over
  that group's edge set (``EdgeSet.groups``);
- add a score bias to every edge (``P+alibi``): a registered module maps each edge's query and key
  positions to an additive score per head; learned tables are parameters of this module, so they
  train and are checkpointed with the model;
- select edges at run time from the queries and keys (``topk``, ``moba``, ``lsh``): per head, a
  subset of the pattern's own (candidate) edges. A selection is a bool mask (E, H) over the
  candidate edges, or for block-sparse choosers a ``gtx.selection.blocks.BlockSelection``. Either way the
  selected edges are candidates, so the candidates' checks (no future edge in ``dd``) hold; a
  query left without an edge is an error naming the pattern;
- bring attention with parameters of its own (``nsa``, ``dsa``): a ``gtx.attention.trainable.Trainable``
  built per layer (``for_layer``), given the candidates and the backend; its auxiliary losses
  reach the training loss through ``begin_step``/``take_losses``.

The dense reference applies the same function: every backend that accepts biases is tested
against it on values and gradients.
"""

from __future__ import annotations

import torch

from gtx.attention.budget import Account, on_active
from gtx.attention.checks import check_keep, check_selection
from gtx.attention.trainable import Run
from gtx.backends import Backend, repeat_kv
from gtx.errors import GtxError, PluginError, plugin_code
from gtx.graph.tokens import EdgeSet
from gtx.selection.blocks import BlockSelection, TokenBlockSelection, attend_blocks, attend_token_blocks
from gtx.selection.kernels import take_ran
from gtx.selection.keys import KeySelection, attend_keys


def _bias_modules(pattern, out: dict) -> dict:
    if pattern is not None:
        if pattern.bias is not None:
            out[bias_key(pattern.bias)] = pattern.bias
        for group in pattern.heads:
            _bias_modules(group, out)
    return out


def bias_key(bias: tuple[str, tuple]) -> str:
    name, params = bias
    return name + "".join(f"_{k}_{v}" for k, v in params).replace(".", "_")


class Attention(torch.nn.Module):
    """``attention(q, k, v, edges)`` as a backend is called (q pre-scaled; (n, H, D) tensors; k and v
    may hold fewer heads, H_kv dividing H: grouped-query attention, ``repeat_kv``'s order), for any
    pattern; ``pattern``, ``heads`` (the model's head count) and ``head_dim`` build the pattern's bias
    modules and trainable attention; ``from_trained``: the run starts from a trained model
    (``gtx.attention.trainable.starts_trained``), what its trainable attention is told."""

    def __init__(
        self,
        backend: Backend,
        pattern=None,
        heads: int | None = None,
        head_dim: int | None = None,
        from_trained: bool = False,
    ):
        super().__init__()
        self.backend, self.heads, self.pattern, self.head_dim = backend, heads, pattern, head_dim
        self.from_trained = from_trained
        self.biases = torch.nn.ModuleDict()
        for key, bias in _bias_modules(pattern, {}).items():
            self.biases[key] = self._build_bias(bias, heads)
        self.trainable = self._build_trainable()  # shared by the layers of a model that never calls for_layer
        self.account = Account()  # per stage, the keys each query read (gtx.attention.budget), since ``take_reads``
        self.stats: dict[
            str, list[float]
        ] = {}  # trainable attention's losses and kept edges: name -> [sum, count], since reset
        # the training step, its auxiliary losses, whether it trains them alone
        self.step, self.pending, self.frozen = (
            0,
            [],
            False,
        )
        self.flops = (
            0.0  # forward FLOPs of the attention itself (q.k and the weighted sum of v over the attended edges), ever
        )
        self.list_edges = (
            False  # True: key selections run as edge lists through the backend (slower; what gtx.measure.probe records)
        )

    @classmethod
    def for_width(
        cls, backend: Backend, pattern, heads: int | None, dim: int | None, from_trained: bool = False
    ) -> Attention:
        """For a model of ``dim`` features in ``heads`` heads (``dim // heads`` each); either may be
        None for a model that states no heads."""
        return cls(backend, pattern, heads, dim // heads if heads and dim else None, from_trained)

    def _build_trainable(self):
        make = getattr(self.pattern, "trainable", None)
        if make is None:
            return None
        if not self.heads or not self.head_dim:
            raise GtxError(
                f"pattern {self.pattern.spec!r} has learned parameters: it needs the model's heads and dim settings"
            )
        with plugin_code(f"pattern {self.pattern.spec!r}", "while building its trainable attention"):
            module = make(self.heads, self.head_dim)
        module.from_trained = self.from_trained
        return module

    def for_layer(self) -> LayerAttention:
        """This attention with trainable parts of one layer's own (the model's backend, biases and
        counters shared). Once a model asks, the parts shared by all layers are dropped."""
        self.trainable = None
        return LayerAttention(self)

    def begin_step(self, step: int) -> None:
        """A training step starts: ``step`` optimizer steps were taken before it."""
        self.step, self.pending, self.frozen = step, [], False

    def take_losses(self) -> tuple[torch.Tensor | None, bool]:
        """The step's auxiliary losses summed (None: none), and whether they train alone (the model frozen)."""
        pending, self.pending = self.pending, []
        return (sum(pending) if pending else None), self.frozen

    def record(self, name: str, value: float, count: int) -> None:
        total = self.stats.setdefault(name, [0.0, 0])
        total[0] += value
        total[1] += count

    def reset_stats(self) -> dict[str, float]:
        """The trainable attention's losses (mean per call) and kept edges (per query) since the last call."""
        out = {name: total / count for name, (total, count) in self.stats.items() if count}
        self.stats.clear()
        return out

    @property
    def name(self) -> str:
        return self.backend.name

    def reset_choices(self) -> dict:
        """What ran per stage since the last call: the backend's choices and the selection kernels
        (``gtx.selection.kernels``), each by name with its count of calls."""
        out = self.backend.reset_choices()
        for stage, kernels in take_ran().items():
            out.setdefault(stage, {}).update(kernels)
        return out

    def take_reads(self) -> dict[str, tuple[float, float, float]]:
        """Per stage, (keys read, queries, keys allowed) summed over the calls since the last take:
        what the results' edges per query and density are (``gtx.attention.budget``)."""
        return self.account.take()

    def _build_bias(self, bias, heads):
        from gtx.plugins.registry import BIASES

        name, params = bias
        if not heads:
            raise GtxError(f"bias {name!r} needs the model's number of heads; this model has no 'heads' setting")
        try:
            return BIASES.get(name).obj(heads, **dict(params))
        except (TypeError, ValueError) as e:
            raise GtxError(f"bad parameters for bias {name!r}: {e}") from None

    def bias(self, bias, edges: EdgeSet, heads: torch.Tensor) -> torch.Tensor | None:
        """(E, len(heads)) additive scores of the edges, or None."""
        key = bias_key(bias)
        if key not in self.biases:  # a model built without the pattern (tests, tools): only parameter-free biases
            module = self._build_bias(bias, self.heads).to(heads.device)
            if any(True for _ in module.parameters()):
                raise GtxError(
                    f"bias {bias[0]!r} has learned parameters: build the model's attention as gtx.attention.Attention(backend, "
                    "pattern, heads) so that they train"
                )
            self.biases[key] = module
        q_pos, k_pos = edges.positions()
        out = self.biases[key](q_pos, k_pos, edges.stage, heads)
        if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (edges.num_edges, len(heads))):
            raise PluginError(
                f"bias {bias[0]!r} returned {getattr(out, 'shape', type(out).__name__)}; expected ({edges.num_edges}, {len(heads)})"
            )
        return out

    def forward(self, q, k, v, edges: EdgeSet, trainable=None, inputs=None):
        """``trainable``: a layer's own trainable attention (``for_layer``), else this module's;
        ``inputs``: the layer's input on a self-attention stage, (n, width), for trainable attention
        that reads it (``Run.inputs``).

        Under ``torch.autocast`` the attention runs outside it, on inputs of one dtype: plain
        patterns in the autocast dtype (SDPA's and FlexAttention's kernels take it), content-chosen
        and trainable ones in float32 (their own kernels and choices assume it); the output is
        returned in the autocast dtype."""
        device = q.device.type
        if not torch.is_autocast_enabled(device):
            return self._forward(q, k, v, edges, trainable, inputs)
        fast = torch.get_autocast_dtype(device)
        dtype = fast if edges.pattern is None or edges.pattern.plain else torch.float32
        with torch.autocast(device, enabled=False):
            inputs = None if inputs is None else inputs.to(dtype)
            return self._forward(q.to(dtype), k.to(dtype), v.to(dtype), edges, trainable, inputs).to(fast)

    def _forward(self, q, k, v, edges: EdgeSet, trainable=None, inputs=None):
        pattern = edges.pattern
        plain = pattern is None or pattern.plain
        if k.shape[1] != q.shape[1] and not (plain and getattr(self.backend, "grouped_kv", False)):
            k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        if plain:
            out = self.backend(q, k, v, edges)
            keys = work = edges.num_edges  # a filtered (ACT) set holds its active queries' edges alone
            offered = 0.0
        elif pattern.trainable is not None:
            self.heads = self.heads or q.shape[1]
            out, keys, offered, work = self._trained(
                q, k, v, edges, trainable if trainable is not None else self.trainable, inputs
            )
        else:
            self.heads = self.heads or q.shape[1]
            out, keys = self._attend(q, k, v, edges, torch.arange(q.shape[1], device=q.device), None)
            offered, work = 0.0, keys
        self.account.add(pattern.spec if pattern is not None else "", edges, keys, offered)
        self.flops += 2 * work * q.shape[1] * (q.shape[2] + v.shape[2])
        return out

    def _trained(self, q, k, v, edges: EdgeSet, module, inputs=None) -> tuple[torch.Tensor, float, float, float]:
        """The output; the keys read over the active queries, the keys offered beyond the stage's
        tokens (``Run.read``) and the edges computed (the branches' sum: the FLOPs' count)."""
        spec = edges.pattern.spec
        if module is None:
            raise GtxError(
                f"pattern {spec!r} has learned parameters: build the model's attention as gtx.attention.Attention(backend, "
                "pattern, heads, head_dim) so that they train"
            )
        if edges.stage not in module.stages:
            return self.backend(q, k, v, edges), edges.num_edges, 0.0, edges.num_edges
        run = Run(self, spec, inputs)
        with plugin_code(f"pattern {spec!r}", "in its trainable attention"):
            out = module(q, k, v, edges, run)
        if not isinstance(out, torch.Tensor) or out.shape[:2] != q.shape[:2]:
            raise PluginError(
                f"pattern {spec!r} returned {getattr(out, 'shape', type(out).__name__)} from its trainable attention; "
                f"expected ({q.shape[0]}, {q.shape[1]}, Dv)"
            )
        out = out if edges.keep is None else out * edges.keep[:, None, None].to(out.dtype)
        if run.reads is not None:
            return out, on_active(run.reads[0], edges), on_active(run.reads[1], edges), run.edges
        return out, sum(on_active(branch, edges) for branch in run.branches), 0.0, run.edges

    def _attend(self, q, k, v, edges: EdgeSet, heads: torch.Tensor, bias) -> tuple[torch.Tensor, float]:
        """The output, and the edges one head attended over. ``heads``: the model's head indices
        that q holds (groups recurse on slices); ``bias``: inherited from an enclosing pattern."""
        pattern = edges.pattern
        bias = pattern.bias or bias
        if edges.groups:
            n = len(edges.groups)
            if q.shape[1] % n:
                raise GtxError(
                    f"pattern {pattern.spec!r} splits heads into {n} groups but the model has {q.shape[1]} heads here; "
                    f"use a multiple of {n} heads (--heads)"
                )
            w = q.shape[1] // n
            parts = [
                self._attend(
                    q[:, i * w : (i + 1) * w],
                    k[:, i * w : (i + 1) * w],
                    v[:, i * w : (i + 1) * w],
                    e,
                    heads[i * w : (i + 1) * w],
                    bias,
                )
                for i, e in enumerate(edges.groups)
            ]
            return torch.cat([out for out, _ in parts], 1), sum(used for _, used in parts) / n
        if pattern.select is not None:
            return self._selected(q, k, v, edges, heads, bias)
        return self._call(
            q, k, v, edges, self.bias(bias, edges, heads) if bias else None, pattern.spec
        ), edges.num_edges

    def _call(self, q, k, v, edges, scores, spec):
        if scores is None:
            return self.backend(q, k, v, edges)
        if not getattr(self.backend, "supports_bias", False):
            raise GtxError(
                f"backend {self.backend.name!r} cannot apply score biases (pattern {spec!r}); use --backend auto, blocksparse, dense, torch or dgl"
            )
        return self.backend(q, k, v, edges, bias=scores)

    def _selected(self, q, k, v, edges, heads, bias):
        pattern = edges.pattern
        with torch.no_grad():
            chosen = pattern.select(q.detach(), k.detach(), edges)
        check_selection(pattern.spec, chosen, edges, q.shape[1])
        if chosen is None:  # this stage keeps its candidates
            return self._call(
                q, k, v, edges, self.bias(bias, edges, heads) if bias else None, pattern.spec
            ), edges.num_edges
        if isinstance(chosen, (KeySelection, TokenBlockSelection)) and (bias or self.list_edges):
            chosen = chosen.as_mask(edges)  # biases are applied per edge: list the kept edges
        elif isinstance(chosen, KeySelection):
            return attend_keys(q, k, v, edges, chosen), on_active(chosen.per_query(), edges)
        elif isinstance(chosen, TokenBlockSelection):
            return attend_token_blocks(q, k, v, edges, chosen), on_active(chosen.per_query(), edges)
        if isinstance(chosen, BlockSelection):
            if bias:
                raise GtxError(
                    f"pattern {pattern.spec!r} selects blocks: score biases are not supported on it; drop the bias"
                )
            return attend_blocks(q, k, v, edges, chosen), on_active(chosen.per_query(), edges)
        keep = check_keep(pattern.spec, chosen, edges, q.shape[1])
        scores = self.bias(bias, edges, heads) if bias else None
        outs = []
        for h in range(q.shape[1]):
            m = keep[:, h]
            sub = EdgeSet(edges.src[m], edges.dst[m], edges.n_src, edges.n_dst, edges.stage, *_lens(edges))
            sl = slice(h, h + 1)
            outs.append(
                self._call(
                    q[:, sl], k[:, sl], v[:, sl], sub, None if scores is None else scores[m][:, sl], pattern.spec
                )
            )
        return torch.cat(outs, 1), float(keep.sum()) / q.shape[1]


class LayerAttention(torch.nn.Module):
    """One layer's attention (``Attention.for_layer``): the model's ``Attention`` with this layer's
    own trainable parts (``trainable``, None for patterns without)."""

    def __init__(self, shared: Attention):
        super().__init__()
        object.__setattr__(self, "shared", shared)  # not a submodule: the model holds it, and its biases, once
        self.trainable = shared._build_trainable()

    @property
    def name(self) -> str:
        return self.shared.name

    def forward(self, q, k, v, edges: EdgeSet, inputs=None):
        return self.shared(q, k, v, edges, trainable=self.trainable, inputs=inputs)


def layer_attention(attention) -> torch.nn.Module:
    """What one model layer attends with: ``attention.for_layer()``, or a bare backend wrapped."""
    return attention.for_layer() if isinstance(attention, Attention) else Attention(attention)


def _lens(edges: EdgeSet):
    return edges.root.q_lens, edges.root.k_lens


def check_pattern(pattern, backend: Backend, heads: int | None) -> None:
    """What a run can check before it starts: head groups divide the model's heads, and a score
    bias meets a backend that applies biases."""
    if pattern.trainable is not None and (pattern.bias is not None or pattern.heads):
        raise GtxError(
            f"pattern {pattern.spec!r} brings its own trainable attention: it takes no score bias and no head groups; drop them"
        )
    if pattern.bias is not None and not getattr(backend, "supports_bias", False):
        raise GtxError(
            f"backend {backend.name!r} cannot apply score biases (pattern {pattern.spec!r}); use --backend auto, blocksparse, dense, torch or dgl"
        )
    if pattern.heads:
        n = len(pattern.heads)
        if heads is not None and heads % n:
            raise GtxError(
                f"pattern {pattern.spec!r} splits the heads into {n} groups but the model has {heads} heads; use a multiple of {n} (--heads)"
            )
        for group in pattern.heads:
            if group.trainable is not None:
                raise GtxError(
                    f"pattern {group.spec!r} brings its own trainable attention: it cannot be a head group of {pattern.spec!r}"
                )
            check_pattern(group, backend, heads // n if heads else None)


def full_budget(pattern, stages, length: int) -> str | None:
    """Why a selection keeps at least as many keys as any query has candidates at the task's longest
    sequence (it is its candidate pattern under another name), else None."""
    for p in pattern.heads or (pattern,):
        if p.heads:
            why = full_budget(p, stages, length)
            if why:
                return why
        elif p.budget:
            most = max(p.most_keys(stage, length, length) for stage in stages)
            if p.budget >= most:
                return (
                    f"pattern {p.spec!r} keeps up to {p.budget} keys per query, but its candidates have at most {most} at this "
                    f"task's {length} tokens: it would attend to every candidate"
                )
    return None


def check_budget(pattern, stages, length: int) -> None:
    """``full_budget``'s reason as an error naming the fix."""
    why = full_budget(pattern, stages, length)
    if why:
        raise GtxError(f"{why}; choose a smaller budget (k, or b and k)")


def check_trainable(pattern, stages, heads: int | None, dim: int | None, model: str, length: int | None = None) -> None:
    """A trainable pattern is built once before the run (its parameters checked against the model's
    heads), must serve one of the model's stages and suit sequences of ``length`` tokens
    (``Trainable.check_length``): else one line naming the pattern."""
    if pattern.trainable is None:
        return
    module = Attention.for_width(None, pattern, heads, dim).trainable
    if not set(module.stages) & set(stages):
        raise GtxError(
            f"pattern {pattern.spec!r} attends in {', '.join(module.stages)} only, but model {model!r} attends in "
            f"{', '.join(stages)} here: use it with a model and task that have {module.stages[0]} (lm, transformer, ut)"
        )
    why = module.check_length(length) if length else None
    if why:
        raise GtxError(f"pattern {pattern.spec!r}: {why}")
