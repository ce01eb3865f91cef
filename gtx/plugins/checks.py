"""Checks on what plugins hand back (edges, masks, examples, metrics, model outputs), before gtx
uses it: type, dtype, shape and range, each failure one line naming the plugin and what was
expected. Edge *invariants* (duplicates, a query without keys, a future edge) are
``pattern.check_edges``'s; these are the checks that come before them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from gtx.errors import PluginError


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"a {type(value).__name__}"


def edge_pair(who: str, value) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)``: two 1-D integer CPU tensors of one length, as an edge function must return."""
    ok = (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(
            isinstance(t, torch.Tensor)
            and t.dim() == 1
            and not t.is_floating_point()
            and not t.is_complex()
            and t.dtype != torch.bool
            and t.device.type == "cpu"
            for t in value
        )
    )
    if not ok or value[0].shape != value[1].shape:
        got = f"({', '.join(_kind(t) for t in value)})" if isinstance(value, (tuple, list)) else _kind(value)
        raise PluginError(f"{who} returned {got}; expected (src, dst): two 1-D integer CPU tensors of equal length")
    return value[0].long(), value[1].long()


def rule_mask(who: str, value, shape: tuple[int, int]) -> torch.Tensor:
    """A rule's result: a bool tensor broadcastable to ``shape`` (queries x keys)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        try:
            return torch.broadcast_to(value, shape)
        except RuntimeError:
            pass
    raise PluginError(
        f"{who} returned {_kind(value)}; expected a bool tensor broadcastable to {shape} (queries x keys)"
    )


def examples(who: str, splits) -> None:
    """A task's data: each split a sized, indexable collection (a list, or a lazy view such as
    text's windows) of (source, target) pairs of token sequences; its first and last examples are
    checked, so that a lazy split is not materialised."""
    if not isinstance(splits, Mapping):
        raise PluginError(
            f"{who} returned {_kind(splits)}; expected a dict of split name -> list of (source, target) examples"
        )
    for split, data in splits.items():
        try:
            if isinstance(data, (str, bytes, Mapping, torch.Tensor)):
                raise TypeError
            n = len(data)
            ends = [data[i] for i in sorted({0, n - 1})] if n else []
        except Exception:
            raise PluginError(
                f"{who}: split {split!r} is {_kind(data)}; expected a list of (source, target) examples"
            ) from None
        for i, ex in zip(sorted({0, n - 1}), ends):
            pair = isinstance(ex, (tuple, list)) and len(ex) == 2
            if (
                not pair
                or not all(isinstance(s, (list, tuple, str)) for s in ex)
                or not all(isinstance(t, str) for s in ex for t in s[:1])
            ):
                raise PluginError(
                    f"{who}: {split} example {i} is {ex!r:.80}; expected (source, target): two sequences of string tokens"
                )


def metrics(who: str, value) -> dict:
    """Task metrics: names to finite-or-NaN numbers, or to such dicts (per bucket), JSON-ready."""
    if not isinstance(value, Mapping):
        raise PluginError(
            f"{who} returned {_kind(value)}; expected a dict of metric name -> number (or -> dict of numbers)"
        )
    out = {}
    for name, v in value.items():
        inner = v if isinstance(v, Mapping) else {"": v}
        for key, x in inner.items():
            number = isinstance(x, (int, float)) and not isinstance(x, bool)
            if not isinstance(name, str) or not isinstance(key, str) or not number or math.isinf(x):
                where = f"{name!r}[{key!r}]" if key else repr(name)
                raise PluginError(
                    f"{who}: metric {where} is {x!r:.40}; expected a finite number (NaN allowed) under a string name"
                )
        out[name] = (
            {k: float(x) for k, x in v.items()} if isinstance(v, Mapping) else (v if isinstance(v, int) else float(v))
        )
    return out


def model_output(model: torch.nn.Module, out, n_targets: int, vocab: int) -> None:
    """A model's ``Output``: logits (n_targets, vocab) floating; aux_loss None or a scalar."""
    who = getattr(model, "plugin_label", f"model {type(model).__name__}")
    logits = getattr(out, "logits", None)
    if (
        not isinstance(logits, torch.Tensor)
        or not logits.is_floating_point()
        or tuple(logits.shape) != (n_targets, vocab)
    ):
        got = _kind(logits) if logits is not None else _kind(out)
        raise PluginError(
            f"{who} returned logits as {got}; expected a floating tensor of shape ({n_targets}, {vocab}): one row per target"
        )
    aux = getattr(out, "aux_loss", None)
    if aux is not None and (not isinstance(aux, torch.Tensor) or aux.numel() != 1 or not aux.is_floating_point()):
        raise PluginError(f"{who} returned aux_loss as {_kind(aux)}; expected None or a floating scalar tensor")
