"""The CLI reference, ``docs/cli.md``: every command's ``--help``, as click prints it at 100 columns.

    python -m gtx.cli.reference > docs/cli.md     # rewrite it; tests/test_docs.py checks it is current
"""

from __future__ import annotations

import click

WIDTH = 100
HEADER = """# Command-line reference

Every `gtx` command's `--help`, generated from the code (`python -m gtx.cli.reference > docs/cli.md`;
a test fails when this file is stale). The README shows the commands in use.
"""


def _sections(command: click.Command, name: str, parent: click.Context | None):
    """(path, help) of ``command`` and every command below it, each in a context chain (so that usage
    lines read "gtx bench train ...") of the width the reference is written at."""
    ctx = click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH, **command.context_settings)
    yield ctx.command_path, command.get_help(ctx)
    if isinstance(command, click.Group):
        for sub in sorted(command.list_commands(ctx)):
            yield from _sections(command.get_command(ctx, sub), sub, ctx)


def markdown() -> str:
    """The reference as markdown: a section per command, its help in a code block."""
    from gtx.cli import cli

    return "\n".join([HEADER, *(f"## {path}\n\n```\n{text.rstrip()}\n```\n" for path, text in _sections(cli, "gtx", None))])


if __name__ == "__main__":
    print(markdown(), end="")
