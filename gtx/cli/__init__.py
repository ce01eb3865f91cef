"""gtx command line: a thin click layer over the runner and the registries.

    gtx run --pattern local --model ut      train and evaluate; results appended under results/
    gtx eval RUN_ID --pattern local:w=2      a trained model under any pattern
    gtx compare                             accuracy against speed, across runs, over seeds
    gtx patterns | models | tasks | backends
    gtx show-pattern local:w=2 --src-len 8 --tgt-len 6

Commands with modules of their own: the listings and ``gtx show-pattern`` (listing.py), ``gtx sweep``
(sweep.py), ``gtx plot`` and ``gtx report`` (plot.py), ``gtx bench`` (bench.py), ``gtx runs`` and
``gtx show RUN`` (runs.py), ``gtx frontier`` (frontier.py), ``gtx generate`` and ``gtx export``
(pretrained.py: the hf model plugin's models).
docs/cli.md holds every command's help (reference.py writes it).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import click
import pandas as pd

from gtx import __version__
from gtx.cli.bench import bench
from gtx.cli.common import (
    CliError,
    GtxGroup,
    check_shortcuts,
    count_option,
    device_option,
    pattern_option,
    plugins_dir_option,
    progress_lines,
    results_option,
    settings_option,
    table_format_option,
)
from gtx.cli.frontier import frontier
from gtx.cli.listing import backends, models, patterns, plugins_list, show_pattern, tasks
from gtx.cli.plot import plot, report
from gtx.cli.pretrained import export, generate
from gtx.cli.runs import runs, show
from gtx.cli.sweep import sweep
from gtx.errors import GtxError, PluginError
from gtx.plugins.registry import call_each, load_plugins
from gtx.records.layout import ResultsFolder
from gtx.records.results import format_table
from gtx.run.distributed import is_main_process
from gtx.run.runner import DEFAULT_BACKEND
from gtx.run.train import TrainConfig


@click.group(cls=GtxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gtx")
def cli():
    """gtx: sparse attention patterns as token graphs; train, measure and compare them."""


@cli.command()
@click.option("--task", default="copy", show_default=True, help="Task name (gtx tasks).")
@click.option("--model", default="transformer", show_default=True, help="Model name (gtx models).")
@pattern_option("Pattern spec, e.g. local:w=4 or 'local:w=2|strided:l=8' (gtx patterns).", "full")
@click.option(
    "--decode-pattern",
    help="The pattern each generated token reads its keys by, where the task is scored by generation "
    "(the prompt is read under --pattern) [default: --pattern].",
)
@click.option("--backend", default=DEFAULT_BACKEND, show_default=True, help="Attention backend (gtx backends).")
@click.option(
    "--epochs",
    type=click.IntRange(min=0),
    help=f"Training epochs; 0 scores the model untrained (a pretrained one) [default: {TrainConfig.epochs}].",
)
@count_option("--max-steps", help="Stop after this many optimizer steps.")
@count_option("--batch-size", help=f"Examples per batch [default: {TrainConfig.batch_size}].")
@count_option("--layers", help="Model layers (model setting).")
@count_option("--heads", help="Attention heads (model setting).")
@count_option("--dim", help="Model width d_model (model setting).")
@count_option("--dim-ff", help="Feed-forward width (model setting).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of initialisation, dropout and shuffling.")
@device_option()
@results_option()
@settings_option()
@click.option(
    "--log",
    "loggers",
    multiple=True,
    metavar="NAME",
    help="Also log to NAME (repeatable): tensorboard, or a plugin's logger.",
)
@click.option(
    "--resume",
    metavar="RUN",
    help="Continue a killed run (its id, a unique prefix or its 6-hex tail) from its last checkpoint under "
    "--results; its own configuration is used.",
)
@click.option("--quiet", is_flag=True, help="No progress bar or per-epoch lines.")
@plugins_dir_option
def run(
    task,
    model,
    pattern,
    decode_pattern,
    backend,
    epochs,
    max_steps,
    batch_size,
    layers,
    heads,
    dim,
    dim_ff,
    seed,
    device,
    results_dir,
    settings,
    loggers,
    resume,
    quiet,
):
    """Train and evaluate one model under one pattern; append the results.

    Each epoch writes a checkpoint under <results>/checkpoints/<run_id>/ (last.pt, and best.pt for
    the lowest valid loss). Under `torchrun --nproc-per-node N gtx run ...` the batches are split
    over N processes (data parallel)."""
    from tqdm import tqdm

    from gtx.measure.load import busy_note
    from gtx.run.runner import RunConfig
    from gtx.run.runner import run as run_experiment

    if resume is not None:  # the checkpoint's configuration is the run's: an option given beside it would be ignored
        ctx = click.get_current_context()
        given = [
            p.opts[0]
            for p in ctx.command.params
            if p.name not in ("resume", "results_dir", "quiet", "plugins_dir")
            and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE
        ]
        if given:
            raise CliError(
                f"--resume {resume} continues the run with its own settings; drop {', '.join(given)}, or start a new run with them"
            )
    shortcuts = {
        "epochs": epochs,
        "max_steps": max_steps,
        "batch_size": batch_size,
        "layers": layers,
        "heads": heads,
        "dim": dim,
        "dim_ff": dim_ff,
        "decode_pattern": decode_pattern,
    }
    given = {k: str(v) for k, v in shortcuts.items() if v is not None}
    check_shortcuts(given, settings)
    settings = {**given, **settings}
    config = RunConfig(
        task=task,
        model=model,
        pattern=pattern,
        backend=backend,
        device=device,
        seed=seed,
        results_dir=results_dir,
        settings=settings,
        loggers=list(loggers),
    )

    def progress(description, total, unit="batch"):
        if quiet:
            return lambda: None
        if sys.stderr.isatty():
            bar = tqdm(total=total, desc=description, leave=False, unit=unit)
            return lambda: bar.update() if bar.n + 1 < total else bar.close()
        return progress_lines(description, total, lambda s: click.echo(s, err=True), unit=unit)

    log = (lambda s: None) if quiet else (lambda s: click.echo(s, err=True))
    # one process looks, alone: torchrun's other ranks are this run's own load, not another's
    alone = is_main_process() and os.environ.get("WORLD_SIZE", "1") == "1"
    note = busy_note("its wall_s and tokens_per_s") if alone else None
    if note:
        click.echo(f"warning: {note}", err=True)
    rows = run_experiment(config, progress=progress, log=log, resume=resume)
    if is_main_process():
        _summary(rows[(rows.epoch == rows.epoch.max())], results_dir)


def _summary(rows: pd.DataFrame, results_dir: str) -> None:
    """Some rows as ``gtx show`` prints them (the task's own metrics beside the common columns), and their file."""
    from gtx.records.runs import rows_table

    click.echo(format_table(rows_table(rows)))
    click.echo(f"results: {ResultsFolder(results_dir).run_table(rows.run_id.iloc[0])}")


@cli.command(name="eval")
@click.argument("checkpoint")
@click.option("--split", type=click.Choice(["train", "valid", "test"]), default="test", show_default=True)
@count_option(
    "--beam", help="Beam width for decoding (seq2seq), at most the target vocabulary's size [default: the task's]."
)
@pattern_option("Evaluate under this pattern instead of the one it was trained with.")
@click.option("--backend", help="Attention backend [default: the run's].")
@device_option()
@results_option("Folder to append to [default: the checkpoint's].", default=None)
@plugins_dir_option
def eval_checkpoint(checkpoint, split, beam, pattern, backend, device, results_dir):
    """Evaluate a trained model: CHECKPOINT is a .pt file or a run under --results (its best.pt): its id,
    a unique prefix, or the 6 hex digits `gtx runs` prints.

    The rows are appended as a run of their own whose eval_of column names the trained run."""
    from gtx.run.evaluation import evaluate_checkpoint

    rows = evaluate_checkpoint(
        checkpoint, results_dir, split=split, beam=beam, pattern=pattern, backend=backend, device=device
    )
    setup = json.loads(rows.config.iloc[0])
    stage = f" ({setup['attention_stage']})" if setup.get("attention_stage") else ""
    click.echo(
        f"run {rows.eval_of.iloc[0]} (trained with {setup['trained_pattern']}) evaluated under {rows.pattern.iloc[0]}{stage} on {split}:",
        err=True,
    )
    _summary(rows, json.loads(rows.config.iloc[0])["results_dir"])


@cli.command()
@results_option()
@click.option(
    "--by",
    default="task,model,pattern,backend",
    show_default=True,
    help="Columns to group runs by (comma-separated); a group holds one experiment: runs that differ only by seed.",
)
@click.option(
    "--metric",
    default=None,
    help="The metric for the 95% interval (ci95), Welch's t-test against full (vs_full at p < 0.05) and the Pareto front against "
    "train tokens/s: token_acc, seq_acc, test_seq_acc, loss, or a task's own such as bpc (lower is better for loss, bpc, per) "
    "[default: each task's own: bpc for text, query_acc for recall, token_acc for copy, ...].",
)
@click.option(
    "--evals",
    is_flag=True,
    help="Compare gtx eval runs instead: each checkpoint under another pattern beside the same "
    "checkpoint under its training pattern (paired t-test over the runs).",
)
@table_format_option(
    "csv: plain numbers (<metric>_mean, _std, _ci_low, _ci_high, p_vs_full, ...); table, markdown: mean ± std over seeds.",
)
@plugins_dir_option
def compare(results_dir, by, metric, evals, fmt):
    """Compare runs over seeds: accuracy (mean ± std, 95% interval) against training speed, tested against the full pattern.

    Runs pool only when they are one experiment (everything but the seed equal); where the --by
    columns leave several in one group, the group is split and a settings column says what differs.
    Only finished runs count (they have test rows); runs still training or stopped are named on stderr."""
    from gtx.records.compare import compare as compare_runs
    from gtx.records.compare import compare_evals, format_compare
    from gtx.records.results import load

    df = load(results_dir)
    if df.empty:
        raise CliError(f"no runs under {ResultsFolder(results_dir).runs()}; run `gtx run` first, or pass --results DIR")
    table = (compare_evals if evals else compare_runs)(df, [by], metric)
    click.echo(format_compare(table, fmt))
    if unfinished := table.attrs.get("unfinished"):  # said apart from the table, which stays parseable
        shown = ", ".join(unfinished[:5]) + (f" and {len(unfinished) - 5} more" if len(unfinished) > 5 else "")
        click.echo(
            f"left out {len(unfinished)} unfinished run(s), without test rows yet (still training, or stopped): {shown}",
            err=True,
        )


for command in (
    patterns,
    backends,
    show_pattern,
    models,
    tasks,
    plugins_list,
    bench,
    export,
    frontier,
    generate,
    plot,
    report,
    runs,
    show,
    sweep,
):  # commands with modules of their own
    cli.add_command(command)


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"  # not the source file and line of the code that warned: the user did not write it


def _keeps_commands(builtin: dict):
    """A check that a plugin's ``register_commands`` left gtx's own commands in place."""

    def check(label: str) -> None:
        for name, command in builtin.items():
            if cli.commands.get(name) is not command:
                raise PluginError(
                    f"plugin {label} replaces gtx's command {name!r} in register_commands; give its command another name"
                )

    return check


def main(argv=None):
    """Console entry point: load plugins (so plugins can add commands), then run the CLI."""
    warnings.formatwarning = _one_line
    try:
        load_plugins()
        call_each("register_commands", after=_keeps_commands(dict(cli.commands)), cli=cli)
    except GtxError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    cli.main(args=argv, prog_name="gtx")


if __name__ == "__main__":
    main()
