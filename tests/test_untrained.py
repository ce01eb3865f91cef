"""A pattern's own parameters (NSA's gates and compression, DSA's indexer) on a pretrained folder
that will not train them: refused in one line, or run as initialised when asked for, and said so."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

from pretrained import save_tiny

from gtx import plugins
from gtx.cli import cli
from gtx.experiments.results import load

TEXT = [
    "--task",
    "text",
    "--set",
    "context=32",
    "--set",
    "train_tokens=600",
    "--set",
    "eval_tokens=300",
    "--quiet",
    "--epochs",
    "0",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("pretrained") / "llama")


@pytest.mark.parametrize("spec", ["nsa:l=8,d=4,s=8,w=8", "dsa:k=8,dense=0"])
def test_scoring_untrained_pattern_parameters_is_refused_unless_asked_for(folder, tmp_path, spec):
    run = ["run", "--model", "hf", "--set", f"path={folder}", *TEXT, "--pattern", spec]
    bad = CliRunner().invoke(cli, [*run, "--results", str(tmp_path / "r")])
    assert (
        bad.exit_code == 2 and "untrained_attention=true" in bad.output and len(bad.output.strip().splitlines()) == 1
    ), bad.output
    assert not (tmp_path / "r").exists()
    ok = CliRunner().invoke(cli, [*run, "--set", "untrained_attention=true", "--results", str(tmp_path / "r")])
    assert ok.exit_code == 0, ok.output
    assert all(json.loads(c)["model_config"]["untrained_attention"] for c in load(tmp_path / "r").config)


def test_generate_under_an_untrained_indexer_is_refused_or_says_its_stage(folder):
    plugins.call_each("register_commands", cli=cli)
    args = [
        "generate",
        "--set",
        f"path={folder}",
        "--pattern",
        "dsa:k=2",
        "--no-cache",
        "--prompt",
        "the quick",
        "--new",
        "4",
    ]
    bad = CliRunner().invoke(cli, args)
    assert bad.exit_code == 2 and "lacks" in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output
    ok = CliRunner().invoke(cli, [*args[:2], *args[2:3], "--set", "untrained_attention=true", *args[3:]])
    assert (
        ok.exit_code == 0
        and "(its own parameters untrained) (dense stage, indexer trained 0 steps, freeze=true (a trained start))"
        in ok.output
    ), ok.output
