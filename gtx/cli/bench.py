"""``gtx bench``: attention kernels, the auto backend's calibration, and training throughput."""

from __future__ import annotations

import click

from gtx.cli.common import (
    GtxGroup,
    count_option,
    device_option,
    lengths_option,
    names_option,
    pattern_option,
    plugins_dir_option,
    results_option,
    settings_option,
    switch_option,
    table_format_option,
)
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import BACKENDS, load_plugins
from gtx.records.results import format_table


@click.group(cls=GtxGroup)
def bench():
    """Benchmarks: attention kernels, training throughput, a transformers model's prefill. Tables land under <results>/bench/."""
    from gtx.measure.load import busy_note

    note = busy_note("these timings")
    if note:
        click.echo(f"warning: {note}", err=True)


@bench.command(name="attention")
@pattern_option("Pattern spec (repeatable).", "local:w=32", several=True)
@lengths_option("1024,2048,4096,8192")
@click.option(
    "--backends",
    default="dense,dgl,blocksparse,auto",
    show_default=True,
    callback=names_option,
    help="Backends, comma-separated; for reference, sdpa is plain torch's SDPA (is_causal, unmasked or a boolean mask) "
    "and flexattention FlexAttention called directly with the flex backend's BlockMask.",
)
@click.option(
    "--forward",
    is_flag=True,
    help="Time the forward alone, without gradients (as gtx eval, a prefill and generation run it); "
    "flex and flexattention run on the CPU only so.",
)
@count_option("--heads", default=4)
@count_option("--head-dim", default=32)
@count_option("--repeats", default=5, help="Timed repeats (median).")
@device_option()
@table_format_option()
@results_option()
@switch_option("plot", "Also write a log-log PNG.")
@plugins_dir_option(passed="Folder of plugin .py files to load, also in the processes that time each row (repeatable).")
def bench_attention(
    patterns, lengths, backends, forward, heads, head_dim, repeats, device, fmt, results_dir, plot, plugins_dirs
):
    """Forward + backward (or, with --forward, forward) time and peak memory per (pattern, length, backend)."""
    from gtx.measure import bench as gtx_bench
    from gtx.run.runner import resolve_device

    load_plugins(dirs=plugins_dirs)
    dev = resolve_device(device)
    for name in backends:
        if name not in gtx_bench.REFERENCE_CELLS:  # plain torch, for reference: not a gtx backend
            BACKENDS.get(name)
    specs = [parse_pattern(p).spec for p in patterns]
    df = gtx_bench.bench_attention(
        specs,
        lengths,
        backends,
        heads,
        head_dim,
        repeats,
        device=str(dev),
        plugins_dirs=plugins_dirs,
        forward=forward,
        log=lambda s: click.echo(s, err=True),
    )
    path = gtx_bench.save(df, results_dir, "attention")
    click.echo(format_table(df, fmt))
    click.echo(f"table: {path}", err=True)
    if plot:
        from gtx.pictures import plot as gtx_plot

        click.echo(f"plot: {gtx_plot.save(gtx_plot.attention_bench(df), path.with_suffix('.png'))}", err=True)


@bench.command(name="calibrate")
@device_option()
@count_option("--heads", default=4)
@count_option("--head-dim", default=32)
@switch_option(
    "forward", "Also fit the constants of calls without gradients (inference), where flex also runs on the CPU."
)
def bench_calibrate(device, heads, head_dim, forward):
    """Measure the auto backend's cost constants on this machine and save them for auto to use."""
    from gtx.measure.calibrate import calibrate
    from gtx.run.runner import resolve_device

    tables = calibrate(
        str(resolve_device(device)), heads, head_dim, forward=forward, log=lambda s: click.echo(s, err=True)
    )
    for table, fitted in tables.items():
        for kind, (a, o) in sorted(fitted.items()):
            click.echo(f"{table:<12} {kind:<15} {a:.3e} s per unit of work + {1000 * o:.3f} ms per call")


@bench.command(name="train")
@click.option("--task", default="copy", show_default=True)
@click.option("--model", default="transformer", show_default=True)
@pattern_option("Pattern spec (repeatable: one table).", "full", several=True)
@click.option(
    "--backends",
    default="auto,dgl,dgl-seed",
    show_default=True,
    callback=names_option,
    help="Backends, comma-separated.",
)
@count_option("--steps", default=30, help="Timed training steps.")
@settings_option("Model, task or training setting.")
@count_option("--rounds", default=3, help="Interleaved rounds of --steps per variant; rows report the median round.")
@switch_option(
    "baseline",
    "Also time the model's plain-torch references (transformer: torch.nn.Transformer; lm: torch SDPA is_causal, and with each pattern's bool mask).",
)
@switch_option("bound", "Also time the model with attention skipped: the ceiling for any backend.")
@switch_option("memory", "Also measure each row's peak memory, each in a fresh process.")
@device_option()
@table_format_option()
@results_option()
@plugins_dir_option(passed="Folder of plugin .py files to load, also in the processes that time each row (repeatable).")
def bench_train(
    task,
    model,
    patterns,
    backends,
    steps,
    rounds,
    settings,
    baseline,
    bound,
    memory,
    device,
    fmt,
    results_dir,
    plugins_dirs,
):
    """Training tokens/s and peak memory per (pattern, backend) on the same batches, beside plain-torch references."""
    from gtx.measure import bench as gtx_bench
    from gtx.measure.train_bench import TrainBench, bench_train

    load_plugins(dirs=plugins_dirs)
    spec = TrainBench(
        task,
        model,
        patterns,
        backends,
        steps,
        settings=settings,
        device=device,
        baseline=baseline,
        bound=bound,
        rounds=rounds,
        memory=memory,
        plugins_dirs=plugins_dirs,
    )
    df = bench_train(spec, log=lambda s: click.echo(s, err=True))
    path = gtx_bench.save(df, results_dir, "train")
    click.echo(format_table(df.drop(columns=["choice"]), fmt))
    click.echo(f"table: {path}", err=True)


@bench.command(name="prefill")
@click.option(
    "--family",
    default="llama",
    show_default=True,
    help="The transformers family of the hf model: llama, qwen2 or gpt2.",
)
@pattern_option("Pattern spec (repeatable).", "full", several=True)
@lengths_option("4096,16384")
@settings_option(
    "An hf model setting (layers, heads, kv_heads, dim, dim_ff), or path=: a pretrained model (a folder, a GGUF "
    "file, smollm2) instead of a random one."
)
@count_option("--repeats", default=3, help="Timed forward passes (median).")
@click.option(
    "--backends",
    default="auto",
    show_default=True,
    callback=names_option,
    help="gtx backends, comma-separated: a row per pattern and backend (e.g. auto,flex,blocksparse).",
)
@table_format_option()
@results_option()
def bench_prefill(family, patterns, lengths, settings, repeats, backends, fmt, results_dir):
    """A transformers causal LM's prefill (forward, no gradients) with gtx's attention under each pattern,
    against the same weights on transformers' own SDPA; peak memory growth per row. Each timing, and each load
    of a pretrained model (--set path=), is said on stderr as it starts. Needs pip install -e '.[hf]'.

    \b
      gtx bench prefill --family llama --pattern full --pattern local:w=256 --lengths 4096,16384
      gtx bench prefill --set path=smollm2 --pattern full --pattern sinks:s=4,w=256 --lengths 4096
    """
    from gtx.measure import bench as gtx_bench
    from gtx.measure.prefill import bench_prefill as run

    load_plugins()
    for name in backends:
        BACKENDS.get(name)  # an unknown name is one line before the model is built
    df = run(family, patterns, lengths, settings, repeats, log=lambda s: click.echo(s, err=True), backends=backends)
    path = gtx_bench.save(df, results_dir, "prefill")
    click.echo(format_table(df, fmt))
    click.echo(f"table: {path}", err=True)
