"""gtx command line: a thin click layer over the runner and the registries.

    gtx run --pattern local --model ut      train and evaluate; results appended under results/
    gtx compare                             accuracy against speed, across runs
    gtx patterns | models | tasks | backends
    gtx show-pattern local:w=2 --src-len 8 --tgt-len 6
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click
import pandas as pd

from gtx import __version__
from gtx.errors import GtxError
from gtx.graph import EdgeSet, possible_edges
from gtx.model import model_forms
from gtx.pattern import STAGE_NAMES, STAGES, describe_params, is_modifier, parse_pattern
from gtx.plugins import BACKENDS, MODELS, PATTERNS, TASKS, call_each, label_of, load_plugins, pm
from gtx.results import format_table, scalar_metrics
from gtx.runner import DEFAULT_BACKEND
from gtx.train import TrainConfig


class CliError(click.ClickException):
    """Printed as one line, ``Error: ...``, exit code 2."""

    exit_code = 2


class GtxGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except GtxError as e:
            raise CliError(str(e)) from None


def plugins_dir_option(f):
    """``--plugins-dir DIR`` on every command: load that folder's ``*.py`` plugins first."""

    def load(ctx, param, value):
        try:
            load_plugins(dirs=value)
        except GtxError as e:
            raise CliError(str(e)) from None
        return value

    return click.option(
        "--plugins-dir",
        multiple=True,
        type=click.Path(file_okay=False, path_type=Path),
        callback=load,
        expose_value=False,
        is_eager=True,
        help="Folder of plugin .py files to load (repeatable; also GTX_PLUGINS_DIR).",
    )(f)


@click.group(cls=GtxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gtx")
def cli():
    """gtx: sparse attention patterns as token graphs; train, measure and compare them."""


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


@cli.command()
@plugins_dir_option
def patterns():
    """List attention patterns with their parameters."""
    rows = [("NAME", "PARAMETERS", "DESCRIPTION")]
    for name, entry in sorted(PATTERNS.entries().items()):
        shown = f"{name}(PATTERN)" if is_modifier(entry.obj) else name
        rows.append((shown, describe_params(entry.obj) or "-", entry.description))
    click.echo(_table(rows))


@cli.command()
@plugins_dir_option
def backends():
    """List attention backends and whether each is available here."""
    rows = [("NAME", "AVAILABLE", "DESCRIPTION")]
    for name, entry in sorted(BACKENDS.entries().items()):
        reason = entry.obj.available("cpu")
        rows.append((name, "yes" if reason is None else f"no: {reason}", entry.description))
    click.echo(_table(rows))


@cli.command(name="show-pattern")
@click.argument("pattern")
@click.option("--src-len", type=click.IntRange(min=1), default=12, show_default=True, help="Source (encoder) length.")
@click.option("--tgt-len", type=click.IntRange(min=1), default=10, show_default=True, help="Target (decoder) length.")
@click.option("--max-width", type=click.IntRange(min=1), default=120, show_default=True, help="Largest grid printed.")
@plugins_dir_option
def show_pattern(pattern, src_len, tgt_len, max_width):
    """Print each stage's adjacency (rows: queries, columns: keys; '#' = edge)."""
    p = parse_pattern(pattern)
    click.echo(f"pattern {p.spec}   src_len={src_len} tgt_len={tgt_len}   (row = query, column = key, # = edge)")
    sizes = {"ee": (src_len, src_len), "dd": (tgt_len, tgt_len), "ed": (tgt_len, src_len)}
    for stage in STAGES:
        n_q, n_k = sizes[stage]
        src, dst = p.edges(stage, n_q, n_k)
        density = src.numel() / possible_edges(EdgeSet(src, dst, n_k, n_q, stage))
        click.echo(
            f"\n{stage} ({STAGE_NAMES[stage]}): {n_q} queries x {n_k} keys, {src.numel()} edges, "
            f"density {density:.3f}{' of the causal triangle' if stage == 'dd' else ''}, {src.numel() / n_q:.2f} edges per query"
        )
        if max(n_q, n_k) > max_width:
            click.echo(f"  (grid not printed: wider than --max-width {max_width})")
            continue
        grid = [["."] * n_k for _ in range(n_q)]
        for s, d in zip(src.tolist(), dst.tolist()):
            grid[d][s] = "#"
        for i, row in enumerate(grid):
            click.echo(f"  {i:>4} {''.join(row)}")


def _settings_of(config_cls) -> str:
    if config_cls is None:
        return "-"
    return ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(config_cls))


def _list_registry(registry, form) -> None:
    """Name, task form(s) (``form(cls)``), description and settings of each entry."""
    rows = [("NAME", "FORM", "DESCRIPTION", "SETTINGS (--set key=value)")]
    for name, entry in sorted(registry.entries().items()):
        rows.append((name, form(entry.obj), entry.description, _settings_of(entry.config)))
    click.echo(_table(rows))


@cli.command()
@plugins_dir_option
def models():
    """List models, the task forms they serve and their settings."""
    _list_registry(MODELS, lambda cls: ",".join(model_forms(cls)))


@cli.command()
@plugins_dir_option
def tasks():
    """List tasks, their form (seq2seq, lm, classify) and their settings."""
    _list_registry(TASKS, lambda cls: cls.form)


def _key_value(ctx, param, values):
    out = {}
    for item in values:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{item!r}: write key=value, e.g. --set dim=64", ctx=ctx, param=param)
        out[key.strip()] = value.strip()
    return out


@cli.command()
@click.option("--task", default="copy", show_default=True, help="Task name (gtx tasks).")
@click.option("--model", default="transformer", show_default=True, help="Model name (gtx models).")
@click.option("--pattern", default="full", show_default=True, help="Pattern spec, e.g. local:w=4 or 'local:w=2|strided:l=8' (gtx patterns).")
@click.option("--backend", default=DEFAULT_BACKEND, show_default=True, help="Attention backend (gtx backends).")
@click.option("--epochs", type=click.IntRange(min=1), help=f"Training epochs [default: {TrainConfig.epochs}].")
@click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this many optimizer steps.")
@click.option("--batch-size", type=click.IntRange(min=1), help=f"Examples per batch [default: {TrainConfig.batch_size}].")
@click.option("--layers", type=click.IntRange(min=1), help="Model layers (model setting).")
@click.option("--heads", type=click.IntRange(min=1), help="Attention heads (model setting).")
@click.option("--dim", type=click.IntRange(min=1), help="Model width d_model (model setting).")
@click.option("--dim-ff", type=click.IntRange(min=1), help="Feed-forward width (model setting).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of initialisation, dropout and shuffling.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--results", "results_dir", default="results", show_default=True, type=click.Path(file_okay=False), help="Folder for the results tables.")
@click.option("--set", "settings", multiple=True, callback=_key_value, metavar="KEY=VALUE", help="Any model, task or training setting (repeatable).")
@click.option("--quiet", is_flag=True, help="No progress bar or per-epoch lines.")
@plugins_dir_option
def run(task, model, pattern, backend, epochs, max_steps, batch_size, layers, heads, dim, dim_ff, seed, device, results_dir, settings, quiet):
    """Train and evaluate one model under one pattern; append the results."""
    from tqdm import tqdm

    from gtx.runner import RunConfig
    from gtx.runner import run as run_experiment

    shortcuts = {"epochs": epochs, "max_steps": max_steps, "batch_size": batch_size, "layers": layers, "heads": heads, "dim": dim, "dim_ff": dim_ff}
    settings = {**{k: str(v) for k, v in shortcuts.items() if v is not None}, **settings}
    config = RunConfig(task=task, model=model, pattern=pattern, backend=backend, device=device, seed=seed, results_dir=results_dir, settings=settings)

    def progress(description, total):
        bar = tqdm(total=total, desc=description, leave=False, disable=quiet or None, unit="batch")
        return lambda: bar.update() if bar.n + 1 < total else bar.close()

    log = (lambda s: None) if quiet else (lambda s: click.echo(s, err=True))
    rows = run_experiment(config, progress=progress, log=log)
    last = rows[(rows.epoch == rows.epoch.max())]
    cols = ["split", "epoch", "loss", "token_acc", "seq_acc", "tokens_per_s", "wall_s", "act_mean_steps"]
    # the task's own scalar metrics (bpc, query_acc, bleu, ...) beside the common columns
    metrics = pd.DataFrame([scalar_metrics(json.loads(m)) for m in last.metrics], index=last.index)
    click.echo(format_table(pd.concat([last[cols], metrics.drop(columns=[c for c in metrics if c in cols])], axis=1)))
    click.echo(f"results: {Path(results_dir) / 'runs' / (rows.run_id.iloc[0] + '.csv')}")


@cli.command()
@click.option("--results", "results_dir", default="results", show_default=True, type=click.Path(file_okay=False), help="Folder of results tables.")
@click.option("--by", default="task,model,pattern,backend", show_default=True, help="Columns to group runs by (comma-separated).")
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "csv"]), default="table", show_default=True)
@plugins_dir_option
def compare(results_dir, by, fmt):
    """Compare runs: best accuracy against training speed, relative to the full pattern."""
    from gtx import results

    df = results.load(results_dir)
    if df.empty:
        raise CliError(f"no runs under {Path(results_dir) / 'runs'}; run `gtx run` first, or pass --results DIR")
    click.echo(results.format_table(results.compare(df, [c.strip() for c in by.split(",") if c.strip()]), fmt))


@cli.group()
def bench():
    """Benchmarks: attention kernels, and training throughput. Tables land under <results>/bench/."""


def _csv_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@bench.command(name="attention")
@click.option("--pattern", "patterns", multiple=True, default=["local:w=32"], show_default=True, help="Pattern spec (repeatable).")
@click.option("--lengths", default="1024,2048,4096,8192", show_default=True, help="Sequence lengths, comma-separated.")
@click.option("--backends", default="dense,dgl,blocksparse,auto", show_default=True,
              help="Backends, comma-separated; sdpa is plain torch's SDPA (is_causal, unmasked or a boolean mask), for reference.")
@click.option("--heads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--head-dim", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Timed repeats (median).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "csv"]), default="table", show_default=True)
@click.option("--results", "results_dir", default="results", show_default=True, type=click.Path(file_okay=False))
@click.option("--plot/--no-plot", default=True, show_default=True, help="Also write a log-log PNG (needs matplotlib).")
@click.option("--plugins-dir", "plugins_dirs", multiple=True, type=click.Path(file_okay=False), help="Plugin folders (also for the subprocesses).")
def bench_attention(patterns, lengths, backends, heads, head_dim, repeats, device, fmt, results_dir, plot, plugins_dirs):
    """Forward + backward time and peak memory per (pattern, length, backend)."""
    from gtx import bench as gtx_bench
    from gtx.runner import resolve_device

    load_plugins(dirs=plugins_dirs)
    names = _csv_list(backends)
    dev = resolve_device(device)
    for name in names:
        if name != gtx_bench.SDPA:  # plain torch, for reference: not a gtx backend
            BACKENDS.get(name)
    specs = [parse_pattern(p).spec for p in patterns]
    sizes = [int(n) for n in _csv_list(lengths)]
    df = gtx_bench.bench_attention(specs, sizes, names, heads, head_dim, repeats, device=str(dev), plugins_dirs=plugins_dirs,
                                   log=lambda s: click.echo(s, err=True))
    path = gtx_bench.save(df, results_dir, "attention")
    click.echo(format_table(df, fmt))
    click.echo(f"table: {path}", err=True)
    if plot:
        try:
            click.echo(f"plot: {gtx_bench.plot_attention(df, path.with_suffix('.png'))}", err=True)
        except GtxError as e:
            click.echo(f"no plot: {e}", err=True)


@bench.command(name="calibrate")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--head-dim", type=click.IntRange(min=1), default=32, show_default=True)
def bench_calibrate(device, heads, head_dim):
    """Measure the auto backend's cost constants on this machine and save them for auto to use."""
    from gtx import bench as gtx_bench
    from gtx.runner import resolve_device

    fitted = gtx_bench.calibrate(str(resolve_device(device)), heads, head_dim, log=lambda s: click.echo(s, err=True))
    for kind, (a, o) in sorted(fitted.items()):
        click.echo(f"{kind:<12} {a:.3e} s per unit of work + {1000 * o:.3f} ms per call")


@bench.command(name="train")
@click.option("--task", default="copy", show_default=True)
@click.option("--model", default="transformer", show_default=True)
@click.option("--pattern", "patterns", multiple=True, default=["full"], show_default=True, help="Pattern spec (repeatable: one table).")
@click.option("--backends", default="auto,dgl,dgl-seed", show_default=True, help="Backends, comma-separated.")
@click.option("--steps", type=click.IntRange(min=1), default=30, show_default=True, help="Timed training steps.")
@click.option("--set", "settings", multiple=True, callback=_key_value, metavar="KEY=VALUE", help="Model, task or training setting.")
@click.option(
    "--rounds", type=click.IntRange(min=1), default=3, show_default=True,
    help="Interleaved rounds of --steps per variant; rows report the median round.",
)
@click.option(
    "--baseline/--no-baseline", default=True, show_default=True,
    help="Also time the model's plain-torch references (transformer: torch.nn.Transformer; lm: torch SDPA is_causal, and with each pattern's bool mask).",
)
@click.option("--bound/--no-bound", default=True, show_default=True, help="Also time the model with attention skipped: the ceiling for any backend.")
@click.option("--memory/--no-memory", default=True, show_default=True, help="Also measure each row's peak memory, each in a fresh process.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "csv"]), default="table", show_default=True)
@click.option("--results", "results_dir", default="results", show_default=True, type=click.Path(file_okay=False))
@click.option("--plugins-dir", "plugins_dirs", multiple=True, type=click.Path(file_okay=False), help="Plugin folders (also for the subprocesses).")
def bench_train(task, model, patterns, backends, steps, rounds, settings, baseline, bound, memory, device, fmt, results_dir, plugins_dirs):
    """Training tokens/s and peak memory per (pattern, backend) on the same batches, beside plain-torch references."""
    from gtx import bench as gtx_bench

    load_plugins(dirs=plugins_dirs)
    df = gtx_bench.bench_train(task, model, patterns, _csv_list(backends), steps, settings=settings, device=device, baseline=baseline,
                               bound=bound, rounds=rounds, memory=memory, plugins_dirs=plugins_dirs, log=lambda s: click.echo(s, err=True))
    path = gtx_bench.save(df, results_dir, "train")
    click.echo(format_table(df.drop(columns=["choice"]), fmt))
    click.echo(f"table: {path}", err=True)


@cli.command(name="plugins")
@click.option("--all", "show_all", is_flag=True, help="Include gtx's built-in plugins.")
@plugins_dir_option
def plugins_list(show_all):
    """List loaded plugins and the hooks each implements, as JSON."""
    from gtx.plugins import BUILTIN_DIRS, DEFAULT_PLUGINS

    builtin_prefixes = tuple(str(d) for d in BUILTIN_DIRS)
    out = []
    for name, plugin in pm.list_name_plugin():
        label = label_of(name)
        if not show_all and (name in DEFAULT_PLUGINS or label.startswith(builtin_prefixes)):
            continue
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        out.append({"name": label, "hooks": hooks})
    click.echo(json.dumps(out, indent=2))


def main(argv=None):
    """Console entry point: load plugins (so plugins can add commands), then run the CLI."""
    try:
        load_plugins()
        call_each("register_commands", cli=cli)
    except GtxError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    cli.main(args=argv, prog_name="gtx")


if __name__ == "__main__":
    main()
