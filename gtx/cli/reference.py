"""Pages generated from the code, which tests/test_docs.py checks are current:
``python -m gtx.cli.reference .`` (``make docs``, from the checkout) writes each whole or not at all:

- docs/cli.md: every command's --help, at 100 columns;
- docs/methods.md: every pattern and score bias (what ``gtx patterns NAME`` prints);
- results/README.md: the results folder's layout (``gtx.records.layout``);
- the figure tables of docs/*.md (docs/results.md's), each between its markers, from its CSV
  (``gtx.records.figures``).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import click

from gtx.files import atomic_write

WIDTH = 100
HEADER = """# Command-line reference

Every `gtx` command's `--help`, generated from the code (`make docs`;
a test fails when this file is stale). The README shows the commands in use.
"""


def _sections(command: click.Command, name: str, parent: click.Context | None):
    """(path, help) of ``command`` and every command below it, each in a context chain (so that usage
    lines read "gtx bench train ...") of the width the reference is written at."""
    ctx = click.Context(
        command,
        info_name=name,
        parent=parent,
        terminal_width=WIDTH,
        max_content_width=WIDTH,
        **command.context_settings,
    )
    yield ctx.command_path, command.get_help(ctx)
    if isinstance(command, click.Group):
        for sub in sorted(command.list_commands(ctx)):
            yield from _sections(command.get_command(ctx, sub), sub, ctx)


def markdown() -> str:
    """The reference as markdown: a section per command, its help in a code block."""
    from gtx.cli import cli
    from gtx.plugins.registry import call_each, load_plugins

    load_plugins()  # with the commands plugins add (hf's generate and export), as ``gtx.cli.main`` does
    call_each("register_commands", cli=cli)
    return "\n".join(
        [HEADER, *(f"## {path}\n\n```\n{text.rstrip()}\n```\n" for path, text in _sections(cli, "gtx", None))]
    )


METHODS_HEADER = """# Methods: the pattern library and score biases

Every built-in pattern and score bias, generated from its docstring and signature (`make
docs`; a test fails when this file is stale or misses one).
`gtx patterns NAME` prints the same entry. A spec is `name:key=value,...`; patterns compose with
`|` (union), `&` (intersection) and wrappers such as `heads(...)`, `act(...)` and `topk(...)`, and
take a bias with `+name` ([writing-patterns.md](writing-patterns.md)).
"""


def method_entry(name: str, bias: bool = False) -> str:
    """One pattern's (or, with ``bias``, one score bias's) entry: spec, parameters and docstring."""
    from gtx.graph.spec import describe_params, is_modifier
    from gtx.plugins.registry import BIASES, PATTERNS

    entry = (BIASES if bias else PATTERNS).get(name)
    shown = f"+{name}" if bias else f"{name}(PATTERN)" if is_modifier(entry.obj) else name
    params = describe_params(entry.obj, skip="heads" if bias else "inner") or "none"
    version = f"Definition: version {entry.definition} (results rows record it)\n\n" if entry.definition else ""
    doc = _markdown(inspect.getdoc(entry.obj) or "Undocumented.")
    return f"## {shown}\n\nParameters: `{params}`\n\n{version}{doc}\n"


def _markdown(doc: str) -> str:
    """A Google-style docstring as markdown: each section (``Args:``, ``Note:``) a bold heading with
    its text dedented; an argument a list item."""
    out, section = [], None
    for line in doc.splitlines():
        if line.rstrip().endswith(":") and line[:1].isalpha() and " " not in line.strip():
            section = line.strip()[:-1]
            out += ["", f"**{section}**", ""]
        elif section and line.startswith("    "):
            text = line[4:]
            if section == "Args" and not text.startswith(" ") and ":" in text:
                name, rest = text.split(":", 1)
                text = f"- `{name}`:{rest}"
            out.append(text)
        else:
            section = None if not line.strip() else section
            out.append(line)
    return "\n".join(out).replace("\n\n\n", "\n\n").strip()


def methods() -> str:
    """docs/methods.md: every registered pattern, then every score bias."""
    from gtx.plugins.registry import BIASES, PATTERNS, load_plugins

    load_plugins()
    entries = [method_entry(n) for n in sorted(PATTERNS.names())] + [
        method_entry(n, bias=True) for n in sorted(BIASES.names())
    ]
    return "\n".join([METHODS_HEADER, *entries])


def results_readme() -> str:
    from gtx.records.layout import readme

    return readme()


#: each generated page by its path in the checkout
PAGES = {"docs/cli.md": markdown, "docs/methods.md": methods, "results/README.md": results_readme}


def write_pages(root: Path) -> list[Path]:
    """Write every generated page under ``root`` (the checkout), each atomically: a page is replaced
    only once its new text exists (a shell redirect empties it before the code has run)."""
    from gtx.records import figures

    written = []
    for name, make in PAGES.items():
        atomic_write(root / name, make())
        written.append(root / name)
    return written + figures.write_pages(root)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not all((Path(sys.argv[1]) / name).parent.is_dir() for name in PAGES):
        sys.exit(f"usage: python -m gtx.cli.reference CHECKOUT (writes {', '.join(PAGES)} there)")
    for path in write_pages(Path(sys.argv[1])):
        print(f"wrote {path}")
