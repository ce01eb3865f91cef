"""``gtx sweep``: the click layer over gtx.sweeps.sweep (registered on the group by gtx/cli/__init__.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from gtx.cli.common import check_shortcuts, cli_error, device_option, plugins_dir_option, results_option, set_once
from gtx.errors import GtxError, Interrupted
from gtx.sweeps import grid as gr
from gtx.sweeps import sweep as sw
from gtx.sweeps.launch import SweepCells

# gtx run's shortcut options, here as comma lists: each is the --set key of the same name
SHORTCUTS = ("epochs", "max_steps", "batch_size", "layers", "heads", "dim", "dim_ff")


def _settings(ctx, param, values) -> dict[str, list[str]]:
    out = {}
    for item in values:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise click.BadParameter(
                f"{item!r}: write key=value or key=v1,v2, e.g. --set dim=32,64", ctx=ctx, param=param
            )
        if not value.strip():
            raise click.BadParameter(f"{item!r}: no values after '='", ctx=ctx, param=param)
        try:
            values = gr.split_list(value, f"--set {key.strip()}=")
        except GtxError as e:
            raise click.BadParameter(str(e), ctx=ctx, param=param) from None
        set_once(out, key.strip(), values)
    return out


def _shortcut_options(f):
    for name in reversed(SHORTCUTS):
        f = click.option(
            f"--{name.replace('_', '-')}", name, metavar="N[,N...]", help=f"Shortcut for --set {name}=..."
        )(f)
    return f


def grid_options(f):
    """The options a sweep and a frontier share: the grid's axes but the pattern, and how to run it."""
    options = [
        click.option("--task", metavar="A[,B...]", help="Tasks, comma-separated [default: copy]."),
        click.option("--model", metavar="A[,B...]", help="Models, comma-separated [default: transformer]."),
        click.option("--backend", metavar="A[,B...]", help="Attention backends, comma-separated [default: auto]."),
        click.option(
            "--seeds",
            "--seed",
            "seeds",
            metavar="SEEDS",
            help="Seeds: a range 0-4 (inclusive), a list 0,2,5, or both 0-2,7 [default: 0].",
        ),
        _shortcut_options,
        click.option(
            "--set",
            "settings",
            multiple=True,
            callback=_settings,
            metavar="KEY=V1[,V2...]",
            help="A setting as in gtx run; a comma list sweeps it, one value is a constant (repeatable).",
        ),
        device_option(default=None, help="Device of every run [default: auto]."),
        results_option("Results folder shared by the runs [default: results].", default=None),
        click.option(
            "-j", "--jobs", type=click.IntRange(min=1), help="Cells run at once, each in its own process [default: 1]."
        ),
        click.option(
            "--dry-run",
            is_flag=True,
            help="Print a `gtx run` command per cell still to run (for any scheduler); run nothing.",
        ),
        click.option(
            "--launcher",
            type=click.Choice(["local", "submitit"]),
            default="local",
            show_default=True,
            help="local: -j processes here; submitit: one job per cell through submitit (Slurm, or cluster=local), resumed when requeued.",
        ),
        click.option(
            "--executor-opt",
            "executor_opts",
            multiple=True,
            metavar="KEY=VALUE",
            help="A submitit executor option (cluster=slurm|local, timeout_min=60, slurm_partition=dev, ...); repeatable.",
        ),
        click.option(
            "--nproc-per-node",
            "nproc",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Processes per cell: above 1, each cell is one data-parallel run under torchrun (rank 0 writes).",
        ),
        click.option("--quiet", is_flag=True, help="No progress line; the summary and failures still print."),
        plugins_dir_option(passed="Folder of plugin .py files to load, also in every run (repeatable)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("grid_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--pattern",
    "patterns",
    multiple=True,
    metavar="SPEC",
    help="One pattern spec per occurrence, never split (specs hold commas: bigbird:b=2,r=1); repeat for more [default: full].",
)
@grid_options
def sweep(grid_file, patterns, dry_run, quiet, launcher, executor_opts, nproc, **options):
    """Run the cross product of the given lists, one `gtx run` per cell; resumable.

    \b
      gtx sweep --task copy,reverse --pattern full --pattern local:w=2 --seeds 0-2 --set epochs=1,2 -j 2
      gtx sweep grid.toml --seeds 3-5          (options override the file's keys)

    A cell with a complete run in --results is skipped, so running the same sweep again finishes an
    interrupted one: an incomplete run with a checkpoint is resumed (gtx run --resume), any other
    cell runs afresh. Each run's output goes to <results>/sweeps/<name>/logs/<cell>.log, <name> being
    the grid file's stem or grid-<hash>. --launcher submitit makes each cell a cluster job (Slurm, or
    --executor-opt cluster=local) that resumes when requeued; --nproc-per-node N runs each cell under
    torchrun. Exit status 1 if a cell failed, 2 on bad input (nothing runs), 130 on Ctrl-C (finished
    cells are kept).
    """
    try:
        grid, results_dir, jobs = read_grid(grid_file, patterns, **options)
        cells = sw.plan(grid, results_dir)
        launch = dict(launcher=launcher, executor_opts=executor_opts, nproc=nproc, plugins_dirs=options["plugins_dirs"])
        if run_cells(SweepCells(sw.sweep_name(grid_file, cells), cells, results_dir, jobs, **launch), dry_run, quiet):
            raise click.exceptions.Exit(1)
    except GtxError as e:  # also when called outside the gtx group, which converts them itself
        raise cli_error(e) from None


def read_grid(
    grid_file, patterns, task, model, backend, seeds, settings, device, results_dir, jobs, plugins_dirs, **shortcuts
):
    """The grid of the options (over the grid file's keys), its results folder and jobs; loads the plugins."""
    from gtx.plugins.registry import PATTERNS, load_plugins

    load_plugins(dirs=plugins_dirs)
    given = gr.read_grid_file(grid_file) if grid_file else {}
    for key, value in (("task", task), ("model", model), ("backend", backend)):
        if value is not None:
            given[key] = gr.split_list(value, f"--{key}")
    if patterns:
        given["pattern"] = [spec for text in patterns for spec in gr.split_patterns(text, PATTERNS.names())]
    lists = {k: gr.split_list(v, f"--{k.replace('_', '-')}") for k, v in shortcuts.items() if v is not None}
    check_shortcuts(lists, settings)
    given["settings"] = {**given.get("settings", {}), **lists, **settings}
    file_results, file_jobs = given.pop("results", None), given.pop("jobs", None)
    grid = gr.make_grid(
        **{**given, **({"seeds": seeds} if seeds is not None else {}), **({"device": device} if device else {})}
    )
    return grid, results_dir or file_results or "results", jobs or file_jobs or 1


def run_cells(sweep: SweepCells, dry_run: bool, quiet: bool) -> int:
    """Run (or with ``dry_run`` print) the sweep's cells not yet complete, with a progress line; the number that failed."""
    counts = sweep.counts()
    if sweep.rekeyed() and not quiet:
        click.echo(
            f"sweep {sweep.name}: {sweep.rekeyed()} of the complete cells are runs written before results schema 4, matched by "
            "keys recomputed from their stored settings (schema 3's keys could mix tasks)",
            err=True,
        )
    if dry_run:
        for line in sweep.dry_run_lines():
            click.echo(line)
        if not quiet:
            click.echo(
                f"sweep {sweep.name}: {counts.total} cells, {counts.skipped} complete, {counts.total - counts.skipped} to run",
                err=True,
            )
        return 0

    tty = sys.stderr.isatty()
    clear = "\r\x1b[K" if tty and not quiet else ""  # the progress line's place, before a message takes it
    shown = [""]

    def on_change(c: sw.Counts) -> None:
        if quiet:
            return
        if tty:
            click.echo(f"{clear}{c.line()}", nl=False, err=True)
        elif c.line() != shown[0]:  # in a log file, a line per change: a cell started, finished or run elsewhere
            shown[0] = c.line()
            click.echo(c.line(), err=True)

    def on_failure(f: sw.Failure) -> None:
        click.echo(
            f"{clear}cell {f.cell.index} ({f.cell.label}) failed with exit status "
            f"{f.returncode}: {f.message}; log: {f.log}",
            err=True,
        )

    started = time.monotonic()
    try:
        failures = sweep.run(counts, on_change, on_failure)
    except KeyboardInterrupt:  # the cells running are stopped (sw.execute, cluster.submit); finished ones stay
        click.echo(clear, nl=False, err=True)
        raise Interrupted(
            f"interrupted (Ctrl-C) with {counts.done} of the {counts.total - counts.skipped} cells of sweep {sweep.name} done; "
            "run the same command again to finish: finished cells are kept and skipped"
        ) from None
    if clear:
        click.echo(err=True)
    other = f", {counts.elsewhere} run by another sweep (run this one again when it ends)" if counts.elsewhere else ""
    click.echo(
        f"sweep {sweep.name}: {counts.total} cells: {counts.done} done, {counts.skipped} skipped, {counts.failed} failed{other} "
        f"in {time.monotonic() - started:.1f} s; logs in {sweep.log_dir()}"
    )
    return len(failures)
