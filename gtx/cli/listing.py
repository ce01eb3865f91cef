"""The listing commands: what gtx has loaded (``gtx patterns``, ``backends``, ``models``, ``tasks``,
``plugins``) and what a pattern's edges are (``gtx show-pattern``)."""

from __future__ import annotations

import dataclasses
import json

import click

from gtx.backends import as_backend
from gtx.cli.common import count_option, plugins_dir_option
from gtx.graph.pattern import STAGE_NAMES, STAGES
from gtx.graph.spec import describe_params, is_modifier, parse_pattern
from gtx.graph.tokens import EdgeSet, possible_edges
from gtx.model.layers import model_forms
from gtx.plugins.registry import BACKENDS, BIASES, MODELS, PATTERNS, TASKS, label_of, pm


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


@click.command()
@click.argument("name", required=False)
@plugins_dir_option
def patterns(name):
    """List attention patterns and score biases (P+bias) with their parameters; with NAME (a pattern,
    or +bias), that one's whole entry: definition, budget, reference, limits (as docs/methods.md)."""
    if name:
        from gtx.cli.reference import method_entry

        click.echo(method_entry(name.removeprefix("+"), bias=name.startswith("+")).removeprefix("## "))
        return
    rows = [("NAME", "PARAMETERS", "DESCRIPTION")]
    for name, entry in sorted(PATTERNS.entries().items()):
        shown = f"{name}(PATTERN)" if is_modifier(entry.obj) else name
        rows.append((shown, describe_params(entry.obj) or "-", entry.description))
    for name, entry in sorted(BIASES.entries().items()):
        rows.append((f"+{name}", describe_params(entry.obj, skip="heads") or "-", entry.description))
    click.echo(_table(rows))


@click.command()
@plugins_dir_option
def backends():
    """List attention backends and whether each is available here."""
    rows = [("NAME", "AVAILABLE", "DESCRIPTION")]
    for name, entry in sorted(BACKENDS.entries().items()):
        reason = as_backend(entry).available("cpu")
        rows.append((name, "yes" if reason is None else f"no: {reason}", entry.description))
    click.echo(_table(rows))


@click.command(name="show-pattern")
@click.argument("pattern")
@count_option("--src-len", default=12, help="Source (encoder) length.")
@count_option("--tgt-len", default=10, help="Target (decoder) length.")
@count_option("--max-width", default=120, help="Largest grid printed.")
@plugins_dir_option
def show_pattern(pattern, src_len, tgt_len, max_width):
    """Print each stage's adjacency (rows: queries, columns: keys; '#' = edge); per head group for heads(...)."""
    p = parse_pattern(pattern)
    click.echo(f"pattern {p.spec}   src_len={src_len} tgt_len={tgt_len}   (row = query, column = key, # = edge)")
    from gtx.pictures.plot import chosen_stages, run_time_budget

    for group in p.heads or (p,):
        if chosen_stages(group):
            click.echo(
                f"({group.spec}: keys chosen at run time from queries and keys in {', '.join(chosen_stages(group))}: shown are the "
                f"candidates; {run_time_budget(group, max(src_len, tgt_len))})"
            )
    groups = p.heads or (p,)
    for i, group in enumerate(groups):
        if len(groups) > 1:
            click.echo(f"\n== head group {i + 1} of {len(groups)}: {group.spec}")
        _show_stages(group, src_len, tgt_len, max_width)


def _show_stages(p, src_len, tgt_len, max_width):
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


@click.command()
@plugins_dir_option
def models():
    """List models, the task forms they serve and their settings."""
    _list_registry(MODELS, lambda cls: ",".join(model_forms(cls)))


@click.command()
@plugins_dir_option
def tasks():
    """List tasks, their form (seq2seq, lm, classify; "text": written with a pretrained model's tokenizer when it has one) and their settings."""
    _list_registry(TASKS, lambda cls: f"{cls.form}, text" if getattr(cls, "text", False) else cls.form)


@click.command(name="plugins")
@click.option("--all", "show_all", is_flag=True, help="Include gtx's built-in plugins.")
@plugins_dir_option
def plugins_list(show_all):
    """List loaded plugins and the hooks each implements, as JSON."""
    from gtx.plugins.registry import BUILTIN_DIRS, DEFAULT_PLUGINS

    builtin_prefixes = tuple(str(d) for d in BUILTIN_DIRS)
    out = []
    for name, plugin in pm.list_name_plugin():
        label = label_of(name)
        if not show_all and (name in DEFAULT_PLUGINS or label.startswith(builtin_prefixes)):
            continue
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        out.append({"name": label, "hooks": hooks})
    click.echo(json.dumps(out, indent=2))
