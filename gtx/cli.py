"""gtx command line: a thin click layer over the runner and the registries.

    gtx patterns                      list attention patterns
    gtx show-pattern local:w=2 --src-len 8 --tgt-len 6
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from gtx import __version__
from gtx.errors import GtxError
from gtx.pattern import STAGE_NAMES, STAGES, describe_params, is_modifier, parse_pattern
from gtx.plugins import BACKENDS, PATTERNS, call_each, label_of, load_plugins, pm


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
        click.echo(
            f"\n{stage} ({STAGE_NAMES[stage]}): {n_q} queries x {n_k} keys, {src.numel()} edges, "
            f"density {src.numel() / (n_q * n_k):.3f}, {src.numel() / n_q:.2f} edges per query"
        )
        if max(n_q, n_k) > max_width:
            click.echo(f"  (grid not printed: wider than --max-width {max_width})")
            continue
        grid = [["."] * n_k for _ in range(n_q)]
        for s, d in zip(src.tolist(), dst.tolist()):
            grid[d][s] = "#"
        for i, row in enumerate(grid):
            click.echo(f"  {i:>4} {''.join(row)}")


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
