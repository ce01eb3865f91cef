"""``gtx plot`` and ``gtx report``: the click layer over gtx.plot and gtx.report (registered on the
group by gtx/cli.py). The figures are made by the library; commands only save them and print the path."""

from __future__ import annotations

import re
from pathlib import Path

import click

from gtx import plot as gtx_plot
from gtx.cli_common import GtxGroup, csv_list, plugins_dir_option
from gtx.errors import GtxError
from gtx.pattern import parse_pattern

RESULTS_HELP = "Folder of results tables (gtx run --results)."
FORMAT_HELP = "png, svg or pdf [default: the suffix of -o, else png]."


@click.group(cls=GtxGroup, context_settings={"help_option_names": ["-h", "--help"]})
def plot():
    """Figures: a pattern's adjacency, and accuracy against speed across runs. Each command prints the file it wrote."""


@plot.command(name="pattern")
@click.argument("spec")
@click.option("--src-len", type=click.IntRange(min=1), default=64, show_default=True, help="Source (encoder) length: ee, and the keys of ed.")
@click.option("--tgt-len", type=click.IntRange(min=1), help="Target (decoder) length: dd, and the queries of ed [default: --src-len].")
@click.option("--stages", default="ee,dd,ed", show_default=True, help="Stages to draw, comma-separated.")
@click.option("--max-cells", type=click.IntRange(min=1), default=gtx_plot.MAX_CELLS, show_default=True,
              help="Cells per side; longer sequences are binned into blocks shaded by their fraction of edges.")
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
@click.option("--results", "results_dir", default="results", show_default=True, type=click.Path(path_type=Path), help=RESULTS_HELP)
@click.option("--by", default="task,model", show_default=True, help="Columns that split the runs into panels (comma-separated).")
@click.option("--metric", default="best_valid_token_acc", show_default=True,
              help="best_valid_X (best over valid epochs) or test_X; X: token_acc, seq_acc, loss, or a task metric such as bpc.")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="File to write [default: <results>/plots/results.png].")
@click.option("--format", "fmt", help=FORMAT_HELP)
@plugins_dir_option
def plot_results(results_dir, by, metric, output, fmt):
    """Accuracy against training speed per pattern (mean and std over seeds, Pareto front), and learning curves."""
    df = _load(results_dir)
    fig = gtx_plot.results(df, by=csv_list(by), metric=metric)
    click.echo(gtx_plot.save(fig, output or results_dir / "plots" / f"results.{fmt or 'png'}", fmt))


@click.command()
@click.option("--results", "results_dir", default="results", show_default=True, type=click.Path(path_type=Path), help=RESULTS_HELP)
@click.option("--by", default="task,model", show_default=True, help="Panels of the results plot (comma-separated).")
@click.option("--metric", default="best_valid_token_acc", show_default=True, help="Metric of the results plot (as in gtx plot results).")
@click.option("-o", "--output", type=click.Path(path_type=Path), help="File to write [default: <results>/report.html].")
@plugins_dir_option
def report(results_dir, by, metric, output):
    """One self-contained HTML page of a results folder: the comparison table, the results plots, each
    pattern's picture and every run's configuration. Images are embedded: it opens from disk without a server."""
    from gtx.report import write_report

    click.echo(write_report(results_dir, output, by=csv_list(by), metric=metric))


def _load(results_dir: Path):
    from gtx.results import load

    df = load(results_dir)
    if df.empty:
        raise GtxError(f"no runs under {results_dir / 'runs'}; run `gtx run` first, or pass --results DIR")
    return df
