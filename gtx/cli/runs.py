"""``gtx runs`` and ``gtx show RUN``: what the runs of a results folder were (the logic: gtx/records/runs.py)."""

from __future__ import annotations

import json

import click

from gtx.cli.common import CliError, plugins_dir_option, results_option
from gtx.plugins.registry import task_metrics
from gtx.records import results
from gtx.records import runs as runlist
from gtx.records.layout import ResultsFolder


def _load(results_dir: str):
    df = results.load(results_dir)
    if df.empty:
        raise CliError(f"no runs under {ResultsFolder(results_dir).runs()}; run `gtx run` first, or pass --results DIR")
    return df


@click.command()
@results_option()
@click.option("--task", help="Only runs of this task.")
@click.option("--model", help="Only runs of this model.")
@click.option("--pattern", help="Only runs of this pattern (its canonical spec, as listed).")
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "csv"]), default="table", show_default=True)
@plugins_dir_option
def runs(results_dir, task, model, pattern, fmt):
    """List the runs under a results folder, newest last.

    Per run: its names and seed; status: finished (it has test rows), `eval of ID` (a gtx eval of
    run ID), or incomplete (killed or still running: the rows cannot tell which; `resumable` where
    its last.pt exists: gtx run --resume RUN_ID); epochs done of planned; the task's own metric
    (bpc for text, query_acc for recall, ...) at its best valid epoch (lower is better for loss, bpc,
    per); and the settings that differ between the listed runs (epochs=4 n_train=300)."""
    df = _load(results_dir)
    chosen = {"task": task, "model": model, "pattern": pattern}
    for column, value in chosen.items():
        if value is not None:
            df = df[df[column] == value]
    if df.empty:
        asked = " ".join(f"--{k} {v}" for k, v in chosen.items() if v is not None)
        raise CliError(
            f"no runs match {asked} under {ResultsFolder(results_dir).runs()}; `gtx runs` without filters lists them all"
        )
    click.echo(results.format_table(runlist.summary(df, results_dir, task_metrics()), fmt))


@click.command()
@click.argument("run")
@results_option()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: the run's resolved configuration only, for scripts.",
)
@plugins_dir_option
def show(run, results_dir, fmt):
    """Describe one run: RUN is its id or a unique prefix or suffix of it (the trailing 6 hex digits).

    Its status, names, resolved model, task and train settings, versions, rows and checkpoints."""
    df = _load(results_dir)
    run_id = runlist.find_run(df, run)
    if fmt == "json":
        click.echo(json.dumps(runlist.config_of(df[df.run_id == run_id]), indent=2, sort_keys=True))
    else:
        click.echo(runlist.describe(df, run_id, results_dir))
