"""What every gtx command module shares: one-line errors, the group class, common options."""

from __future__ import annotations

import time
from pathlib import Path

import click

from gtx.errors import GtxError, Interrupted
from gtx.plugins.registry import load_plugins
from gtx.run.distributed import is_main_process


class CliError(click.ClickException):
    """Printed as one line, ``Error: ...``, exit code 2."""

    exit_code = 2


def cli_error(e: GtxError) -> CliError:
    """A GtxError as the CLI prints it: its one line, exit code 2 or the error's own (Ctrl-C: 130)."""
    error = CliError(str(e))
    error.exit_code = getattr(e, "exit_code", CliError.exit_code)
    return error


class GtxGroup(click.Group):
    """Turns a GtxError into its one line (``cli_error``), and Ctrl-C that no command caught into
    one line and exit code 130 rather than click's "Aborted!" and 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            error = Interrupted(f"{' '.join(filter(None, ['gtx', ctx.invoked_subcommand]))} interrupted (Ctrl-C)")
        except GtxError as e:
            error = e
        if not is_main_process():  # under torchrun every rank meets the same error: rank 0 alone says it
            ctx.exit(getattr(error, "exit_code", CliError.exit_code))
        raise cli_error(error) from None


DEVICES = ("auto", "cpu", "cuda")


def results_option(help: str = "Folder of the results tables.", default: str | None = "results", path: bool = False):
    """``--results DIR`` as ``results_dir``: every command that reads or writes a results folder
    declares it here (a str, or a ``Path`` with ``path``; None where a command derives its default)."""
    return click.option(
        "--results",
        "results_dir",
        default=default,
        show_default=default is not None,
        type=click.Path(file_okay=False, path_type=Path if path else None),
        help=help,
    )


def device_option(default: str | None = "auto", help: str | None = None):
    """``--device auto|cpu|cuda``: auto takes the GPU where torch sees one."""
    return click.option(
        "--device", type=click.Choice(DEVICES), default=default, show_default=default is not None, help=help
    )


def plugins_dir_option(f=None, *, passed: str | None = None):
    """``--plugins-dir DIR`` on every command: load that folder's ``*.py`` plugins first. ``passed``:
    the help of a command that also hands the folders to processes of its own (then given to it as
    ``plugins_dirs``)."""

    def load(ctx, param, value):
        try:
            load_plugins(dirs=value)
        except GtxError as e:
            raise cli_error(e) from None
        return value

    option = click.option(
        "--plugins-dir",
        "plugins_dirs",
        multiple=True,
        type=click.Path(file_okay=False),
        callback=load,
        expose_value=passed is not None,
        is_eager=True,
        help=passed or "Folder of plugin .py files to load (repeatable; also GTX_PLUGINS_DIR).",
    )
    return option if f is None else option(f)


def count_option(*names: str, default: int | None = None, help: str | None = None):
    """An option taking a whole number of at least 1 (``names``: its flags, and the parameter's name
    where one is given), its default shown where it has one."""
    return click.option(
        *names, type=click.IntRange(min=1), default=default, show_default=default is not None, help=help
    )


def switch_option(name: str, help: str):
    """``--NAME/--no-NAME``: a switch, on unless turned off."""
    return click.option(f"--{name}/--no-{name}", default=True, show_default=True, help=help)


def settings_option(help: str = "Any model, task or training setting (repeatable)."):
    """``--set KEY=VALUE`` (repeatable) as ``settings``: a dict, each key given once (``key_value``)."""
    return click.option("--set", "settings", multiple=True, callback=key_value, metavar="KEY=VALUE", help=help)


def pattern_option(help: str, default: str | None = None, several: bool = False, metavar: str | None = None):
    """``--pattern SPEC``: one pattern spec as ``pattern``, or with ``several`` repeatable, as ``patterns``
    (a tuple; ``default`` then its one spec)."""
    return click.option(
        "--pattern",
        "patterns" if several else "pattern",
        multiple=several,
        default=[default] if several and default else default,
        show_default=default is not None,
        metavar=metavar,
        help=help,
    )


def lengths_option(default: str | None = None, help: str = "Sequence lengths, comma-separated.", metavar=None):
    """``--lengths L1[,L2...]`` as ``lengths``: positive integers, none twice (``parse_lengths``);
    required where there is no ``default``."""
    return click.option(
        "--lengths",
        default=default,
        required=default is None,
        show_default=default is not None,
        metavar=metavar,
        callback=parse_lengths,
        help=help,
    )


TABLE_FORMATS = ("table", "markdown", "csv")


def table_format_option(help: str | None = None):
    """``--format table|markdown|csv`` as ``fmt``: how a command prints its table (``format_table``)."""
    return click.option(
        "--format", "fmt", type=click.Choice(TABLE_FORMATS), default="table", show_default=True, help=help
    )


def key_value(ctx, param, values):
    out = {}
    for item in values:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{item!r}: write key=value, e.g. --set dim=64", ctx=ctx, param=param)
        set_once(out, key.strip(), value.strip())
    return out


def _said(value: str | list[str]) -> str:
    return ",".join(value) if isinstance(value, list) else value


def set_once(settings: dict, key: str, value: str | list[str]) -> None:
    """``settings[key] = value`` for one ``--set`` (a value, or a sweep's list of them); a key given
    twice with two values is refused, where the last one would silently win."""
    if settings.get(key, value) != value:
        raise CliError(f"--set {key}={_said(settings[key])} and --set {key}={_said(value)} disagree; give {key} once")
    settings[key] = value


def check_shortcuts(shortcuts: dict, settings: dict) -> None:
    """A shortcut option given (``--dim 64``: ``--set dim=64``) and ``--set`` naming the same setting
    must agree; values as ``set_once`` takes them."""
    for key, value in shortcuts.items():
        if settings.get(key, value) != value:
            option = f"--{key.replace('_', '-')}"
            raise CliError(f"{option} {_said(value)} and --set {key}={_said(settings[key])} disagree; give one of them")


def csv_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def names_option(ctx, param, value: str) -> list[str]:
    """A click callback: comma-separated names, at least one."""
    names = csv_list(value)
    if not names:
        raise CliError(f"--{param.name} {value!r} names none; give at least one, comma-separated")
    return names


def parse_lengths(ctx, param, value: str) -> list[int]:
    """A click callback: comma-separated sequence lengths, each a positive integer, none twice."""
    items = [v.strip() for v in value.split(",")]  # an empty item ("", "16,,32") is no length either
    bad = next((v for v in items if not v.isdigit() or int(v) < 1), None)
    if bad is not None:
        raise CliError(
            f"--lengths {value!r}: {bad!r} is not a length; give positive integers separated by commas, e.g. 4096,16384"
        )
    if len(set(map(int, items))) < len(items):
        raise CliError(f"--lengths {value}: a length named twice; give each once")
    return [int(v) for v in items]


def progress_lines(
    description: str, total: int, echo, every_s: float = 10.0, clock=time.monotonic, unit: str = "batch"
):
    """A per-unit callback for output that is not a terminal (a log): a line such as "epoch 2/4:
    120/400 batches, 31 s" at most every ``every_s`` seconds, so that a long phase is not silent;
    ``unit``: what is counted (``batch``, ``sample``)."""
    start = clock()
    state = {"done": 0, "shown": start}
    units = "batches" if unit == "batch" else f"{unit}s"

    def tick():
        state["done"] += 1
        now = clock()
        if now - state["shown"] >= every_s and state["done"] < total:
            state["shown"] = now
            echo(f"{description}: {state['done']}/{total} {units}, {now - start:.0f} s")

    return tick
