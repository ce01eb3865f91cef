"""Task generators: determinism, disjoint splits, vocabularies, caching, metrics."""

import json
import warnings

import pytest

from gtx.data.batch import batches
from gtx.data.task import SPLITS, edit_distance
from gtx.data.vocab import Vocab
from gtx.errors import GtxError
from gtx.files import cache_dir
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import TASKS


def make(name, **settings):
    entry = TASKS.get(name)
    return entry.obj(name, entry.config(**settings))


SMALL = {
    "copy": dict(n_train=300, n_valid=50, n_test=50),
    "sort": dict(n_train=300, n_valid=50, n_test=50),
    "reverse": dict(n_train=300, n_valid=50, n_test=50, train_len=8, test_len=12),
    "addition": dict(n_train=300, n_valid=50, n_test=50, train_len=8, test_len=12),
    "listops": dict(n_train=200, n_valid=30, n_test=30, min_len=8, max_len=40),
    "g2p": dict(max_words=3000),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_generation_is_deterministic_disjoint_and_sized(name):
    a = make(name, **SMALL[name]).generate()
    b = make(name, **SMALL[name]).generate()
    assert a == b
    sources = [tuple(s) for split in SPLITS for s, _ in a[split]]
    assert len(sources) == len(set(sources)), "a source appears twice"
    for split in SPLITS:
        assert a[split] and all(s and t for s, t in a[split])
        if f"n_{split}" in SMALL[name]:
            assert len(a[split]) == SMALL[name][f"n_{split}"]


@pytest.mark.parametrize("name", ["copy", "reverse", "listops"])
def test_seed_changes_the_data(name):
    assert make(name, **SMALL[name]).generate() != make(name, **SMALL[name], seed=1).generate()


def test_copy_and_sort_targets():
    for s, t in make("copy", **SMALL["copy"]).generate()["train"]:
        assert s == t and all(c in "abcdefghijklmnopqrstuvwxyz" for c in s)
    for s, t in make("sort", **SMALL["sort"]).generate()["train"]:
        assert t == sorted(s)


def test_reverse_and_addition_generalise_to_longer_test_sequences():
    data = make("reverse", **SMALL["reverse"]).generate()
    assert max(len(s) for s, _ in data["train"]) <= 8 and min(len(s) for s, _ in data["test"]) >= 9
    assert all(t == s[::-1] for s, t in data["train"])
    for s, t in make("addition", **SMALL["addition"]).generate()["test"]:
        i = s.index("+")
        a, b = int("".join(s[:i])[::-1]), int("".join(s[i + 1 :])[::-1])
        assert int("".join(t)[::-1]) == a + b
        assert len(s) >= 9


def test_listops_labels_and_lengths():
    import importlib
    import sys

    mod = next(m for n, m in sys.modules.items() if n.startswith("gtx_plugin_listops"))
    tree = ("[MAX", (4, 3, ("[MIN", (2, 3)), 1, 0, ("[MED", (1, 5, 8, 9, 2))))
    assert mod.evaluate(tree) == 5  # the LRA paper's example
    assert mod.evaluate(("[MED", (1, 2, 7, 9))) == 4 and mod.evaluate(("[SM", (9, 8))) == 7
    assert mod.tokens(("[MIN", (2, 3))) == ["[MIN", "2", "3", "]"]
    data = make("listops", **SMALL["listops"]).generate()
    for s, t in data["train"]:
        assert 8 < len(s) < 40 and len(t) == 1 and t[0] in "0123456789"
        assert s[0] in mod.OPERATORS and s[-1] == "]"
    assert importlib.import_module("gtx.data.task").Task.eos is True and TASKS.get("listops").obj.eos is False


def test_vocabularies_are_fixed_where_test_data_is_longer():
    task = make("addition", **SMALL["addition"])
    task.splits()
    assert task.src_vocab.itos[4:] == [*"0123456789", "+"] and len(task.tgt_vocab) == 14
    assert Vocab.encode(task.tgt_vocab, ["7", "x"]) == [task.tgt_vocab.stoi["7"], 3]


def test_g2p_is_real_cmudict_and_scores_phonemes():
    task = make("g2p", **SMALL["g2p"])
    data = task.splits()
    words = {"".join(s) for split in SPLITS for s, _ in data[split]}
    assert len(words) == 3000
    pairs = dict(("".join(s), t) for split in SPLITS for s, t in data[split])
    assert any(w in pairs for w in ("the", "of", "and")) or all(p.isupper() for t in pairs.values() for p in t)
    m = task.metrics([["HH", "AH", "L", "OW"], ["K", "AE"]], [["HH", "AH", "L", "OW"], ["K", "AE", "T"]])
    assert m == {"word_acc": 0.5, "per": pytest.approx(1 / 7)}
    assert edit_distance("kitten", "sitting") == 3


def test_translation_reads_its_folder_and_scores_bleu(tmp_path):
    lines = {
        "train": (["a b c", "b c d", "c d e"], ["x y", "y z", "z w"]),
        "val": (["a b"], ["x"]),
        "test": (["q b"], ["y"]),
    }
    for stem, (src, tgt) in lines.items():
        (tmp_path / f"{stem}.src").write_text("\n".join(src) + "\n")
        (tmp_path / f"{stem}.tgt").write_text("\n".join(tgt) + "\n")
    task = make("translation", data_dir=str(tmp_path))
    data = task.splits()
    assert data["test"] == [(["q", "b"], ["y"])]
    assert task.src_vocab.encode(["q"]) == [3]  # unseen in train: <unk>
    assert task.metrics([["the", "cat", "sat", "on", "the", "mat"]], [["the", "cat", "sat", "on", "the", "mat"]])[
        "bleu"
    ] == pytest.approx(100)
    (tmp_path / "val.src").write_bytes(b"caf\xe9\n")
    with pytest.raises(GtxError, match=r"val.src is not UTF-8 text \(byte b'\\xe9' at 3\)"):
        make("translation", data_dir=str(tmp_path)).splits()
    (tmp_path / "val.src").write_text("\n")
    with pytest.raises(GtxError, match=r"val.src and .*val.tgt hold no pair of non-empty lines"):
        make("translation", data_dir=str(tmp_path)).splits()
    (tmp_path / "val.src").write_text("a b\n")
    (tmp_path / "test.tgt").unlink()
    with pytest.raises(GtxError, match=r"missing .*test.tgt; data_dir needs train, val and test"):
        make("translation", data_dir=str(tmp_path)).splits()
    with pytest.raises(GtxError, match="--set data_dir=DIR"):
        make("translation").splits()


def test_data_is_cached_on_disk(monkeypatch):
    task = make("copy", n_train=20, n_valid=5, n_test=5, seed=123)
    first = task.splits()
    files = list((cache_dir() / "data" / "copy").glob("*.json"))
    assert any(json.loads(f.read_text())["config"]["seed"] == 123 for f in files)
    again = make("copy", n_train=20, n_valid=5, n_test=5, seed=123)
    monkeypatch.setattr(type(again), "generate", lambda self: pytest.fail("regenerated instead of cached"))
    assert again.splits() == first


@pytest.mark.parametrize("text", ["{bad", "[]", '{"train": 1}'])
def test_an_unreadable_cached_file_is_made_again_with_a_warning(text):
    first = make("copy", n_train=20, n_valid=5, n_test=5, seed=124).splits()
    (path,) = [f for f in (cache_dir() / "data" / "copy").glob("*.json") if '"seed": 124' in f.read_text()]
    path.write_text(text)
    with pytest.warns(UserWarning, match=f"cached data {path} is unreadable .*; making it again"):
        again = make("copy", n_train=20, n_valid=5, n_test=5, seed=124).splits()
    assert again == first and json.loads(path.read_text())["config"]["seed"] == 124


@pytest.mark.parametrize("edit", ["settings", "examples", "no checksum"])
def test_a_cached_file_other_than_its_settings_make_is_made_again_with_a_warning(edit):
    """A cached file that parses but holds other data (another settings' file copied over it, an edited
    example, one without the checksum): trained on as it was; now made again from the settings."""
    first = make("copy", n_train=20, n_valid=5, n_test=5, seed=125).splits()
    (path,) = [f for f in (cache_dir() / "data" / "copy").glob("*.json") if '"seed": 125' in f.read_text()]
    data = json.loads(path.read_text())
    if edit == "settings":
        data["config"]["seed"] = 7
        why = "it holds the data of other settings"
    elif edit == "examples":
        data["train"][0] = [["z"], ["z"]]
        why = "its examples are not those it was written with"
    else:
        del data["sha256"]
        why = "its examples are not those it was written with"
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=f"cached data {path}: {why}"):
        again = make("copy", n_train=20, n_valid=5, n_test=5, seed=125).splits()
    assert again == first
    with warnings.catch_warnings():  # the file made again is whole: read without a word
        warnings.simplefilter("error")
        assert make("copy", n_train=20, n_valid=5, n_test=5, seed=125).splits() == first


def test_batches_are_flat_and_graphs_match(tiny_task):
    batch = next(batches(tiny_task, "train", parse_pattern("local:w=1"), 5))
    lens = batch.graph.src_lens
    assert batch.src.numel() == int(lens.sum()) and batch.tgt_in.numel() == batch.targets.numel() == int(
        batch.graph.tgt_lens.sum()
    )
    assert batch.tgt_in[0] == Vocab.sos and batch.targets[int(batch.graph.tgt_lens[0]) - 1] == Vocab.eos
    assert batch.graph.edges["ed"].n_src == batch.src.numel()
    assert (batch.src_pos[: int(lens[0])] == __import__("torch").arange(int(lens[0]))).all()


@pytest.mark.parametrize(
    "task, model, settings, length",
    [
        ("copy", "transformer", {"mean_len": "1e9"}, 1000000001),
        ("sort", "ut", {"mean_len": "1e9"}, 1000000001),
        ("reverse", "transformer", {"test_len": 1000000000}, 500000011),
        ("listops", "ut", {"min_len": 5000, "max_len": 6000}, 5002),
    ],
)
def test_lengths_past_the_models_positions_are_refused_before_the_data(
    task, model, settings, length, monkeypatch, tmp_path, tiny_run
):
    """mean_len=1e9 once generated gigabytes of letters first, and listops drew trees for hours; the
    transformer and the UT have a table of 4096 positions and no max_len setting to raise."""
    made = []
    monkeypatch.setattr(TASKS.get(task).obj, "generate", lambda self: made.append(1))
    result = tiny_run(tmp_path, task=task, model=model, exit_code=2, **settings).result
    assert not made and not any(tmp_path.iterdir())
    assert result.output.strip().endswith(
        f"task {task!r} has sequences of {length} tokens but model {model!r} has positions for 4096; "
        "shorten the task's sequences"
    )


def test_listops_refuses_a_length_window_few_trees_reach(monkeypatch):
    """Trees of 5000..6000 tokens come 1 in ~10^4 draws at depth 10: 12,000 of them would take hours;
    the rate is checked as trees are drawn and the settings refused in one line."""
    import sys

    task = make("listops", min_len=5000, max_len=6000)
    monkeypatch.setattr(sys.modules[type(task).__module__], "CHECK_EVERY", 2000)
    with pytest.raises(ValueError, match=r"^0 of 2,000 trees drawn .* widen min_len..max_len"):
        task.generate()


@pytest.mark.parametrize(
    "name, settings, length",
    [
        ("listops", dict(min_len=5000, max_len=6000, form="classify"), 5001),  # every tree is longer than min_len
        ("reverse", dict(train_len=20, test_len=40), 31),  # about half the test lengths reach it, then <eos>
        ("addition", dict(train_len=8, generalise=False), 5),
    ],
)
def test_tasks_declare_a_length_before_any_data_is_made(name, settings, length):
    """What the position check reads before generating: a length past a model's positions is refused
    before hours of drawing or gigabytes of digits are made."""
    assert make(name, **settings).declared_len() == length
