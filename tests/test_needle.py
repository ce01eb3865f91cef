"""The needle task: a secret at a chosen depth of filler, asked for at the end; only the answer's digits scored."""

import json
import math
import re
import sys

import pytest

from gtx.data.vocab import ModelVocab, Tokenizer
from gtx.plugins.registry import MODELS, TASKS

NEEDLE = TASKS.get("needle")
DEPTHS = ["depth=0.00", "depth=0.25", "depth=0.50", "depth=0.75", "depth=1.00"]


class Words(Tokenizer):
    """A stand-in for a model's tokenizer that splits as GPT-2's pre-tokenizer does: a word or a
    number with the space before it is one token, trailing spaces another."""

    PATTERN = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
    vocab = ModelVocab([])

    def tokenize(self, text):
        return self.PATTERN.findall(text)

    def detokenize(self, tokens):
        return "".join(tokens)


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
            # the 4 digits, not the space before
            assert groups[-4:] == [groups[-1]] * 4 and groups[-1] in DEPTHS and not any(groups[:-4])
            assert "".join(answer(tokens, groups)) == value and f"is {value}." in text  # the needle holds the answer
    depths = [next(g for g in groups if g) for _, groups in data["valid"]]
    assert depths == DEPTHS * 2  # valid cycles through the depths
    assert {next(g for g in groups if g) for _, groups in data["train"]} <= set(DEPTHS)


@pytest.mark.parametrize("tokenizer", [None, Words()], ids=["chars", "words"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_the_needle_sits_at_its_depth_in_tokens(tokenizer, depth):
    task = make(tokenizer, context=600, depths=str(depth))
    # tokens of the longest filler sentence
    longest = max(len(task.tokens(" " + s)) for s in sys.modules[NEEDLE.obj.__module__].FILLER)
    for tokens, groups in task.generate()["test"]:
        needle = task.tokens(" The secret number of")
        start = next(i for i in range(len(tokens)) if tokens[i : i + len(needle)] == needle)
        question = next(i for i in range(len(tokens)) if tokens[i : i + 3] == task.tokens(" What is the")[:3])
        end = start + next(i for i, t in enumerate(tokens[start:]) if "." in t) + 1  # the needle ends at its full stop
        filler = question - (end - start)  # filler tokens: all before the question but the needle
        assert abs(start - depth * filler) <= longest / 2 + 1  # the nearest sentence boundary
        assert next(g for g in groups if g) == f"depth={depth:.2f}"


def test_pieces_are_written_as_the_tokenizer_writes_the_whole_text():
    tokenizer = Words()
    for tokens, groups in make(tokenizer, context=100).generate()["valid"]:
        # " It is" + " 4821", not " It is " + "4821"
        assert len(tokens) == 101 and tokenizer.tokenize("".join(tokens)) == tokens
        value = "".join(tokens).rsplit("It is ", 1)[1]
        assert answer(tokens, groups) == [" " + value] and sum(map(bool, groups)) == 1


def test_seeded_and_splits_apart():
    a, b, c = make().splits(), make().splits(), make(seed=1).splits()
    assert a == b and a != c
    assert a["valid"] != a["test"]
    seen = [tuple(x) for split in a.values() for x, _ in split]
    assert len(seen) == len(set(seen)) == 40


def test_vocabulary_is_fixed_by_the_task_and_names_are_a_setting():
    one, other = make(seed=0), make(seed=3, n_names=1, digits=1)
    one.splits(), other.splits()
    assert (
        one.src_vocab == other.src_vocab == one.tgt_vocab and "{" not in one.src_vocab.stoi and one.context_len() == 256
    )
    # only Ada, in needle and question
    assert all("".join(t).rsplit("It is ", 1)[0].count(" Ada") == 2 for t, _ in other.splits()["train"])


def test_phase_metrics_mirror_recall():
    m = make().phase_metrics(1.0, {"depth=1.00": (1, 4), "depth=0.00": (3, 4), "depth=0.50": (0, 0)}, "valid")
    assert m["needle_acc"] == 0.5 and m["needle_acc_by_depth"] == {"depth=0.00": 0.75, "depth=1.00": 0.25}
    assert list(m["needles_by_depth"].items()) == [("depth=0.00", 4), ("depth=0.50", 0), ("depth=1.00", 4)]
    assert math.isnan(make().phase_metrics(1.0, {}, "valid")["needle_acc"])


def test_written_with_a_models_tokenizer(tmp_path, tiny_run):
    pytest.importorskip("transformers")
    from pretrained import save_tiny

    folder = save_tiny(tmp_path / "llama")
    hf = MODELS.get("hf")
    tokenizer = hf.obj.tokenizer(hf.config(path=str(folder)))
    task = make(tokenizer, context=120)
    for tokens, groups in task.splits()["valid"]:
        text = tokenizer.detokenize(tokens)
        value = text.rsplit("It is ", 1)[1]
        assert len(tokens) == 121 and all(t in tokenizer.vocab.stoi for t in tokens)
        assert tokenizer.detokenize(answer(tokens, groups)).strip() == value and value.isdigit()
        tail = tokenizer.tokenize(text.rsplit(" What is", 1)[1])  # question and answer, written whole
        assert tokens[-len(tail) :] == tail
    # context=64 holds no filler at this tokenizer's ~1 token per character: the needle alone is ~30 tokens
    scored = tiny_run(tmp_path, task="needle", model="hf", path=folder, context=120, n_valid=5, n_test=5, epochs=0)
    metrics = json.loads(scored.rows.query("split == 'test'").metrics.iloc[0])
    assert set(metrics["needle_acc_by_depth"]) == set(DEPTHS) and 0 <= metrics["needle_acc"] <= 1


def test_tiny_run_reports_accuracy_per_depth(tmp_path, tiny_run):
    sizes = {"context": 96, "n_train": 64, "n_valid": 10, "n_test": 10, "dim": 32, "dim_ff": 64}
    df = tiny_run(tmp_path, task="needle", model="lm", depths="0,1", **sizes).rows
    assert set(df.split) == {"train", "valid", "test"} and set(df.task) == {"needle"}
    metrics = json.loads(df.query("split == 'test'").metrics.iloc[0])
    assert metrics["needles_by_depth"] == {"depth=0.00": 20, "depth=1.00": 20}  # 5 examples per depth, 4 digits each
    assert 0.0 <= metrics["needle_acc"] <= 1.0 and set(metrics["needle_acc_by_depth"]) == {"depth=0.00", "depth=1.00"}


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"depths": "0,1.5"}, "depths='0,1.5': every depth is a fraction of the filler, in [0, 1]"),
        ({"depths": "half"}, "depths='half': write fractions separated by commas"),
        ({"depths": "0,,1"}, "write fractions separated by commas"),
        ({"depths": "0.5,0.501"}, "two depths share the group depth=0.50; give each depth once"),
        ({"context": 40}, "context=40 holds no filler"),
        ({"n_names": 25}, "n_names"),
        ({"digits": 0}, "digits"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, tiny_run, settings, match):
    bad = tiny_run(tmp_path, task="needle", model="lm", exit_code=2, **settings)
    assert match in bad.result.output and len(bad.result.output.strip().splitlines()) == 1, bad.result.output
    assert not (bad.folder / "runs").exists()
