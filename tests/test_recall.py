"""recall (multi-query associative recall): layout, distances, splits, settings, metrics, a tiny run."""

import json
import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx.data.task import SPLITS
from gtx.errors import GtxError
from gtx.plugins.registry import TASKS

SMALL = dict(seq_len=64, n_pairs=4, n_keys=8, n_values=8, n_train=40, n_valid=10, n_test=10)
TINY = {**SMALL, "seq_len": 40, "n_train": 16, "n_valid": 4, "n_test": 4}  # the shortest that holds 4 pairs x 4 queries


def module():
    TASKS.get("recall")  # loads the built-in plugins
    return next(m for n, m in sys.modules.items() if n.startswith("gtx_plugin_recall"))


def config(**overrides):
    return TASKS.get("recall").config(**{**SMALL, **overrides})


def make(**overrides):
    return TASKS.get("recall").obj("recall", config(**overrides))


def check_layout(c, tokens, groups):
    """Every invariant of one example: pairs, queries, filler, groups and their distances."""
    mod = module()
    p = c.n_pairs
    assert len(groups) == len(tokens) - 1
    keys = tokens[0 : 2 * p : 2]
    assert len(set(keys)) == p and all(k.startswith("k") for k in keys)
    assert all(v.startswith("v") for v in tokens[1 : 2 * p : 2])
    value = dict(zip(keys, tokens[1 : 2 * p : 2]))
    last = {k: 2 * i for i, k in enumerate(keys)}
    queries = []
    for i in range(2 * p, len(tokens)):
        if tokens[i].startswith("k"):  # a key in the query section is always a scored query
            assert groups[i] and tokens[i + 1] == value[tokens[i]]
            assert groups[i] == mod.bucket(i - last[tokens[i]], max(4, len(str(c.seq_len))))
            last[tokens[i]] = i
            queries.append(tokens[i])
        else:
            assert tokens[i].startswith("v") and (i == len(tokens) - 1 or not groups[i])
    assert not any(groups[: 2 * p])
    assert sorted(queries) == sorted(keys * c.queries_per_key)


def test_layout_and_lengths():
    c = config(train_min_len=40)
    data = make(train_min_len=40).generate()
    for split in SPLITS:
        for tokens, groups in data[split]:
            check_layout(c, tokens, groups)
            assert len(tokens) == 64 if split != "train" else 40 <= len(tokens) <= 64
    assert len({len(t) for t, _ in data["train"]}) > 3  # the training lengths are mixed
    clipped = make(train_min_len=4, seq_len=48).generate()["train"]  # below what 4 pairs x 4 queries need
    assert {len(t) for t, _ in clipped} <= set(range(40, 49)) and {
        len(t) for t, _ in make(train_min_len=0).generate()["train"]
    } == {64}


@settings(max_examples=40, deadline=None)
@given(
    n_pairs=st.integers(1, 6),
    queries_per_key=st.integers(1, 3),
    extra=st.integers(0, 40),
    placement=st.sampled_from(["power", "uniform"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_layout_property(n_pairs, queries_per_key, extra, placement, seed):
    c = config(
        n_pairs=n_pairs,
        queries_per_key=queries_per_key,
        placement=placement,
        seq_len=2 * n_pairs * (1 + queries_per_key) + extra,
    )
    tokens, groups = module().make_example(c, np.random.default_rng(seed), c.seq_len)
    assert len(tokens) == c.seq_len
    check_layout(c, tokens, groups)


def test_vocabularies_are_fixed_and_disjoint():
    task = make()
    task.splits()
    keys = {t for t in task.src_vocab.itos if t.startswith("k")}
    values = {t for t in task.src_vocab.itos if t.startswith("v")}
    assert len(keys) == 8 and len(values) == 8 and not keys & values
    assert task.src_vocab is task.tgt_vocab or task.src_vocab == task.tgt_vocab
    assert task.context_len() == 63  # an lm reads tokens[:-1]


def test_deterministic_disjoint_and_seeded():
    a, b = make().generate(), make().generate()
    assert a == b
    sequences = [tuple(t) for split in SPLITS for t, _ in a[split]]
    assert len(sequences) == len(set(sequences)) == 60
    assert make(seed=1).generate() != a


def test_power_placement_puts_queries_near_the_pairs():
    c = config(seq_len=1024, n_valid=1, n_test=1)
    rng = np.random.default_rng(0)
    mod = module()
    near = {p: 0 for p in mod.PLACEMENTS}
    for placement in near:
        for _ in range(50):
            tokens, _ = mod.make_example(config(seq_len=1024, placement=placement), rng, c.seq_len)
            near[placement] += sum(t.startswith("k") for t in tokens[8:136])
    assert near["power"] > 3 * near["uniform"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(seq_len=30, n_pairs=8, n_keys=8, queries_per_key=1),
            "seq_len=30 is too small for n_pairs=8 with queries_per_key=1: need seq_len >= 32",
        ),
        (dict(n_pairs=8, n_keys=8), "seq_len=64 is too small for n_pairs=8 with queries_per_key=4: need seq_len >= 80"),
        (
            dict(n_pairs=9),
            "n_pairs=9 needs n_keys >= 9 (the keys of a sequence are distinct); raise n_keys or lower n_pairs",
        ),
        (dict(n_values=1), "n_values=1: need at least 2 values"),
        (dict(n_pairs=0), "n_pairs=0 and queries_per_key=4 must be >= 1"),
        (dict(train_min_len=-1), "train_min_len=-1 must be >= 0"),
        (dict(placement="zipf"), "placement='zipf': choose power or uniform"),
    ],
)
def test_bad_settings_name_the_setting_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as e:
        config(**overrides)
    assert message in str(e.value)


def test_bad_settings_through_the_cli_are_one_line(tmp_path, tiny_run):
    bad = tiny_run(tmp_path, task="recall", model="lm", seq_len=64, n_pairs=16, exit_code=2)
    assert "bad settings for task 'recall': seq_len=64 is too small for n_pairs=16" in bad.result.output
    assert not bad.folder.exists()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 8191), st.integers(0, 8191))
def test_buckets_sort_by_distance_and_hold_it(a, b):
    bucket = module().bucket
    name = bucket(a)
    lo, hi = (int(x) for x in name[1:].split("-"))
    assert lo <= a <= hi and len(name) == 10
    if a <= b:
        assert bucket(a) <= bucket(b)


def test_bucket_edges_fit_a_window_of_32():
    bucket = module().bucket
    assert [bucket(d) for d in (0, 31, 32, 63, 64, 1023, 8191)] == [
        "d0000-0031",
        "d0000-0031",
        "d0032-0063",
        "d0032-0063",
        "d0064-0127",
        "d0512-1023",
        "d4096-8191",
    ]
    assert bucket(10000, 5) == "d08192-16383"


def test_phase_metrics():
    task = make()
    m = task.phase_metrics(1.0, {"d0032-0063": (1, 4), "d0000-0031": (3, 4), "d0064-0127": (0, 0)}, "valid")
    assert m["query_acc"] == 0.5
    assert m["query_acc_by_distance"] == {"d0000-0031": 0.75, "d0032-0063": 0.25}
    assert list(m["queries_by_distance"].items()) == [("d0000-0031", 4), ("d0032-0063", 4), ("d0064-0127", 0)]
    assert math.isnan(task.phase_metrics(1.0, {}, "valid")["query_acc"])


def test_bad_settings_in_splits_become_gtx_errors(monkeypatch):
    task = make()
    monkeypatch.setattr(type(task.config), "__post_init__", lambda self: None)
    task.config.n_pairs = 100
    with pytest.raises(GtxError, match="bad settings for task 'recall'"):
        task.splits()


def test_tiny_run_reports_query_accuracy_by_distance(tmp_path, tiny_run):
    df = tiny_run(tmp_path, task="recall", model="lm", pattern="local:w=4", **TINY).rows
    assert set(df.split) == {"train", "valid", "test"} and set(df.task) == {"recall"}
    metrics = json.loads(df[df.split == "test"].metrics.iloc[0])
    assert 0 <= metrics["query_acc"] <= 1
    assert sum(metrics["queries_by_distance"].values()) == 4 * 4 * 4  # 4 test sequences x 4 pairs x 4 queries each
    assert list(metrics["queries_by_distance"]) == sorted(metrics["queries_by_distance"])


def test_a_length_past_the_models_positions_is_refused_before_the_data_is_made(tmp_path, monkeypatch, tiny_run):
    """seq_len=100,000,000 once generated gigabytes of data before the check: the declared length is checked first."""
    made = []
    monkeypatch.setattr(TASKS.get("recall").obj, "generate", lambda self: made.append(1))
    result = tiny_run(tmp_path, task="recall", model="lm", seq_len=100000000, exit_code=2).result
    assert "has sequences of 99999999 tokens but model 'lm' has positions for" in result.output, result.output
    assert not made and not any(tmp_path.iterdir())
