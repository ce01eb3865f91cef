"""Every command the docs show is one gtx runs. Each ``gtx ...`` of the shell blocks (```bash,
```console, ```sh) of README.md, CONTRIBUTING.md and docs/*.md is parsed by gtx's own command line
(click, on the real commands: an unknown option, a bad value or a missing argument fails it), and
what it names is checked as the command checks it before its work, without the work:

- ``gtx run``: the run resolved (``gtx.run.config.resolve_configs``: task, model, every --set key
  and value, the pattern), then stopped before any data is made;
- ``gtx sweep``, ``gtx frontier``: run with --dry-run (every cell resolved, nothing trained);
- ``gtx bench attention``, ``train``, ``prefill``: the command's own checks, then each pattern's run
  resolved (train) or the model's settings and lengths checked (prefill), then stopped;
- ``gtx patterns``, ``models``, ``tasks``, ``backends``, ``show-pattern``: run as written;
- any other command: its patterns parsed and its --set keys built into the hf model's settings.

Words the docs leave to the reader are filled in by these rules:

- a run's name (RUN, RUN_ID, <run_id>, CHECKPOINT) and an output (OUT, -o PATH) are only parsed;
- ``--set path=...`` (DIR, smollm2, a folder made earlier) names a tiny llama folder made here;
- ``grid.toml`` is docs/experiments.md's TOML block; ``./my_patterns`` holds the plugin
  docs/writing-patterns.md shows; paths under /tmp and relative ones lie in a temporary folder;
- ``for V in W...; do ...; done`` gives its body once per word; ``VAR=value gtx ...`` drops the
  variable; ``python -m gtx.cli ARGS`` and ``torchrun ... -m gtx.cli ARGS`` are ``gtx ARGS``.

A block fenced as ```text is a synopsis, not a command, and is not run.
"""

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from test_docs import doc_example

from gtx.cli import cli
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.plugins import registry as plugins
from gtx.plugins.registry import BACKENDS, MODELS, load_plugins
from gtx.records.run_config import RunConfig
from gtx.run.config import build_configs, resolve_configs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "console", "sh", "shell"}
SEPARATORS = {";", "&&", "||", "|"}


def blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line of the opening fence, language, lines) of each fenced block of a page's text."""
    found, current = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is None:
                current = (number, line.strip()[3:].strip(), [])
            else:
                found.append(current)
                current = None
        elif current is not None:
            current[2].append(line)
    return found


def shell_words(lines: list[str]) -> list[str]:
    """A block's words as a shell reads them: continued lines joined, comments dropped, each line ended by ';'."""
    words = []
    for line in "\n".join(lines).replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        words += [*lexer, ";"]
    return words


def commands(words: list[str]) -> list[list[str]]:
    """The simple commands among ``words``, in order; a ``for V in W...; do BODY; done`` loop gives its
    body once per word W, with ``$V`` replaced by it."""
    found, current, i = [], [], 0
    while i < len(words):
        word = words[i]
        if word == "for" and not current:
            start = words.index("do", i)
            end = _done(words, start)
            name, values = words[i + 1], [w for w in words[i + 3 : start] if w not in SEPARATORS]
            for value in values:
                found += commands([w.replace(f"${name}", value) for w in words[start + 1 : end]])
            i = end + 1
            continue
        if word in SEPARATORS:
            found += [current] if current else []
            current = []
        else:
            current.append(word)
        i += 1
    return found + ([current] if current else [])


def _done(words: list[str], start: int) -> int:
    """Where the ``done`` closing the ``do`` at ``start`` is (both words a command's first)."""
    depth = 0
    for j in range(start, len(words)):
        if j == start or words[j - 1] in SEPARATORS | {"do"}:
            depth += (words[j] == "do") - (words[j] == "done")
            if depth == 0:
                return j
    raise ValueError(f"a loop without its done: {' '.join(words[start:])}")


def gtx_args(command: list[str]) -> list[str] | None:
    """The arguments of a gtx command (module doc), or None for another program."""
    while command and re.fullmatch(r"[A-Za-z_]\w*=.*", command[0]):
        command = command[1:]
    if command[:1] == ["gtx"]:
        return command[1:]
    if command[:1] in (["python"], ["python3"], ["torchrun"]) and "-m" in command:
        at = command.index("-m")
        if command[at + 1 : at + 2] == ["gtx.cli"]:
            return command[at + 2 :]
    return None


def documented() -> list[tuple[str, list[str]]]:
    """(page:line of its block, its arguments) of every gtx command in the pages' shell blocks."""
    found = []
    for page in PAGES:
        for line, language, lines in blocks(page.read_text()):
            if language in SHELL:
                for command in commands(shell_words(lines)):
                    args = gtx_args(command)
                    if args is not None:
                        found.append((f"{page.relative_to(ROOT)}:{line}", args))
    return found


COMMANDS = documented()


class Checked(Exception):
    """Raised in place of a command's work: everything before it passed."""


def resolved_run(config, resume=None, **_):
    if resume is None:  # a resumed run's configuration is its checkpoint's
        resolve_configs(config)


def resolved_bench_train(spec, **_):
    for pattern in [spec.patterns] if isinstance(spec.patterns, str) else spec.patterns:
        settings = dict(spec.settings or {})
        resolve_configs(RunConfig(task=spec.task, model=spec.model, pattern=pattern, settings=settings))
    for name in spec.backends:
        BACKENDS.get(name)


def checked_prefill(family, patterns, lengths, settings=None, *_, **__):
    from gtx.measure.prefill import check_lengths

    check_lengths(family, dict(settings or {}), lengths)
    for spec in patterns:
        parse_pattern(spec)


#: commands invoked with their work replaced: (its function, what is checked in its place)
STOPPED = {
    ("run",): ("gtx.run.runner.run", resolved_run),
    ("bench", "attention"): ("gtx.measure.bench.bench_attention", lambda *a, **k: None),
    ("bench", "train"): ("gtx.measure.train_bench.bench_train", resolved_bench_train),
    ("bench", "prefill"): ("gtx.measure.prefill.bench_prefill", checked_prefill),
}
DRY_RUN = {("sweep",), ("frontier",)}
AS_WRITTEN = {("patterns",), ("models",), ("tasks",), ("backends",), ("show-pattern",)}


def filled(args: list[str], folder: Path) -> list[str]:
    """``args`` with the words the docs leave to the reader filled in (module doc)."""
    out = []
    for arg in args:
        if arg.startswith("path="):
            arg = f"path={folder / 'tiny-llama'}"
        elif arg.startswith("/tmp/"):
            arg = str(folder / arg[len("/tmp/") :])
        elif arg.startswith("./"):
            arg = str(folder / arg[2:])
        out.append(arg)
    return out


def parsed(args: list[str]) -> click.Context:
    """The context of the command ``gtx ARGS`` names: its options and arguments parsed (their
    checks run), nothing invoked."""
    command, ctx, name, rest = cli, None, "gtx", list(args)
    while isinstance(command, click.Group):
        ctx = command.make_context(name, [], parent=ctx, resilient_parsing=True)
        name, rest = (rest[0], rest[1:]) if rest else ("", [])
        command = command.get_command(ctx, name)
        if command is None:
            raise click.UsageError(f"no such command {name!r}")
    return command.make_context(name, rest, parent=ctx)


def check_names(params: dict) -> None:
    """What a command's options name, found as the command finds it: its patterns parsed, an hf
    model's ``--set`` keys and values built into its settings."""
    load_plugins(dirs=params.get("plugins_dirs") or ())
    for key in ("pattern", "patterns", "decode_pattern", "spec"):
        value = params.get(key)
        for spec in [value] if isinstance(value, str) else value or ():
            parse_pattern(spec)
    if params.get("settings"):
        build_configs(dict(params["settings"]), {"model": ("hf", MODELS.get("hf").config)})


def check_command(args: list[str], monkeypatch) -> None:
    """AssertionError, naming the command and what it said, where ``gtx ARGS`` is not a command gtx
    runs (module doc)."""
    said = f"gtx {shlex.join(args)}"
    try:
        ctx = parsed(args)
        path = tuple(ctx.command_path.split()[1:])
        if path not in STOPPED and path not in DRY_RUN and path not in AS_WRITTEN:
            check_names(ctx.params)
            return
    except (click.ClickException, GtxError) as e:
        raise AssertionError(f"{said}: {e.format_message() if isinstance(e, click.ClickException) else e}") from None
    if path in STOPPED:
        target, check = STOPPED[path]

        def work(*a, **k):
            check(*a, **k)
            raise Checked

        monkeypatch.setattr(target, work)
    dry = ["--dry-run"] if path in DRY_RUN and "--dry-run" not in args else []
    result = CliRunner().invoke(cli, [*args, *dry])
    stopped = isinstance(result.exception, Checked)
    assert stopped or (result.exit_code == 0 and path not in STOPPED), (
        f"{said}: exit {result.exit_code}: {result.output}"
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The commands' working folder: a tiny llama folder, grid.toml and ./my_patterns, as the docs name them."""
    from pretrained import save_tiny

    folder = tmp_path_factory.mktemp("docs-commands")
    save_tiny(folder / "tiny-llama", positions=16384)
    ((_, _, grid),) = [b for b in blocks((ROOT / "docs" / "experiments.md").read_text()) if b[1] == "toml"]
    (folder / "grid.toml").write_text("\n".join(grid))
    (folder / "my_patterns").mkdir()
    (folder / "my_patterns" / "chunks.py").write_text(doc_example("plugin-example"))
    yield folder
    plugins.unload_dir(folder / "my_patterns")


@pytest.mark.parametrize(
    "where, args", COMMANDS, ids=[f"{where} gtx {' '.join(args)}"[:100] for where, args in COMMANDS]
)
def test_a_documented_command_is_one_gtx_runs(where, args, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    check_command(filled(args, workdir), monkeypatch)


def test_the_docs_show_commands_of_every_kind_and_loops_give_one_per_word():
    assert len(COMMANDS) > 80
    kinds = {tuple(args[:2]) if args[0] == "bench" else args[0] for _, args in COMMANDS}
    assert {"run", "sweep", "frontier", "eval", "generate", "export", "compare", ("bench", "train")} <= kinds
    words = shell_words(["for a in 1 2; do", "  for b in x 'y z'; do", '    A=1 gtx run --seed $a --pattern "$b" \\', "      --quiet  # c", "  done", "done", "torchrun --nproc-per-node 2 -m gtx.cli runs; python -m gtx.native"])  # fmt: skip
    found = [gtx_args(c) for c in commands(words)]
    assert found == [
        *(["run", "--seed", a, "--pattern", b, "--quiet"] for a in "12" for b in ("x", "y z")),
        ["runs"],
        None,
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "--task", "text"], "No such option .--task."),
        (["eval", "RUN", "--pattern", "nonesuch:w=1"], "nonesuch"),
        (["generate", "--set", "path=DIR", "--set", "nonesuch=1", "--prompt", "x"], "nonesuch"),
        (["run", "--task", "nonesuch"], "nonesuch"),
        (["run", "--set", "nonesuch=1"], "nonesuch"),
        (["run", "--pattern", "local:v=2"], "local"),
        (["sweep", "--task", "copy", "--set", "dim=1,nonesuch"], "dim"),
        (
            ["frontier", "--task", "recall", "--family", "local:w=8,16", "--lengths", "64", "--set", "nonesuch=1"],
            "nonesuch",
        ),
        (["bench", "train", "--task", "copy", "--set", "nonesuch=1"], "nonesuch"),
        (["bench", "prefill", "--set", "nonesuch=1"], "nonesuch"),
        (["bench", "attention", "--backends", "nonesuch"], "nonesuch"),
        (["show-pattern", "nonesuch"], "nonesuch"),
        (["nonesuch"], "nonesuch"),
    ],
)
def test_a_command_that_is_not_one_fails_the_check(args, message, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    with pytest.raises(AssertionError, match=message):
        check_command(filled(args, workdir), monkeypatch)
