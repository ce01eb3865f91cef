"""The needle task: a secret at a chosen depth of filler, asked for at the end; only the answer scored."""

import json

import pytest
from click.testing import CliRunner

from gtx.cli import cli
from gtx.experiments.results import load
from gtx.plugins.registry import MODELS, TASKS

NEEDLE = TASKS.get("needle")


def make(tokenizer=None, **settings):
    task = NEEDLE.obj("needle", NEEDLE.config(**{"n_train": 20, "n_valid": 10, "n_test": 10, **settings}))
    task.tokenizer = tokenizer
    return task


def answer(tokens, groups):
    return [t for t, g in zip(tokens[1:], groups) if g]


def test_examples_fill_the_context_and_score_only_the_answer():
    data = make(context=200).splits()
    for examples in data.values():
        for tokens, groups in examples:
            text = "".join(tokens)
            value = text.rsplit("It is ", 1)[1]
            assert len(tokens) == 201 and len(groups) == 200 and value.isdigit() and len(value) == 4
            assert "".join(answer(tokens, groups)) == value and f"is {value}." in text  # the needle holds the answer
    depths = [next(g for g in groups if g) for _, groups in data["valid"]]
    assert depths == ["depth=0.00", "depth=0.25", "depth=0.50", "depth=0.75", "depth=1.00"] * 2  # valid cycles through the depths


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_the_needle_sits_at_its_depth(depth):
    task = make(context=600, depths=str(depth))
    for tokens, _ in task.splits()["test"]:
        text = "".join(tokens)
        start = text.index(" The secret number")
        needle, question = text[start:text.index(".", start) + 1], text[text.index(" What is the secret"):]
        filler = len(text) - len(needle) - len(question)
        assert abs(start - depth * filler) <= 50  # the nearest sentence boundary: sentences are at most 46 characters


def test_seeded_and_splits_apart():
    a, b, c = make().splits(), make().splits(), make(seed=1).splits()
    assert a == b and a != c
    seen = [tuple(x) for split in a.values() for x, _ in split]
    assert len(seen) == len(set(seen))


def test_written_with_a_models_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from pretrained import save_tiny

    folder = save_tiny(tmp_path / "llama")
    hf = MODELS.get("hf")
    tokenizer = hf.obj.tokenizer(hf.config(path=str(folder)))
    task = make(tokenizer, context=120)
    tokens, groups = task.splits()["valid"][0]
    assert len(tokens) == 121 and all(t in tokenizer.vocab.stoi for t in tokens)
    assert tokenizer.detokenize(answer(tokens, groups)) == tokenizer.detokenize(tokens).rsplit("It is ", 1)[1]
    result = CliRunner().invoke(cli, ["run", "--task", "needle", "--model", "hf", "--set", f"path={folder}", "--set", "context=120",
                                      "--set", "n_valid=5", "--set", "n_test=5", "--epochs", "0", "--quiet", "--results", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    metrics = json.loads(load(tmp_path / "r").query("split == 'test'").metrics.iloc[0])
    assert set(metrics["needle_acc_by_depth"]) == {"depth=0.00", "depth=0.25", "depth=0.50", "depth=0.75", "depth=1.00"}


def test_tiny_run_reports_accuracy_per_depth(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--task", "needle", "--model", "lm", "--set", "context=96", "--set", "n_train=64", "--set", "n_valid=10",
                                      "--set", "n_test=10", "--set", "depths=0,1", "--dim", "32", "--heads", "2", "--dim-ff", "64", "--epochs", "1",
                                      "--quiet", "--results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    row = load(tmp_path).query("split == 'test'").iloc[0]
    metrics = json.loads(row.metrics)
    assert metrics["needles_by_depth"] == {"depth=0.00": 20, "depth=1.00": 20}  # 5 examples per depth, 4 digits each
    assert 0.0 <= metrics["needle_acc"] <= 1.0


@pytest.mark.parametrize("settings, match", [(["depths=0,1.5"], "in [0, 1]"), (["depths=half"], "write fractions"),
                                             (["context=40"], "context=40 holds no filler")])
def test_bad_settings_are_one_line(tmp_path, settings, match):
    args = [a for s in settings for a in ("--set", s)]
    result = CliRunner().invoke(cli, ["run", "--task", "needle", "--model", "lm", *args, "--epochs", "1", "--results", str(tmp_path)])
    assert result.exit_code == 2 and match in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "runs").exists()
