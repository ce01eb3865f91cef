"""The text task: windows and 90/5/5 splits, char vs byte level, archives, bad files, the built-in
corpus, bpc, and a tiny run through the CLI."""

import json
import math
import random
import re
import zipfile

import pytest

from gtx.data.batch import make_batch
from gtx.data.task import SPLITS
from gtx.data.vocab import UNK
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import TASKS


def make(**settings):
    entry = TASKS.get("text")
    return entry.obj("text", entry.config(**settings))


def letters(n, seed=0):
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij \n") for _ in range(n))


def test_windows_tile_the_splits_in_order(tmp_path):
    text = letters(2000)
    (tmp_path / "a.txt").write_text(text)
    task = make(data_file=str(tmp_path / "a.txt"), context=8, eval_tokens=0)
    data = task.splits()
    assert {s: len(data[s]) for s in SPLITS} == {"train": 1799 // 8, "valid": 99 // 8, "test": 99 // 8}
    for split, start in (("train", 0), ("valid", 1800), ("test", 1900)):  # 90/5/5 in file order
        windows = [x for x, groups in data[split]]
        assert all(len(w) == 9 for w in windows) and all(groups == [] for _, groups in data[split])
        assert windows[0] == text[start : start + 9] and data[split][-1] == data[split][len(windows) - 1]
        # each window's predictions (w[1:]) follow the last one's: the split's text once, no overlap
        assert "".join(w[1:] for w in windows) == text[start + 1 : start + 1 + 8 * len(windows)]
    with pytest.raises(IndexError):
        data["test"][len(data["test"])]
    assert task.context_len() == 8 and task.phase_metrics(math.log(2), {}, "valid") == {"bpc": pytest.approx(1.0)}
    assert task.src_vocab is task.tgt_vocab and task.src_vocab.itos[4:] == sorted(set(text[:1800]))
    batch = make_batch(task, "valid", [0, 1], parse_pattern("causal"))
    assert batch.tgt_in.numel() == batch.targets.numel() == 16 and batch.src is None


def test_limits_read_the_start_of_a_split(tmp_path):
    (tmp_path / "a.txt").write_text(letters(20000))
    task = make(data_file=str(tmp_path / "a.txt"), context=10, train_tokens=100, eval_tokens=55)
    data = task.splits()
    assert (len(data["train"]), len(data["valid"]), len(data["test"])) == (10, 5, 5)
    assert len(task.src_vocab) == 4 + 12  # from the whole train split, not its first 100 tokens
    full = make(data_file=str(tmp_path / "a.txt"), context=10, eval_tokens=0).splits()
    assert len(full["valid"]) == 999 // 10 and full["valid"][0] == data["valid"][0]
    with pytest.raises(GtxError, match=r"train_tokens=5 is less than one window; set it >= context=10"):
        make(data_file=str(tmp_path / "a.txt"), context=10, train_tokens=5).splits()


def test_char_and_byte_level(tmp_path):
    text = "héllo wörld\n" * 400
    (tmp_path / "u.txt").write_text(text, encoding="utf-8")
    char = make(data_file=str(tmp_path / "u.txt"), context=16)
    byte = make(data_file=str(tmp_path / "u.txt"), context=16, tokens="byte")
    char.splits(), byte.splits()
    assert "é" in char.src_vocab.stoi and len(char.src_vocab) == 4 + len(set(text))
    assert len(byte.src_vocab) == 4 + 256 and "é" in byte.src_vocab.stoi  # U+00E9: byte 0xe9, no text here has it
    assert byte.splits()["train"][0][0].encode("latin-1") == text.encode("utf-8")[:17]
    assert char.splits()["train"][0][0] == text[:17]
    with pytest.raises(GtxError, match="tokens must be auto, char or byte, got 'word'"):
        make(data_file=str(tmp_path / "u.txt"), tokens="word").splits()


def test_enwik8_and_text8_by_name_and_from_their_zips(tmp_path):
    raw = bytes(range(256)) * 40  # not UTF-8: enwik8 is read byte by byte
    (tmp_path / "enwik8").write_bytes(raw)
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as z:
        z.writestr("enwik8", raw)
    for name in ("enwik8", "enwik8.zip"):
        task = make(data_file=str(tmp_path / name), context=16)
        assert task.level == "byte" and task.splits()["train"][0][0].encode("latin-1") == raw[:17]
        assert len(task.src_vocab) == 260
    words = letters(5000, seed=1)
    with zipfile.ZipFile(tmp_path / "text8.zip", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("text8", words)
    task = make(data_file=str(tmp_path / "text8.zip"), context=16)
    assert task.level == "char" and task.splits()["valid"][0][0] == words[4500:4517]
    with zipfile.ZipFile(tmp_path / "two.zip", "w") as z:
        z.writestr("a", words), z.writestr("b", words)
    with pytest.raises(GtxError, match=r"two.zip holds 2 files; a .zip must hold exactly one"):
        make(data_file=str(tmp_path / "two.zip")).splits()


def test_bad_files_say_what_to_do(tmp_path):
    def error(name, **settings):
        with pytest.raises(GtxError) as e:
            make(data_file=str(tmp_path / name), **settings).splits()
        message = str(e.value)
        assert message.startswith("bad settings for task 'text': data_file ") and "\n" not in message
        return message

    assert "no such file; give --set data_file=PATH" in error("nope.txt")
    (tmp_path / "empty.txt").write_text("")
    assert "empty.txt is empty" in error("empty.txt")
    (tmp_path / "latin.txt").write_bytes(b"abc" * 1000 + b"caf\xe9" + b"abc" * 1000)
    assert "is not UTF-8 (byte offset 3,003: 0xe9); read it byte by byte with --set tokens=byte" in error("latin.txt")
    make(data_file=str(tmp_path / "latin.txt"), tokens="byte", context=16).splits()
    # too short: the message names the exact minimum, which fits one window per split; one less does not
    (tmp_path / "short.txt").write_text("x" * 600)
    message = error("short.txt", context=32)
    assert (
        "has 600 characters, too short for one window of context+1=33 in each of train/valid/test (90/5/5)" in message
    )
    need = int(
        re.search(r"it must be at least ([\d,]+) characters, or lower --set context", message).group(1).replace(",", "")
    )
    assert 20 * 33 - 20 <= need <= 20 * 33
    (tmp_path / "short.txt").write_text("x" * need)
    data = make(data_file=str(tmp_path / "short.txt"), context=32).splits()
    assert len(data["valid"]) == len(data["test"]) == 1
    (tmp_path / "short.txt").write_text("x" * (need - 1))
    assert f"has {need - 1:,} characters" in error("short.txt", context=32)


def test_builtin_corpus_is_the_king_james_bible():
    task = make(eval_tokens=1024)
    data = task.splits()
    text = data["train"].text
    assert len(text) >= 1_000_000 and len(text.encode()) >= 1_000_000
    assert text.startswith("Genesis\n\nIn the beginning God created the heaven and the earth.\n")
    assert "For God so loved the world, that he gave his only begotten Son" in text
    assert len(task.src_vocab) == 69 and set("aeAZ .,;:\n") <= set(task.src_vocab.itos)
    assert len(data["train"]) == (int(len(text) * 0.9) - 1) // 512 and len(data["valid"]) == len(data["test"]) == 2


def test_tiny_run_reports_bpc(tmp_path, tiny_run):
    text = {"context": 32, "train_tokens": 2048, "eval_tokens": 256}
    df = tiny_run(tmp_path, task="text", model="lm", pattern="local:w=8", batch_size=4, max_steps=2, **text).rows
    assert set(df.split) == {"train", "valid", "test"} and (df.context_len == 32).all()
    for _, row in df.iterrows():
        assert json.loads(row.metrics)["bpc"] == pytest.approx(row.loss / math.log(2))
    bad = tiny_run(tmp_path / "bad", task="text", model="lm", data_file=tmp_path / "nope", exit_code=2)
    assert "Error: bad settings for task 'text': data_file" in bad.result.output
    assert not (tmp_path / "bad").exists()


def test_unknown_characters_are_unk(tmp_path):
    text = "ab" * 1000 + "c" * 200  # c only after the train split (its first 1,980 characters)
    (tmp_path / "a.txt").write_text(text)
    task = make(data_file=str(tmp_path / "a.txt"), context=8)
    task.splits()
    assert "c" not in task.src_vocab.stoi and task.src_vocab.encode("c") == [task.src_vocab.stoi[UNK]]
