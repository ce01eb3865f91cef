"""Figures: attention patterns as adjacency images, accuracy against speed across runs, and a trained
model's attention weights and ACT steps (``attention``, ``act``: drawn by ``gtx.pictures.plot_model``).

Every figure function returns a ``matplotlib.figure.Figure`` on an Agg canvas, made without pyplot:
a notebook shows it inline, a script or the CLI writes it with ``save``, and nothing here changes
matplotlib's global backend or keeps figures alive in pyplot's registry.

    from gtx.pictures import plot
    from gtx.records import results
    plot.pattern("local:w=64|strided:l=64", src_len=4096, stages=["dd"])
    plot.results(results.load("results"), by=["task", "model"])  # each task's own metric: bpc for text, query_acc for recall
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gtx.errors import GtxError
from gtx.graph.pattern import STAGE_NAMES, STAGES, Pattern
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import EdgeSet, possible_edges
from gtx.pictures.figure import MAX_CELLS, new_figure, save
from gtx.pictures.plot_results import curve_table, own_metric, results, run_table

MAX_POSITIONS = 100_000  # per side: beyond this the edge lists alone outgrow a workstation


# ---------------------------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------------------------


def stage_lengths(stage: str, src_len: int, tgt_len: int) -> tuple[int, int]:
    """(queries, keys) of a stage: ee over the source, dd over the target, ed target over source."""
    return {"ee": (src_len, src_len), "dd": (tgt_len, tgt_len), "ed": (tgt_len, src_len)}[stage]


def stage_stats(stage: str, src: torch.Tensor, dst: torch.Tensor, n_q: int, n_k: int) -> tuple[float, float]:
    """(density, edges per query) as ``gtx show-pattern`` reports them: edges over ``possible_edges``
    (for dd, the causal triangle)."""
    return src.numel() / possible_edges(EdgeSet(src, dst, n_k, n_q, stage)), src.numel() / n_q


def _as_pattern(spec: str | Pattern) -> Pattern:
    return spec if isinstance(spec, Pattern) else parse_pattern(spec)


def _check_lengths(*lengths: int) -> None:
    if max(lengths) > MAX_POSITIONS:
        raise GtxError(f"cannot plot {max(lengths):,} positions; the limit is {MAX_POSITIONS:,} per side")


def bin_edges(
    src: torch.Tensor, dst: torch.Tensor, n_q: int, n_k: int, max_cells: int = MAX_CELLS
) -> tuple[np.ndarray, int, int]:
    """(grid, bq, bk): queries in blocks of bq and keys in blocks of bk, the fewest that give at most
    ``max_cells`` blocks per side; grid[i, j] = the fraction of block (i, j)'s query-key pairs that are
    edges (the last block of a side may be shorter). With blocks of 1 it is the exact 0/1 adjacency.
    A bincount over the edge list: memory O(edges + cells), never n_q x n_k."""
    bq, bk = -(-n_q // max_cells), -(-n_k // max_cells)
    rows, cols = -(-n_q // bq), -(-n_k // bk)
    counts = torch.bincount((dst // bq) * cols + src // bk, minlength=rows * cols).reshape(rows, cols).numpy()
    heights = np.minimum(bq, n_q - bq * np.arange(rows))
    widths = np.minimum(bk, n_k - bk * np.arange(cols))
    return counts / np.outer(heights, widths), bq, bk


def pattern_grid(spec: str | Pattern, stage: str, n_q: int, n_k: int, max_cells: int = MAX_CELLS) -> np.ndarray:
    """The array ``pattern`` draws for one stage: rows = queries, columns = keys (see ``bin_edges``)."""
    _check_lengths(n_q, n_k)
    src, dst = _as_pattern(spec).edges(stage, n_q, n_k)
    return bin_edges(src, dst, n_q, n_k, max_cells)[0]


def pattern(
    spec: str | Pattern,
    src_len: int = 64,
    tgt_len: int | None = None,
    stages: Sequence[str] = STAGES,
    max_cells: int = MAX_CELLS,
) -> Figure:
    """One panel per stage: the adjacency (rows = queries, columns = keys, dark = edge; beyond
    ``max_cells`` positions per side, binned into blocks shaded by their fraction of edges, on a sqrt
    scale with a colour bar), titled with
    the stage, its density and edges per query; axes in token positions. ``tgt_len`` defaults to
    ``src_len``. GtxError beyond ``MAX_POSITIONS`` positions per side or for an unknown stage."""
    p = _as_pattern(spec)
    tgt_len = tgt_len or src_len
    stages = list(stages)
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise GtxError(f"unknown stage(s) {', '.join(bad) or '(none given)'}; stages are {', '.join(STAGES)}")
    lengths = [n for s in stages for n in stage_lengths(s, src_len, tgt_len)]
    _check_lengths(*lengths)
    binned = max(lengths) > max_cells
    groups = p.heads or (p,)  # heads(a,b): a row of panels per group of heads
    fig = new_figure(4.2 * len(stages) + 1.2 * binned, 4.6 * len(groups))
    grid_axes = fig.subplots(len(groups), len(stages), squeeze=False)
    axes = grid_axes.flatten()
    blocks = set()
    for ax, (group, stage) in zip(axes, [(g, s) for g in groups for s in stages]):
        n_q, n_k = stage_lengths(stage, src_len, tgt_len)
        src, dst = group.edges(stage, n_q, n_k)
        grid, bq, bk = bin_edges(src, dst, n_q, n_k, max_cells)
        density, per_query = stage_stats(stage, src, dst, n_q, n_k)
        # integer positions at cell centres; block j covers keys j*bk .. (j+1)*bk - 1 and the limits clip a
        # short last block to the true length. Binned: a sqrt scale, so that sparse blocks (a stride crossing
        # the block) stay visible.
        image = ax.imshow(
            grid,
            cmap="Greys",
            norm=PowerNorm(0.5 if binned else 1.0, vmin=0, vmax=1),
            interpolation="antialiased",
            aspect="auto",
            extent=(-0.5, grid.shape[1] * bk - 0.5, grid.shape[0] * bq - 0.5, -0.5),
        )
        ax.set_xlim(-0.5, n_k - 0.5)
        ax.set_ylim(n_q - 0.5, -0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if max(grid.shape) <= 48:  # few cells: faint lines make single cells countable
            ax.set_xticks(np.arange(grid.shape[1] + 1) * bk - 0.5, minor=True)
            ax.set_yticks(np.arange(grid.shape[0] + 1) * bq - 0.5, minor=True)
            ax.grid(which="minor", color="0.7", linewidth=0.5)
            ax.tick_params(which="minor", length=0)
        causal = " of the causal triangle" if stage == "dd" else ""
        head = f"heads {groups.index(group) + 1}/{len(groups)}: {group.spec}\n" if len(groups) > 1 else ""
        if stage in chosen_stages(group):  # not what a query reads: what it chooses among
            ax.set_title(
                f"{head}{stage}: {STAGE_NAMES[stage]}\ncandidates (keys chosen at run time): {per_query:.1f}/query",
                fontsize=9,
            )
        else:
            ax.set_title(
                f"{head}{stage}: {STAGE_NAMES[stage]}\ndensity {density:.3f}{causal}, {per_query:.1f} edges/query",
                fontsize=9,
            )
        ax.set(xlabel="key position", ylabel="query position")
        blocks.add((bq, bk))
    note = ""
    if binned:
        fig.colorbar(image, ax=axes, shrink=0.8, label="fraction of edges in the block (sqrt scale)")
        note = (
            "\nblocks of "
            + ", ".join(f"{bq}x{bk}" for bq, bk in sorted(blocks))
            + " positions, shaded by the fraction of edges"
        )
    shown = [f"src_len={src_len}"] * bool({"ee", "ed"} & set(stages)) + [f"tgt_len={tgt_len}"] * bool(
        {"dd", "ed"} & set(stages)
    )
    chosen = "".join(
        f"\n{g.spec + ': ' if len(groups) > 1 else ''}candidate edges drawn; keys are chosen among them at run time "
        f"per query and head ({', '.join(chosen_stages(g))}): {run_time_budget(g, max(lengths))}"
        for g in groups
        if chosen_stages(g)
    )
    fig.suptitle(f"{p.spec}   {' '.join(shown)}{note}{chosen}", fontsize=10)
    return fig


def _trainable_module(p: Pattern):
    """The pattern's trainable module built for a picture (its parameters unused): a few head counts
    are tried, as a pattern may need heads to be a multiple of its groups."""
    for heads in (1, 2, 4, 8, 16, 64):
        try:
            return p.trainable(heads, 8)
        except GtxError:
            continue
    return None


def chosen_stages(p: Pattern) -> list[str]:
    """The stages where ``p`` chooses its keys at run time from the content: every stage for a
    selection (``select``), a trainable pattern's own ``stages``; none for a fixed pattern."""
    if p.trainable is not None:
        module = _trainable_module(p)
        return list(module.stages) if module is not None else ["dd"]
    if p.select is None:
        return []
    return [stage for stage in STAGES if _selects(p, stage)]


def _selects(p: Pattern, stage: str, n: int = 8) -> bool:
    """Whether ``p``'s selection chooses on ``stage``: asked on random q and k over 8 tokens (None: every candidate is read there)."""
    src, dst = p.edges(stage, n, n)
    q, k = torch.randn(2, n, 1, 8, generator=torch.Generator().manual_seed(0))
    try:
        return p.select(q, k, EdgeSet(src, dst, n, n, stage)) is not None
    except Exception:  # a plugin's selection that needs more than a picture gives it: say it chooses
        return True


def run_time_budget(p: Pattern, n: int) -> str:
    """The keys a query of ``p`` reads at most, in words (``Pattern.budget``, else the trainable
    module's ``budget_text`` at ``n`` tokens), or that nothing fixes their number."""
    if p.budget:
        return f"at most {p.budget} keys per query"
    module = _trainable_module(p) if p.trainable is not None else None
    text = module.budget_text(n) if module is not None else None
    return text or "no fixed number of keys per query (the content decides how many)"


# ---------------------------------------------------------------------------------------------
# Benchmarks and frontiers (results and learning curves: gtx.pictures.plot_results)
# ---------------------------------------------------------------------------------------------


def attention_bench(df: pd.DataFrame) -> Figure:
    """Time against length per backend, log-log, one panel per pattern (``gtx bench attention``'s table)."""
    patterns = list(dict.fromkeys(df.pattern))
    fig = new_figure(5 * len(patterns), 4)
    for ax, spec in zip(fig.subplots(1, len(patterns), squeeze=False)[0], patterns):
        for backend, rows in df[df.pattern == spec].groupby("backend"):
            rows = rows.dropna(subset=["ms"]).sort_values("n")
            ax.plot(rows.n, rows.ms, marker="o", label=backend)
        ax.set(xscale="log", yscale="log", xlabel="tokens n", ylabel="forward + backward (ms)", title=spec)
        ax.legend()
    return fig


def frontier(table: pd.DataFrame) -> Figure:
    """A frontier's metric against budget and against cost, per length: ``gtx.pictures.plot_frontier.frontier``."""
    from gtx.pictures.plot_frontier import frontier

    return frontier(table)


# ---------------------------------------------------------------------------------------------
# Trained models: drawn by gtx.pictures.plot_model (imported on use: it loads checkpoints and models)
# ---------------------------------------------------------------------------------------------


def attention(
    ref: str, example: int = 0, split: str = "test", layer: int | None = None, head: int | None = None, **kwargs
) -> Figure:
    """A checkpoint's attention weights on one example, per stage: ``gtx.pictures.plot_model.attention``."""
    from gtx.pictures.plot_model import attention

    return attention(ref, example, split, layer, head, **kwargs)


def act(ref: str, examples: int | Sequence[int] = (0,), split: str = "test", **kwargs) -> Figure:
    """A checkpoint's ACT steps per token and over a split: ``gtx.pictures.plot_model.act``."""
    from gtx.pictures.plot_model import act

    return act(ref, examples, split, **kwargs)


__all__ = [
    "act",
    "attention",
    "frontier",
    "pattern",
    "pattern_grid",
    "results",
    "run_table",
    "curve_table",
    "own_metric",
    "save",
    "attention_bench",
]
