"""Paired tests of runs scored by generation: exact McNemar and the paired bootstrap by hand, the
refusal of runs over other samples, the frontier's compression and its largest budget not
significantly worse than full, and a tiny frontier of a pretrained model (prefill and decode
families) end to end."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from rows import row
from scipy import stats as sps

from gtx.errors import GtxError
from gtx.records.paired import Outcomes, paired_against, run_outcomes
from gtx.records.results import validate
from gtx.records.stats import bootstrap_p, mcnemar_p, paired_test
from gtx.sweeps.frontier import Point, frontier_table
from gtx.sweeps.frontier_tables import format_frontier, largest_not_worse
from gtx.sweeps.study import ALL, DECODE, PREFILL
from gtx.sweeps.sweep import Cell


@pytest.mark.parametrize(
    "worse, better, two, one",
    [
        (7, 1, 18 / 256, 9 / 256),  # P(X <= 1) of Binomial(8, 1/2) = 9/256; P(X >= 7) the same
        (1, 7, 18 / 256, 1 - 1 / 256),  # the run better: not worse, P(X >= 1) = 255/256
        (3, 3, 1.0, 42 / 64),  # 2 P(X <= 3) = 84/64, at most 1; P(X >= 3) = (20 + 15 + 6 + 1) / 64
        (5, 0, 2 / 32, 1 / 32),
        (0, 0, 1.0, 1.0),  # no discordant pair: nothing to test
    ],
)
def test_exact_mcnemar_by_hand(worse, better, two, one):
    p, p_worse = mcnemar_p(worse, better)
    assert p == pytest.approx(two, rel=1e-12) and p_worse == pytest.approx(one, rel=1e-12)
    if worse + better:  # scipy's exact binomial test agrees (two-sided, and the one-sided tail)
        assert p == pytest.approx(sps.binomtest(worse, worse + better, 0.5).pvalue, rel=1e-12)
        assert p_worse == pytest.approx(sps.binomtest(worse, worse + better, 0.5, "greater").pvalue, rel=1e-12)


def test_paired_test_counts_the_discordant_pairs():
    full = [1, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    mine = [0, 1, 0, 1, 0, 1, 0, 1, 0, 0]  # 4 lost (0, 2, 6, 9), 1 won (5)
    t = paired_test(mine, full)
    assert (t.test, t.n, t.worse, t.better) == ("mcnemar", 10, 4, 1)
    assert t.base_acc == 0.7 and t.acc == 0.4 and (t.p, t.p_worse) == mcnemar_p(4, 1)
    with pytest.raises(ValueError, match="the same samples"):
        paired_test(mine[:-1], full)


def test_the_paired_bootstrap():
    rng = np.random.default_rng(1)
    full = rng.uniform(0.3, 1.0, 200)
    mine = np.clip(full - 0.05 + rng.normal(0, 0.2, 200), 0, 1)  # fractional: recall of items
    t = paired_test(mine.round(4), full.round(4))
    assert t.test == "bootstrap" and t.worse + t.better <= 200
    # the bootstrap of the mean difference agrees with the paired t-test's normal theory at n = 200
    d = mine.round(4) - full.round(4)
    ttest = sps.ttest_1samp(d, 0.0)
    assert t.p == pytest.approx(ttest.pvalue, abs=0.02) and t.p_worse == pytest.approx(ttest.pvalue / 2, abs=0.02)
    assert (t.p, t.p_worse) == bootstrap_p(d)  # a fixed seed: the same p every time
    # a constant loss: no resample is as extreme, p is the least it can be; no difference at all: 1
    assert bootstrap_p([-0.5] * 30, resamples=999) == (1 / 1000, 1 / 1000)
    assert bootstrap_p([0.0] * 30, resamples=999) == (1.0, 1.0)
    assert bootstrap_p([0.5] * 30, resamples=999)[1] == 1.0  # better, never worse


def outcomes(run_id, values, seed=0, sample_seed=0, settings="{}"):
    return Outcomes(run_id, seed, sample_seed, tuple(values), settings)


def test_runs_over_other_samples_are_refused_in_one_line():
    full = [outcomes("f0", [1, 0, 1])]
    assert paired_against([outcomes("a0", [1, 1, 1])], full, "x").worse == 0
    assert paired_against([outcomes("a1", [1, 1, 1], seed=1)], full, "x") is None  # no seed pairs
    assert paired_against([None], full, "x") is None
    for other, why in (
        (outcomes("a0", [1, 1]), "2 samples drawn by seed 0 against 3 drawn by seed 0"),
        (outcomes("a0", [1, 1, 1], sample_seed=4), "3 samples drawn by seed 4 against 3 drawn by seed 0"),
        (outcomes("a0", [1, 1, 1], settings='{"task.context": 64}'), "other task settings"),
    ):
        with pytest.raises(GtxError, match="did not score the same samples") as e:
            paired_against([other], full, "niah hf context=400: sinks 4")
        assert why in str(e.value) and "niah hf context=400: sinks 4" in str(e.value)
        assert len(str(e.value).splitlines()) == 1


def generation_run(run_id, pattern, values, dd=100.0, read=50.0, cell=None, valid_epochs=(0,), sample_seed=0):
    """A run scored untrained by generation (valid and test rows, no train row): its outcomes and
    the keys its queries read (``dd``: the prompt's; ``read``: the generated tokens')."""
    metrics = {
        "answer_acc": float(np.mean(values)),
        "outcomes": list(values),
        "samples": len(values),
        "sample_seed": sample_seed,
        "decode_edges_per_query": read,
    }
    common = dict(task="niah", model="hf", cell=cell or run_id, experiment=cell or run_id, metrics=json.dumps(metrics))
    common |= dict(edges_per_query_ee=np.nan, edges_per_query_ed=np.nan, edges_per_query_dd=dd, density=dd / 200)
    rows = [row(run_id, pattern, "valid", epoch=e, **common) for e in valid_epochs]
    return [*rows, row(run_id, pattern, "test", epoch=valid_epochs[-1], **common)]


def study(*arms):
    """Cells and points of hand-made arms: (key, family, budget, phase, spec) at one length."""
    cells, points = [], {}
    for i, (key, family, budget, phase, spec) in enumerate(arms):
        config = SimpleNamespace(task="niah", model="hf", pattern=spec, settings={"task.context": "400"})
        cells.append(Cell(i, config, key, key))
        points[key] = Point(family, budget, "400", "task.context", i, phase, spec)
    return cells, points


ARMS = [
    ("full", None, "-", ALL, "full"),
    ("s16", "sinks s=4 (prefill)", "16", PREFILL, "sinks:s=4,w=16"),
    ("s48", "sinks s=4 (prefill)", "48", PREFILL, "sinks:s=4,w=48"),
    ("q4", "quest p=16 (decode)", "4", DECODE, "quest:p=16,k=4"),
]


def test_the_largest_compression_not_significantly_worse():
    full = [1] * 20
    df = validate(
        pd.DataFrame(
            [
                *generation_run("full", "full", full, dd=200.0, read=400.0),
                # 4x fewer prompt keys, 6 answers lost: McNemar one-sided p = 1/64, worse
                *generation_run("s16", "sinks:s=4,w=16", [0] * 6 + [1] * 14, dd=50.0),
                # 2x fewer, 1 lost: p = 1/2, not worse
                *generation_run("s48", "sinks:s=4,w=48", [0] + [1] * 19, dd=100.0),
                # the prompt under full, 40 keys a generated token against full's 400: 10x
                *generation_run("q4", "full", full, dd=200.0, read=40.0),
            ]
        )
    )
    table = frontier_table(*study(*ARMS), df, margin=0.05)
    by = table.set_index("budget")
    assert by.compression.tolist() == [1.0, 4.0, 2.0, 10.0]
    assert by.loc["4", "density"] == pytest.approx(0.1) and by.loc["4", "edges_per_query"] == 40.0
    assert by.loc["4", "pattern"] == "quest:p=16,k=4" and by.loc["4", "phase"] == DECODE
    assert by.loc["16", "worse_pairs"] == 6 and by.loc["16", "worse_p"] == pytest.approx(1 / 64)
    assert by.sig_worse.tolist() == [False, True, False, False]
    assert by.largest_not_worse.tolist() == [False, False, True, True]
    assert math.isnan(by.loc["-", "pairs"]) and by.loc["48", "paired_test"] == "mcnemar"
    picks = largest_not_worse(table).set_index("family")
    assert picks.largest.tolist() == ["48", "4"] and picks.compression.tolist() == [2.0, 10.0]
    shown = format_frontier(table)
    assert "compression" in shown and "worse/better" in shown and "6/0" in shown and "10.0x" in shown
    # every budget worse: none; runs without outcomes: untested
    df2 = validate(
        pd.DataFrame(
            [
                *generation_run("full", "full", full),
                *generation_run("s16", "sinks:s=4,w=16", [0] * 10 + [1] * 10),
                *generation_run("s48", "sinks:s=4,w=48", [0] * 10 + [1] * 10),
            ]
        )
    )
    picks = largest_not_worse(frontier_table(*study(*ARMS[:3]), df2, margin=0.05))
    assert picks.largest.tolist() == ["none"]


def test_a_frontier_refuses_runs_over_other_samples():
    df = validate(
        pd.DataFrame(
            [
                *generation_run("full", "full", [1] * 20),
                *generation_run("s16", "sinks:s=4,w=16", [1] * 20, sample_seed=3),
            ]
        )
    )
    with pytest.raises(GtxError, match="sinks s=4 \\(prefill\\) 16: run s16 and full's run full"):
        frontier_table(*study(*ARMS[:2]), df, margin=0.05)


def test_outcomes_come_from_the_best_valid_epoch():
    rows = pd.DataFrame(generation_run("r", "full", [1, 0], valid_epochs=(1, 2, 3)))
    accs = [0.2, 0.9, 0.5]
    rows.loc[rows.split == "valid", "metrics"] = [
        json.dumps({"answer_acc": a, "outcomes": [a], "sample_seed": 0}) for a in accs
    ]
    assert run_outcomes(rows, "best_valid_answer_acc").outcomes == (0.9,)
    assert run_outcomes(rows.assign(metrics="{}"), "best_valid_answer_acc") is None


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama saved as a pretrained folder (byte-level BPE of 300 tokens, 512 positions)."""
    pytest.importorskip("transformers")
    from pretrained import save_tiny

    return save_tiny(tmp_path_factory.mktemp("paired") / "llama", "llama", positions=512)


def test_a_pretrained_frontier_of_prefill_and_decode_families(tiny_folder, tmp_path, cli, monkeypatch):
    from gtx.records.results import load
    from gtx.sweeps import sweep as sw
    from gtx.sweeps.frontier_tables import load_frontiers
    from gtx.sweeps.launch import SweepCells

    def in_process(self, counts, on_change=None, on_failure=None):
        """The cells as the sweep runs them (its gtx run arguments), in this process: no start-up per cell."""
        for cell in self.cells:
            if cell.action != "skip":
                ran = cli(*sw.run_args(cell, self.results_dir))
                assert ran.exit_code == 0, ran.output
        return []

    monkeypatch.setattr(SweepCells, "run", in_process)

    args = ["frontier", "--task", "niah", "--model", "hf", "--set", f"path={tiny_folder}", "--epochs", "0"]
    args += ["--set", "new=3", "--set", "n_train=1", "--set", "n_valid=4", "--set", "n_test=1", "--lengths", "400"]
    args += ["--prefill-family", "sinks:s=4,w=32", "--decode-family", "sinks:s=4,w=8"]
    result = cli(*args, "--quiet", "--results", tmp_path)
    assert result.exit_code == 0, result.output
    assert "not worse than full: paired tests on the same samples" in result.output
    ((_, saved),) = load_frontiers(tmp_path).items()
    assert saved.family.tolist() == ["full", "sinks (prefill)", "sinks (decode)"]  # one budget each
    assert saved.phase.tolist() == [ALL, PREFILL, DECODE]
    assert saved.pattern.tolist() == ["full", "sinks:s=4,w=32", "sinks:s=4,w=8"]
    assert saved.pairs.tolist()[1:] == [4, 4] and saved.paired_test.tolist()[1:] == ["mcnemar", "mcnemar"]
    # the prompt's keys per query for the prefill family, the generated tokens' for the decode one
    assert saved.compression.iloc[0] == 1.0 and (saved.compression.iloc[1:] > 4).all()
    assert saved.edges_per_query.iloc[2] == 12.0  # 4 sinks and a window of 8: every generated query reads 12
    # the decode cell reads its prompt under full, the prefill cell its generated tokens
    df = load(tmp_path).query("split == 'test'")
    configs = sorted((p, json.loads(c)["train"].get("decode_pattern", "")) for p, c in zip(df.pattern, df.config))
    assert configs == [("full", ""), ("full", "sinks:s=4,w=8"), ("sinks:s=4,w=32", "full")]
