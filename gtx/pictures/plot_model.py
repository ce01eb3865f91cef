"""Figures of a trained model (re-exported by ``gtx.pictures.plot``): its attention weights over the pattern's
edges for one example, and its ACT step counts. ``gtx.measure.probe`` runs the model and records; this
module only draws.

    from gtx.pictures import plot
    plot.attention("results/checkpoints/<run_id>/best.pt", example=0)       # last layer (ACT: the step with the most queries active), mean over heads
    plot.act("<run_id>", examples=[0, 1], results_dir="results")
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gtx.errors import GtxError
from gtx.graph.pattern import STAGE_NAMES, STAGES
from gtx.measure import probe
from gtx.pictures.figure import MAX_CELLS, new_figure

MAX_LABELS = 64  # tokens per side drawn as tick labels; longer sequences show positions
MASKED = (0.85, 0.85, 0.85)  # cells that are not edges: light grey, apart from viridis's dark purple for weight 0
SIDE_NAMES = {"enc": "encoder", "dec": "decoder"}


def attention_grid(
    call: probe.AttentionCall, head: int | None = None, max_cells: int = MAX_CELLS
) -> tuple[np.ndarray, int, int]:
    """(grid, bq, bk): rows = queries, columns = keys; grid[q, k] the weight of edge k -> q (head
    ``head``, or the mean over heads), NaN where there is no edge. Beyond ``max_cells`` positions per
    side, queries in blocks of bq and keys in blocks of bk: a cell is the weight the block's queries
    give the block's keys, summed over the keys and averaged over the queries (NaN: no edge in it).
    From the edge list: O(edges + cells), never n_q x n_k beyond the cells drawn."""
    src, dst, w = call.weights(head)
    bq, bk = -(-call.n_q // max_cells), -(-call.n_k // max_cells)
    rows, cols = -(-call.n_q // bq), -(-call.n_k // bk)
    cell = (dst // bq) * cols + src // bk
    sums = torch.bincount(cell, weights=w.double(), minlength=rows * cols).reshape(rows, cols).numpy()
    edges = torch.bincount(cell, minlength=rows * cols).reshape(rows, cols).numpy()
    heights = np.minimum(bq, call.n_q - bq * np.arange(rows))
    return np.where(edges > 0, sums / heights[:, None], np.nan), bq, bk


def _token_ticks(ax, axis: str, tokens: list[str] | None, n: int) -> None:
    """Token labels at each position up to MAX_LABELS tokens; integer positions beyond."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    if tokens is None or n > MAX_LABELS:
        target.set_major_locator(MaxNLocator(integer=True))
        return
    size = 8 if n <= 24 else 6 if n <= 40 else 4.5
    if axis == "x":
        ax.set_xticks(range(n), tokens, rotation=90 if max(map(len, tokens)) > 2 else 0, fontsize=size)
    else:
        ax.set_yticks(range(n), tokens, fontsize=size)


def _span(n: int, unit: str) -> str:
    """'2 layers (0-1)', '1 head (0)'."""
    return f"{n} {unit}s (0-{n - 1})" if n > 1 else f"{n} {unit} (0)"


def _of(n: int, unit: str) -> str:
    """'layers 0-1', 'the only head'."""
    return f"{unit}s 0-{n - 1}" if n > 1 else f"the only {unit}"


def _check_choice(value: int | None, n: int, unit: str) -> None:
    if value is not None and not 0 <= value < n:
        raise GtxError(f"{unit} {value} is out of range: the model has {_span(n, unit)}")


def active_queries(call: probe.AttentionCall) -> int:
    """Queries with at least one edge in this call: under ACT, those not yet halted."""
    return int(call.weights(None)[1].unique().numel())


def attention_figure(
    seen: probe.Probe, layer: int | None = None, head: int | None = None, title: str = "", max_cells: int = MAX_CELLS
) -> Figure:
    """One panel per stage the model ran: the weights of layer ``layer`` (0-based; None: each stage's
    last; ACT models: step, None: the step with the most queries still active) and head ``head`` (None: the mean over heads), queries on rows, keys on
    columns, token labels up to MAX_LABELS tokens. Non-edges are light grey, so a window or a stride
    shows as the shape of the coloured cells. GtxError for a layer or head out of range."""
    stages = [s for s in STAGES if seen.stage(s)]
    if not stages:
        raise GtxError("the model ran no attention on this example")
    act = bool(seen.steps)
    unit = "step" if act else "layer"
    _check_choice(layer, max(len(seen.stage(s)) for s in stages), unit)
    _check_choice(head, seen.calls[0].heads, "head")
    fig = new_figure(max(5.2 * len(stages), 8.0), 5.0)  # one panel: wide enough for the title
    axes = fig.subplots(1, len(stages), squeeze=False)[0]
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=MASKED)
    for ax, stage in zip(axes, stages):
        calls = seen.stage(stage)
        name = f"{stage}: {STAGE_NAMES[stage]}"
        if layer is not None and layer >= len(calls):  # ACT: every query of this stage halted earlier
            ax.text(
                0.5,
                0.5,
                f"no step {layer}: every query\nhalted after {len(calls)} steps",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_title(name, fontsize=9)
            ax.set_axis_off()
            continue
        # the step where most queries still attend (the earliest of equals): the last may hold one query
        if layer is None and act:
            call = max(calls, key=active_queries)
        else:
            call = calls[-1 if layer is None else layer]
        grid, bq, bk = attention_grid(call, head, max_cells)
        top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
        image = ax.imshow(
            np.ma.masked_invalid(grid),
            cmap=cmap,
            vmin=0,
            vmax=top,
            interpolation="nearest",
            aspect="auto",
            extent=(-0.5, grid.shape[1] * bk - 0.5, grid.shape[0] * bq - 0.5, -0.5),
        )
        ax.set_xlim(-0.5, call.n_k - 0.5)
        ax.set_ylim(call.n_q - 0.5, -0.5)
        q_tokens, k_tokens = seen.tokens(stage)
        binned = max(bq, bk) > 1
        _token_ticks(ax, "x", None if binned else k_tokens, call.n_k)
        _token_ticks(ax, "y", None if binned else q_tokens, call.n_q)
        which = f"{unit} {call.index} ({_of(len(calls), unit)})" + (
            f", {active_queries(call)} of {call.n_q} queries active" if act else ""
        )
        heads = "mean over heads" if head is None else f"head {head} ({_of(call.heads, 'head')})"
        ax.set_title(f"{name}\n{which}, {heads}" + (f"\nblocks of {bq}x{bk} positions" if binned else ""), fontsize=9)
        ax.set(xlabel="key", ylabel="query")
        fig.colorbar(
            image,
            ax=ax,
            shrink=0.8,
            label="attention weight" + (" (per query, summed over the block)" if binned else ""),
        )
    note = "grey: no edge"
    if act:
        note += "; ACT: one attention call per step, queries halted before a step have no edges in it"
    fig.suptitle(f"{title}{seen.split} example {seen.index}, teacher forced\n{note}", fontsize=10)
    return fig


def attention(
    ref: str,
    example: int = 0,
    split: str = "test",
    layer: int | None = None,
    head: int | None = None,
    results_dir: str | None = None,
    device: str = "cpu",
    max_cells: int = MAX_CELLS,
) -> Figure:
    """The attention weights of a checkpoint's model (a .pt path, or a run id under ``results_dir``)
    on example ``example`` of ``split``: see ``attention_figure``. GtxError (one line) for a missing
    or foreign checkpoint, or an example, layer or head out of range."""
    model, resolved, _ = probe.load_model(ref, results_dir, device)
    seen = probe.run_example(model, resolved, split, example)
    return attention_figure(
        seen, layer, head, f"{resolved.config.model}, pattern {resolved.pattern_given.spec}: ", max_cells
    )


def act_figure(
    seen: Sequence[probe.Probe], totals: dict[str, torch.Tensor], max_depth: int | None = None, title: str = ""
) -> Figure:
    """One row per example: a bar per token of its ACT steps, one column per side (encoder, decoder);
    a last row with the distribution of steps over every node of the split (``totals``)."""
    sides = list(totals)
    longest = max(len(p.steps[side]) for p in seen for side in sides)
    fig = new_figure(max(5.0, min(0.2 * longest + 2, 12)) * len(sides), 2.6 * (len(seen) + 1))
    axes = fig.subplots(len(seen) + 1, len(sides), squeeze=False)
    top = max_depth or int(max(int(t.max()) for t in totals.values()))
    for row, p in enumerate(seen):
        for col, side in enumerate(sides):
            ax, steps = axes[row, col], p.steps[side].numpy()
            ax.bar(np.arange(len(steps)), steps, color="C0")
            _token_ticks(ax, "x", p.src if side == "enc" else p.tgt, len(steps))
            ax.set_ylim(0, top + 0.5)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{p.split} example {p.index}, {SIDE_NAMES[side]}: mean {steps.mean():.2f} steps", fontsize=9)
            ax.set_ylabel("ACT steps")
    for col, side in enumerate(sides):
        ax, steps = axes[-1, col], totals[side].numpy()
        counts = np.bincount(steps, minlength=top + 1)[1:]
        ax.bar(np.arange(1, len(counts) + 1), counts, color="C1")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="ACT steps", ylabel="nodes")
        ax.set_title(
            f"{SIDE_NAMES[side]} steps over the {seen[0].split} split: {len(steps):,} nodes, mean {steps.mean():.2f}",
            fontsize=9,
        )
    depth = f" (max_depth {max_depth})" if max_depth else ""
    fig.suptitle(f"{title}ACT steps per token{depth}, teacher forced", fontsize=10)
    return fig


def act(
    ref: str,
    examples: int | Sequence[int] = (0,),
    split: str = "test",
    results_dir: str | None = None,
    device: str = "cpu",
) -> Figure:
    """The ACT steps of a checkpoint's model: per token of each of ``examples`` and over the whole
    ``split`` (see ``act_figure``). GtxError for a model without ACT, or an example out of range."""
    examples = [examples] if isinstance(examples, int) else list(examples)
    if not examples:
        raise GtxError("no example to plot; give at least one example index")
    model, resolved, _ = probe.load_model(ref, results_dir, device)
    seen = [probe.run_example(model, resolved, split, i) for i in examples]
    if not seen[0].steps:
        raise GtxError(
            f"model {resolved.config.model!r} does not use adaptive computation time; train ut or --set universal=true"
        )
    title = f"{resolved.config.model}, pattern {resolved.pattern_given.spec}: "
    return act_figure(
        seen, probe.split_steps(model, resolved, split), getattr(resolved.model_config, "max_depth", None), title
    )


__all__ = ["act", "act_figure", "attention", "attention_figure", "attention_grid"]
