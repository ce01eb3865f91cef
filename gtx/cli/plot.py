"""``gtx plot`` and ``gtx report``: the click layer over gtx.pictures.plot and gtx.pictures.report (registered on the
group by gtx/cli/__init__.py). The figures are made by the library; commands only save them and print the path."""

from __future__ import annotations

import re
from pathlib import Path

import click

from gtx.cli.common import GtxGroup, csv_list, plugins_dir_option, results_option
from gtx.data.task import SPLITS
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.pictures import plot as gtx_plot
from gtx.records.layout import ResultsFolder

FORMAT_HELP = "png, svg or pdf [default: the suffix of -o, else png]."


@click.group(cls=GtxGroup, context_settings={"help_option_names": ["-h", "--help"]})
def plot():
    """Figures: a pattern's adjacency, accuracy against speed across runs, a trained model's attention
    weights and ACT steps. Each command prints the file it wrote."""


@plot.command(name="pattern")
@click.argument("spec")
@click.option(
    "--src-len",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Source (encoder) length: ee, and the keys of ed.",
)
@click.option(
    "--tgt-len",
    type=click.IntRange(min=1),
    help="Target (decoder) length: dd, and the queries of ed [default: --src-len].",
)
@click.option("--stages", default="ee,dd,ed", show_default=True, help="Stages to draw, comma-separated.")
@click.option(
    "--max-cells",
    type=click.IntRange(min=1),
    default=gtx_plot.MAX_CELLS,
    show_default=True,
    help="Cells per side; longer sequences are binned into blocks shaded by their fraction of edges.",
)
@click.option("-o", "--output", type=click.Path(path_type=Path), help="File to write [default: ./pattern-<spec>.png].")
@click.option("--format", "fmt", help=FORMAT_HELP)
@plugins_dir_option
def plot_pattern(spec, src_len, tgt_len, stages, max_cells, output, fmt):
    """Draw SPEC's adjacency per stage: rows are queries, columns keys, dark cells edges.

    Up to 100,000 positions per side; beyond --max-cells the picture is drawn in blocks.

    \b
    Example:
      gtx plot pattern 'local:w=64|strided:l=64' --tgt-len 4096 --stages dd"""
    p = parse_pattern(spec)
    fig = gtx_plot.pattern(p, src_len=src_len, tgt_len=tgt_len, stages=csv_list(stages), max_cells=max_cells)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", p.spec).strip("-")
    click.echo(gtx_plot.save(fig, output or Path(f"pattern-{slug}.{fmt or 'png'}"), fmt))


@plot.command(name="results")
@results_option(path=True)
@click.option(
    "--by", default="task,model", show_default=True, help="Columns that split the runs into panels (comma-separated)."
)
@click.option(
    "--metric",
    help="best_valid_X (best over valid epochs) or test_X; X: token_acc, seq_acc, loss, or a task metric such as bpc "
    "[default: each task's own, as gtx compare picks it: bpc for text, query_acc for recall, token_acc for copy].",
)
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), help="File to write [default: <results>/plots/results.png]."
)
@click.option("--format", "fmt", help=FORMAT_HELP)
@plugins_dir_option
def plot_results(results_dir, by, metric, output, fmt):
    """Each task's metric against training speed per pattern (mean and std over seeds, Pareto front), and learning curves."""
    df = _load(results_dir)
    fig = gtx_plot.results(df, by=csv_list(by), metric=metric)
    click.echo(gtx_plot.save(fig, output or ResultsFolder(results_dir).plot(f"results.{fmt or 'png'}"), fmt))


CHECKPOINT_HELP = "Where a run's checkpoint is looked up (<results>/checkpoints/<run_id>/best.pt)."


@plot.command(name="attention")
@click.argument("checkpoint")
@click.option("--example", type=int, default=0, show_default=True, help="Index of the example in --split.")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@click.option(
    "--layer",
    type=int,
    help="Layer to draw, 0-based (ACT models: step) [default: the last; ACT: the step with the most queries active].",
)
@click.option("--head", type=int, help="Head to draw, 0-based [default: the mean over heads].")
@results_option(CHECKPOINT_HELP, path=True)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="File to write [default: <results>/plots/attention-<run_id>-<split>-<example>.png].",
)
@click.option("--format", "fmt", help=FORMAT_HELP)
@plugins_dir_option
def plot_attention(checkpoint, example, split, layer, head, results_dir, output, fmt):
    """Draw a trained model's attention weights on one example, per stage: queries on rows, keys on
    columns, token labels; cells that are not edges of the pattern are light grey.

    CHECKPOINT is a .pt file or a run under --results (its id, a unique prefix or its 6-hex tail).
    The decoder is teacher forced.

    \b
    Example:
      gtx plot attention results/checkpoints/<run_id>/best.pt --example 3 --head 0"""
    fig = gtx_plot.attention(checkpoint, example, split, layer, head, results_dir=str(results_dir))
    click.echo(
        gtx_plot.save(
            fig,
            output
            or ResultsFolder(results_dir).plot(
                f"attention-{_run_name(checkpoint, results_dir)}-{split}-{example}.{fmt or 'png'}"
            ),
            fmt,
        )
    )


@plot.command(name="act")
@click.argument("checkpoint")
@click.option(
    "--example",
    "examples",
    type=int,
    multiple=True,
    default=[0],
    show_default=True,
    help="Example index in --split (repeatable).",
)
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@results_option(CHECKPOINT_HELP, path=True)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="File to write [default: <results>/plots/act-<run_id>-<split>.png].",
)
@click.option("--format", "fmt", help=FORMAT_HELP)
@plugins_dir_option
def plot_act(checkpoint, examples, split, results_dir, output, fmt):
    """Draw an ACT model's steps per token of some examples, and their distribution over the split
    (ut, or lm/encoder with --set universal=true).

    \b
    Example:
      gtx plot act <run_id> --example 0 --example 1"""
    fig = gtx_plot.act(checkpoint, examples, split, results_dir=str(results_dir))
    click.echo(
        gtx_plot.save(
            fig,
            output
            or ResultsFolder(results_dir).plot(f"act-{_run_name(checkpoint, results_dir)}-{split}.{fmt or 'png'}"),
            fmt,
        )
    )


def _run_name(ref: str, results_dir: Path) -> str:
    """The run id of a checkpoint under <results>/checkpoints/<run_id>/, else the file's stem."""
    from gtx.records.runref import find_checkpoint

    path = find_checkpoint(ref, results_dir)
    return path.parent.name if path.parent.parent.name == ResultsFolder(results_dir).checkpoints().name else path.stem


@click.command()
@results_option(path=True)
@click.option("--by", default="task,model", show_default=True, help="Panels of the results plot (comma-separated).")
@click.option("--metric", help="Metric of the results plot (as in gtx plot results) [default: each task's own].")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="File to write [default: <results>/report.html].")
@plugins_dir_option
def report(results_dir, by, metric, output):
    """One self-contained HTML page of a results folder: the comparison table, the results plots, each
    pattern's picture and every run's configuration. Images are embedded: it opens from disk without a server."""
    from gtx.pictures.report import write_report

    click.echo(write_report(results_dir, output, by=csv_list(by), metric=metric))


def _load(results_dir: Path):
    from gtx.records.results import load

    df = load(results_dir)
    if df.empty:
        raise GtxError(f"no runs under {ResultsFolder(results_dir).runs()}; run `gtx run` first, or pass --results DIR")
    return df
