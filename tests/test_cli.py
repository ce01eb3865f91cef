"""The command line, through click's CliRunner."""

import json

import pytest

from gtx import parse_pattern
from gtx.cli import cli as gtx_cli

BUILTIN = ["full", "causal", "bipartite", "local", "act", "strided", "fixed", "longformer", "bigbird", "dilated"]


def test_patterns_lists_builtins_with_parameters(cli):
    result = cli("patterns")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for name in BUILTIN:
        assert any(line.startswith(name) for line in lines), name
    assert any(line.startswith("local") and "w: int = 4" in line for line in lines)


def test_show_pattern_prints_each_stage(cli):
    result = cli("show-pattern", "local:w=1", "--src-len", "4", "--tgt-len", "3")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "ee (encoder self-attention): 4 queries x 4 keys, 10 edges, density 0.625" in out
    assert "dd (decoder self-attention): 3 queries x 3 keys, 5 edges" in out
    assert "ed (encoder->decoder cross attention): 3 queries x 4 keys" in out
    assert "     0 ##..\n     1 ###.\n     2 .###\n     3 ..##" in out


def test_bad_input_is_one_line_and_exit_code_2(cli):
    for args, message in [
        (["show-pattern", "local:w=-1"], "Error: bad parameters for pattern 'local': w must be >= 0, got -1"),
        (["show-pattern", "local:x=3"], "Error: pattern 'local' has no parameter 'x'; its parameters: w: int = 4"),
        (["show-pattern", "lokal"], "Error: unknown pattern 'lokal'; known patterns: act, bigbird"),
        # one setting said twice, two ways: neither silently wins
        (["run", "--dim", "8", "--set", "dim=16"], "Error: --dim 8 and --set dim=16 disagree; give one of them"),
        (["run", "--set", "dim=8", "--set", "dim=16"], "Error: --set dim=8 and --set dim=16 disagree; give dim once"),
        (
            ["sweep", "--dim", "8,16", "--set", "dim=16"],
            "Error: --dim 8,16 and --set dim=16 disagree; give one of them",
        ),
        (["sweep", "--set", "dim=8", "--set", "dim=16"], "Error: --set dim=8 and --set dim=16 disagree; give dim once"),
    ]:
        result = cli(*args)
        assert result.exit_code == 2, result.output
        assert result.output.strip().startswith(message), result.output
        assert len(result.output.strip().splitlines()) == 1


def test_backends_lists_reference_and_availability(cli):
    result = cli("backends")
    assert result.exit_code == 0
    assert any(line.startswith("dense") and " yes " in line for line in result.output.splitlines())


def test_plugins_json(plugin_dir, cli):
    folder = plugin_dir(
        hello="""
        from gtx import hookimpl

        @hookimpl
        def register_commands(cli):
            pass
        """
    )
    result = cli("plugins", "--plugins-dir", str(folder))
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"name": str(folder / "hello.py"), "hooks": ["register_commands"]} in data
    assert len(json.loads(cli("plugins", "--all").output)) > len(data)


def test_hook_register_commands(plugin_dir, cli):
    from gtx.plugins import registry as plugins

    folder = plugin_dir(
        hello="""
        import click
        from gtx import hookimpl

        @hookimpl
        def register_commands(cli):
            @cli.command()
            def hello():
                "Say hello."
                click.echo("hello from a plugin")
        """
    )
    plugins.load_plugins(dirs=[folder])
    try:
        assert cli("hello", commands=True).output == "hello from a plugin\n"
    finally:
        gtx_cli.commands.pop("hello")


def test_console_script_main_reports_plugin_errors(plugin_dir, monkeypatch, capsys):
    import pytest

    from gtx.cli import main

    folder = plugin_dir(typo="from gtx import hookimpl\n\n@hookimpl\ndef register_tasc(register):\n    pass\n")
    monkeypatch.setenv("GTX_PLUGINS_DIR", str(folder))
    with pytest.raises(SystemExit) as info:
        main(["patterns"])
    assert info.value.code == 2
    assert "unknown hook 'register_tasc'" in capsys.readouterr().err


def test_a_plugin_cannot_replace_a_gtx_command(plugin_dir, monkeypatch, capsys):
    """A plugin's ``run`` would silently take the place of gtx's: refused, naming the plugin and the
    command, before any command runs; gtx's own ``run`` is back in place."""
    import pytest

    from gtx.cli import main

    run = gtx_cli.commands["run"]
    folder = plugin_dir(
        hijack="""
        import click
        from gtx import hookimpl

        @hookimpl
        def register_commands(cli):
            @cli.command("run")
            def run():
                click.echo("hijacked")
        """
    )
    monkeypatch.setenv("GTX_PLUGINS_DIR", str(folder))
    try:
        with pytest.raises(SystemExit) as info:
            main(["run"])
    finally:
        gtx_cli.commands["run"] = run
    captured = capsys.readouterr()
    assert info.value.code == 2 and "hijacked" not in captured.out
    assert captured.err.strip() == (
        f"Error: plugin {folder / 'hijack.py'} replaces gtx's command 'run' in register_commands; "
        "give its command another name"
    )


def test_warnings_reach_the_user_as_one_line_without_a_source_path(tmp_path):
    import subprocess
    import sys

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "bad.csv").write_text("garbage,x\n")
    out = subprocess.run(
        [sys.executable, "-m", "gtx.cli", "compare", "--results", str(tmp_path)], capture_output=True, text=True
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[0].startswith(
        f"warning: skipping {tmp_path / 'runs' / 'bad.csv'}: results do not match the schema"
    )
    assert len(lines) == 2 and lines[1].startswith("Error: no runs under") and ".py:" not in out.stderr


def test_under_torchrun_only_rank_0_prints_an_error(monkeypatch, tmp_path, cli):
    args = ["run", "--set", "heads=-2", "--results", tmp_path]
    monkeypatch.setenv("RANK", "1")
    other = cli(*args)
    assert other.exit_code == 2 and other.output == ""  # the same error on every rank: said once
    monkeypatch.setenv("RANK", "0")
    main = cli(*args)
    assert main.exit_code == 2 and "needs heads in [1, inf)" in main.output


def test_a_long_phase_writes_a_progress_line_every_ten_seconds_to_a_log():
    from gtx.cli.common import progress_lines

    now, lines = [0.0], []
    tick = progress_lines("epoch 1/4", 5, lines.append, clock=lambda: now[0])
    for t in (3, 11, 12, 25, 40):  # a batch finishes at each of these seconds
        now[0] = t
        tick()
    # none for the last: the phase's own line follows
    assert lines == [
        "epoch 1/4: 2/5 batches, 11 s",
        "epoch 1/4: 4/5 batches, 25 s",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "prefill", "--lengths", "abc"], "'abc' is not a length"),
        (
            ["bench", "prefill", "--family", "gpt2", "--set", "max_len=32", "--lengths", "16,64"],
            "--lengths 64: past the model's 32 positions (--set max_len); give lengths up to 32, or raise max_len",
        ),
        (["bench", "prefill", "--lengths", "100000000000"], "one forward pass holds at least 143,051.1 GiB"),
        (["bench", "attention", "--lengths", "64,64"], "a length named twice"),
        (["bench", "attention", "--lengths", "0"], "'0' is not a length"),
        (["bench", "attention", "--lengths", ""], "--lengths '': '' is not a length"),
        (["bench", "attention", "--lengths", "16,,32"], "--lengths '16,,32': '' is not a length"),
        (["bench", "attention", "--backends", ""], "--backends '' names none; give at least one"),
        (["bench", "train", "--backends", " , "], "--backends ' , ' names none"),
        (
            ["generate", "--set", "path=x", "--prompt", "caf\udce9"],
            "--prompt is not UTF-8 text (byte b'\\xe9' at position 3)",
        ),
    ],
)
def test_bad_lengths_and_a_prompt_that_is_not_utf8_are_one_line(args, message, cli):
    result = cli(*args)
    # a busy machine's note (gtx.measure.load.busy_note) is a warning beside the error, not part of it
    said = [line for line in result.output.strip().splitlines() if not line.startswith("warning: ")]
    assert result.exit_code == 2 and len(said) == 1 and message in said[0], result.output


def test_export_into_a_link_to_an_empty_folder_writes_the_folder_and_keeps_the_link(tmp_path, monkeypatch, cli):
    """FOLDER a symlink to an empty folder: the export lands in the folder it points to (it was a
    NotADirectoryError traceback: the finished export is renamed onto FOLDER, and a link is no folder)."""
    from types import SimpleNamespace

    from gtx.cli import pretrained

    hf = SimpleNamespace(
        config=SimpleNamespace(_attn_implementation="gtx"),
        save_pretrained=lambda work: (work / "config.json").write_text("{}"),
    )
    model = SimpleNamespace(hf=hf, state_dict=dict)
    vocab = SimpleNamespace(itos=["a", "b"])
    r = SimpleNamespace(config=SimpleNamespace(task="copy"), pattern_given=parse_pattern("full"))
    r.task = SimpleNamespace(tokenizer=None, tgt_vocab=vocab)
    monkeypatch.setattr(pretrained, "trained_run", lambda *a: (model, r))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    result = cli("export", "some-run", str(tmp_path / "link"), "--results", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == tmp_path / "real"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["README.md", "config.json", "gtx_vocab.json"]
