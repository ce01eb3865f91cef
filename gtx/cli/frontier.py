"""``gtx frontier``: the click layer over gtx.sweeps.frontier (registered on the group by gtx/cli/__init__.py)."""

from __future__ import annotations

import click

from gtx.cli.common import cli_error, lengths_option, table_format_option
from gtx.cli.sweep import grid_options, read_grid, run_cells
from gtx.errors import GtxError
from gtx.sweeps import frontier as fr
from gtx.sweeps import frontier_tables as tables
from gtx.sweeps import sweep as sw
from gtx.sweeps.launch import SweepCells
from gtx.sweeps.study import ALL, DECODE, PREFILL, Study, parse_family


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--family",
    "families",
    multiple=True,
    metavar="NAME:P=B1,B2,...",
    help="A pattern and its budgets: the one parameter with several values (local:w=16,32,64; moba:b=16,k=2,4,8); repeatable.",
)
@click.option(
    "--prefill-family",
    "prefill_families",
    multiple=True,
    metavar="NAME:P=B1,B2,...",
    help="As --family, for a task scored by generation: the prompt read under each budget, generated tokens under "
    "full (decode_pattern=full); repeatable.",
)
@click.option(
    "--decode-family",
    "decode_families",
    multiple=True,
    metavar="NAME:P=B1,B2,...",
    help="As --family, for a task scored by generation: the prompt read under full, generated tokens under each "
    "budget (its decode_pattern); repeatable.",
)
@lengths_option(help="Sequence lengths: values of the task's seq_len or context setting.", metavar="L1[,L2...]")
@click.option(
    "--length-key", metavar="SETTING", help="The task setting the lengths set [default: seq_len, else context]."
)
@click.option(
    "--margin",
    type=float,
    default=0.01,
    show_default=True,
    help="Equivalence margin in the metric's units: a budget is equivalent to full when TOST says |difference| < margin.",
)
@click.option("--metric", help="Judge by this metric [default: each task's own, e.g. query_acc, bpc].")
@table_format_option()
@click.option(
    "--table-only",
    is_flag=True,
    help="Print the frontier of the runs already in --results; run nothing. Budgets and cells "
    "without a finished run are named, and the exit status is 1.",
)
@grid_options
def frontier(
    families,
    prefill_families,
    decode_families,
    lengths,
    length_key,
    margin,
    metric,
    fmt,
    table_only,
    dry_run,
    quiet,
    launcher,
    executor_opts,
    nproc,
    **options,
):
    """Accuracy against attention budget: every family's budgets and full, at every length, over seeds.

    \b
      gtx frontier --task recall --model lm --family local:w=16,32,64 --family moba:b=16,k=2,4 \\
          --lengths 256,512,1024 --seeds 0-2 --set epochs=2 -j 2
      gtx frontier --task niah --model hf --set path=smollm2 --epochs 0 --lengths 1024,2048 \\
          --prefill-family sinks:s=4,w=64,128 --decode-family quest:p=16,k=4,8 --set n_valid=50

    The cells run as one `gtx sweep` (resumable: run it again to finish an interrupted frontier;
    cells that any earlier sweep or frontier completed are reused). Then prints, per task, length and
    setting, each budget's measured density, edges per query and compression (full's keys per query
    over the budget's), the metric's mean ± std and 95% interval, tokens/s, training GFLOP, and a
    TOST of equivalence with full at --margin; per family the smallest budget equivalent to full;
    for a task scored by generation, each budget's paired test against full on the same samples
    (exact McNemar for 0/1 outcomes, else a paired bootstrap of the mean difference, seed 0) and per
    family the largest compression not significantly worse than full (one-sided p >= 0.05); and the
    cost front (across model sizes given as --set dim=32,64: the cheapest rows for their metric).
    A --prefill-family or --decode-family budget applies to the prompt or to the generated tokens
    alone, the other phase under full; their compression counts that phase's keys. Table and figure
    are saved under <results>/frontiers/, named by what the table was read with (metric, margin). A
    cell without a finished run (failed, not run with --table-only, or running in another sweep or
    frontier on the same folder) is named, and the table is printed but not saved. Exit 1 if a cell
    failed or is missing, 2 on bad input (nothing runs), 130 on Ctrl-C (finished cells are kept).
    """
    try:
        if not (families or prefill_families or decode_families):
            raise GtxError("give the budgets to study: --family, --prefill-family or --decode-family (each repeatable)")
        fr.check_margin(margin)  # before anything runs
        grid, results_dir, jobs = read_grid(None, (), **options)
        fr.check_metric(grid.task, metric)  # before the cells run, not after
        fr.check_margin(margin, fr.study_metrics(grid.task, metric))
        given = [(f, ALL) for f in families] + [(f, PREFILL) for f in prefill_families]
        given += [(f, DECODE) for f in decode_families]
        study = Study([parse_family(f, phase) for f, phase in given], [str(n) for n in lengths], grid, length_key)
        cells, points = fr.plan_study(study, results_dir)
        for note in study.notes:
            click.echo(f"note: {note}", err=True)
        failed = (
            0
            if table_only
            else run_cells(
                SweepCells(
                    sw.sweep_name(None, cells),
                    cells,
                    results_dir,
                    jobs,
                    launcher=launcher,
                    executor_opts=executor_opts,
                    nproc=nproc,
                    plugins_dirs=options["plugins_dirs"],
                ),
                dry_run,
                quiet,
            )
        )
        if dry_run:
            return
        from gtx.files import atomic_write
        from gtx.pictures import plot
        from gtx.pictures.figure import save
        from gtx.records.layout import ResultsFolder
        from gtx.records.results import format_table, load

        df = load(results_dir)
        table = fr.frontier_table(cells, points, df, margin, metric)
        if table.empty:
            raise GtxError(f"no runs of this frontier under {results_dir} yet; run it without --table-only")
        missing = fr.missing_cells(cells, df)
        click.echo(tables.format_frontier(table, fmt))
        click.echo(
            f"\nequivalent to full: TOST (Welch) p < {fr.ALPHA} that |{table.metric.iloc[0]} - full's| < {margin}; "
            "smallest such budget per family (fewest edges per query):"
        )
        click.echo(format_table(tables.equivalent_budgets(table), fmt))
        if table.pairs.notna().any():
            click.echo(
                f"\nnot worse than full: paired tests on the same samples (exact McNemar on 0/1 outcomes, else a paired "
                f"bootstrap), a budget significantly worse where one-sided p < {fr.ALPHA}; per family the largest compression "
                "(full's keys per query over the budget's) not significantly worse:"
            )
            click.echo(format_table(tables.largest_not_worse(table), fmt))
        click.echo(
            "\ncost front: per task and length, across sizes, families and budgets, the rows no cheaper row matches or beats:"
        )
        click.echo(tables.format_frontier(tables.cost_front(table), fmt))
        if missing:  # a partial table is printed as one, never saved as the study's reading
            lines = fr.describe_missing(missing, cells, points, results_dir)
            click.echo(
                f"\npartial frontier: {len(missing)} of {len(cells)} cells have no finished run (still to run, failed, or running "
                "elsewhere); the table above leaves them out and is not saved; run this command again when they end:",
                err=True,
            )
            for line in lines:
                click.echo(f"  {line}", err=True)
            raise click.exceptions.Exit(1)
        name = fr.reading_name(cells, table, margin)
        # not with_suffix: the margin's own dot would be taken for one
        folder = ResultsFolder(results_dir).frontiers()
        saved = folder / f"{name}.csv"
        atomic_write(saved, table.to_csv(index=False))
        figure = save(plot.frontier(table), folder / f"{name}.png")
        if not quiet:
            click.echo(f"\nfrontier table: {saved}; figure: {figure} (gtx report shows both)", err=True)
        if failed:
            raise click.exceptions.Exit(1)
    except GtxError as e:  # also when called outside the gtx group, which converts them itself
        raise cli_error(e) from None
