"""gtx frontier: families, TOST by hand, FLOP counting, and a tiny frontier end to end (killed and resumed)."""

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from kit import TINY_MODEL, TINY_TRAIN, sets

from gtx.errors import GtxError
from gtx.pictures import plot
from gtx.pictures.report import write_report
from gtx.records.results import load
from gtx.records.stats import tost_p
from gtx.run.cost import FlopCount
from gtx.sweeps.frontier_tables import load_frontiers
from gtx.sweeps.study import parse_family


def t_cdf_4(t):
    """Student's t CDF with 4 degrees of freedom, in closed form (no scipy)."""
    x = t / math.sqrt(t * t + 4)
    return 0.5 + 0.75 * x * (1 - x * x / 3)


def t_cdf_2(t):
    return 0.5 + t / (2 * math.sqrt(2 + t * t))


def test_tost_by_hand_equal_variances_three_each():
    a, b = [0.90, 0.92, 0.94], [0.91, 0.93, 0.95]
    # d = -0.01; each variance 0.0004, so se = sqrt(2 * 0.0004 / 3); Welch's df = 4 exactly
    se = math.sqrt(2 * 0.0004 / 3)
    for margin in (0.05, 0.02):
        p_low = 1 - t_cdf_4((-0.01 + margin) / se)  # H0: d <= -margin
        p_high = t_cdf_4((-0.01 - margin) / se)  # H0: d >= margin
        assert tost_p(a, b, margin) == pytest.approx(max(p_low, p_high), rel=1e-9)
    # equivalent within 5 points
    assert tost_p(a, b, 0.05) == pytest.approx(0.03524, abs=1e-5) and tost_p(a, b, 0.05) < 0.05
    assert tost_p(a, b, 0.02) > 0.05  # not within 2 points: too few seeds to tell


def test_tost_by_hand_two_each_and_the_edges():
    a, b = [1.0, 1.2], [1.05, 1.25]  # d = -0.05, both variances 0.02 over n = 2: Welch's df = 2, se = sqrt(0.02)
    se = math.sqrt(0.02)
    p = max(1 - t_cdf_2((-0.05 + 0.3) / se), t_cdf_2((-0.05 - 0.3) / se))
    assert tost_p(a, b, 0.3) == pytest.approx(p, rel=1e-9)
    assert tost_p([1, 1, 1], [1.005, 1.005], 0.01) == 0.0 and tost_p([1, 1], [1.02, 1.02], 0.01) == 1.0  # no spread
    assert math.isnan(tost_p([1.0], [1.0, 2.0], 0.1)) and math.isnan(tost_p([1.0, math.nan], [1.0, 2.0], 0.1))
    with pytest.raises(ValueError, match="margin"):
        tost_p(a, b, 0.0)


def test_tost_agrees_with_the_90_percent_interval():
    """Equivalent at alpha = 0.05 exactly when the 90% Welch interval of the difference lies inside the margin."""
    from scipy import stats as sps

    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        a, b = (torch.rand(n, generator=rng).double().tolist() for n in (3, 4))
        va, vb = torch.tensor(a).var().item() / 3, torch.tensor(b).var().item() / 4
        df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
        d, half = sum(a) / 3 - sum(b) / 4, sps.t.ppf(0.95, df) * math.sqrt(va + vb)
        margin = float(torch.rand(1, generator=rng)) * 0.5 + 0.01
        assert (tost_p(a, b, margin) < 0.05) == (-margin < d - half and d + half < margin)


def test_families():
    f = parse_family("moba:b=16,k=2,4,8")
    assert (f.name, f.param, f.budgets) == ("moba b=16", "k", ("2", "4", "8"))
    assert f.specs == tuple(f"moba:b=16,k={k},gate=token" for k in (2, 4, 8))
    assert (
        parse_family("local:w=4,8").specs == ("local:w=4", "local:w=8") and parse_family("local:w=4,8").name == "local"
    )
    assert parse_family("moba:b=8,k=2,3,gate=block").name == "moba b=8 gate=block" and parse_family("nsa").param is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("local:q=1,2", "has no parameter 'q'"),
        ("moba:b=1,2,k=3,4", "one budget parameter"),
        ("local:w=4,,8", "empty item"),
        ("local:16", "follows no parameter"),
        ("full", "baseline"),
        ("nope:w=1,2", "unknown pattern"),
        ("local:w=4,4", "same pattern"),
    ],
)
def test_bad_families(text, match):
    with pytest.raises(GtxError, match=match):
        parse_family(text)


def test_an_operator_after_the_budgets_applies_to_every_budget():
    assert parse_family("local:w=8,16+alibi").specs == ("local:w=8+alibi", "local:w=16+alibi")
    union = parse_family("local:w=8,16|strided:l=8")
    assert (
        union.specs == ("local:w=8|strided:l=8", "local:w=16|strided:l=8")
        and union.budgets == ("8", "16")
        and union.name == "local |strided:l=8"
    )
    assert parse_family("local:w=8,16&strided:l=4").specs == ("local:w=8&strided:l=4", "local:w=16&strided:l=4")
    assert parse_family("moba:b=8,k=2,3,gate=block+alibi").specs[1] == "moba:b=8,k=3,gate=block+alibi"
    with pytest.raises(GtxError, match="only the first pattern's parameter may list budgets"):
        parse_family("strided:l=8|local:w=8,16")


@pytest.mark.parametrize(
    "margin, match",
    [
        (math.inf, "must be a finite number > 0"),
        (math.nan, "finite"),
        (-0.1, "> 0"),
        (1e308, "query_acc lies in \\[0, 1\\]"),
        (1.0, "a margin of 1 or more"),
    ],
)
def test_margins_that_call_everything_equivalent_are_refused(margin, match):
    from gtx.sweeps.frontier import check_margin

    with pytest.raises(GtxError, match=match):
        check_margin(margin, ["best_valid_query_acc"])
    check_margin(1e3, ["best_valid_bpc"])  # bpc has no upper bound


def test_flops_are_counted_per_linear_row_and_attended_edge():
    from gtx.attention.module import Attention
    from gtx.backends import get_backend
    from gtx.graph.spec import parse_pattern
    from gtx.graph.tokens import EdgeSet

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.attention = torch.nn.Linear(8, 6), Attention(get_backend("dense", torch.device("cpu")))

        def forward(self, x, edges):
            q = self.proj(x).view(len(x), 2, 3)
            return self.attention(q, q, q, edges)

    n = 10
    src, dst = parse_pattern("local:w=3").edges("dd", n, n)
    edges = EdgeSet(src, dst, n, n, "dd")
    edges.pattern = parse_pattern("local:w=3")
    model = Model()
    with FlopCount(model) as f:
        model(torch.randn(n, 8), edges)
    assert f.dense == 2 * 8 * 6 * n
    assert f.attention == 2 * len(src) * 2 * (3 + 3)  # per edge and head: q.k and the sum over v
    assert f.total == f.dense + f.attention


#: recall at its smallest: 2 pairs of 4 keys and 4 values, each key queried once
TINY_RECALL = {"n_pairs": 2, "queries_per_key": 1, "n_keys": 4, "n_values": 4, "train_min_len": 0}
#: gtx frontier's options for a tiny lm on it: 24 training sequences, 2 epochs
RECALL = [
    *("--task", "recall", "--model", "lm"),
    *sets({**TINY_MODEL, **TINY_TRAIN, **TINY_RECALL, "epochs": 2, "n_train": 24, "n_valid": 8, "n_test": 8}),
]
STUDY = ["--family", "local:w=4,24", "--lengths", "16,32", "--seeds", "0-1", "--margin", "0.5", "-j", "2", "--quiet"]
FRONTIER = [sys.executable, "-m", "gtx.cli", "frontier"]
TIMING = ["tokens/s", "vs_full", "train_s"]  # measured, so never equal between two runs


def science(output: str) -> list[list[str]]:
    """The frontier table's rows without its timing columns."""
    lines = [line.split("  ") for line in output.split("\n\n")[0].splitlines() if line.strip()]
    rows = [[c.strip() for c in line if c.strip()] for line in lines]
    keep = [i for i, name in enumerate(rows[0]) if name not in TIMING]
    return [[row[i] for i in keep] for row in rows]


def test_frontier_end_to_end_killed_and_run_again(tmp_path, cli):
    ref = tmp_path / "ref"
    first = cli("frontier", *RECALL, *STUDY, "--results", ref)
    assert first.exit_code == 0, first.output
    assert "local:w=24' attends to every candidate at 15 tokens" in first.output  # dropped at length 16, kept at 32
    table = science(first.output.split("sweep ")[-1].split("\n", 1)[1])
    assert [row[:5] for row in table[1:]] == [
        ["recall", "lm", "16", "full", "-"],
        ["recall", "lm", "16", "local", "4"],
        ["recall", "lm", "32", "full", "-"],
        ["recall", "lm", "32", "local", "4"],
        ["recall", "lm", "32", "local", "24"],
    ]
    assert load(ref).query("split == 'test'").cell.nunique() == 10  # 5 points x 2 seeds
    again = cli("frontier", *RECALL, *STUDY, "--results", ref, "--dry-run")
    assert again.exit_code == 0 and "gtx run" not in again.output  # every cell reused
    ((name, saved),) = load_frontiers(ref).items()  # the table as numbers, and its figure beside it
    assert (
        len(saved) == 5
        and saved.length.tolist() == ["16", "16", "32", "32", "32"]
        and (ref / "frontiers" / f"{name}.png").is_file()
    )
    page = write_report(ref).read_text()
    # the saved table keeps its margin
    assert plot.frontier(saved).axes and "<h2>Frontiers</h2>" in page and "TOST against full at margin 0.5" in page

    res = tmp_path / "res"
    proc = subprocess.Popen(
        [*FRONTIER, *RECALL, *STUDY, "--results", str(res)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and len(list((res / "runs").glob("*.csv"))) < 3:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 0 < len(load(res).query("split == 'test'")) < 10  # killed midway
    second = cli("frontier", *RECALL, *STUDY, "--results", res)
    assert second.exit_code == 0, second.output
    test = load(res).query("split == 'test'")
    assert len(test) == 10 and test.cell.nunique() == 10  # every cell finished once
    assert science(second.output.split("sweep ")[-1].split("\n", 1)[1]) == table


@pytest.fixture(scope="module")
def small(tmp_path_factory, cli):
    """A finished frontier of two cells (full and local:w=4 at 32 tokens, seed 0), and how it was asked for."""
    folder = tmp_path_factory.mktemp("small")
    args = ["frontier", *RECALL, "--lengths", "32", "--seeds", "0", "-j", "2", "--quiet", "--results", str(folder)]
    result = cli(*args, "--family", "local:w=4")
    assert result.exit_code == 0, result.output
    return folder, args


def test_table_only_names_the_budgets_and_cells_without_runs(small, cli):
    folder, args = small
    before = sorted((folder / "frontiers").iterdir())
    result = cli(*args, "--family", "local:w=4,8", "--seeds", "0-1", "--table-only")
    assert result.exit_code == 1, result.output
    assert "partial frontier: 4 of 6 cells have no finished run" in result.output and "is not saved" in result.output
    assert (
        "recall lm seq_len=32: local 8, seeds 0, 1" in result.output
        and "recall lm seq_len=32: full -, seed 1" in result.output
    )
    assert "recall lm seq_len=32: local 4, seed 1" in result.output
    assert sorted((folder / "frontiers").iterdir()) == before  # a partial table is never saved


def test_cells_running_elsewhere_are_named_not_left_out_silently(small, monkeypatch, cli):
    from gtx.records import claims

    folder, args = small
    monkeypatch.setattr(claims, "claim", lambda results_dir, key: "4242@elsewhere")  # another frontier holds every cell
    monkeypatch.setattr(claims, "holder", lambda path: "4242@elsewhere")
    result = cli(*args, "--family", "local:w=4,8")
    assert result.exit_code == 1, result.output
    assert (
        "recall lm seq_len=32: local 8, seed 0 (running in 4242@elsewhere)" in result.output
        and "partial frontier: 1 of 3 cells" in result.output
    )
    assert load(folder).query("split == 'test'").cell.nunique() == 2  # nothing ran here
    assert len(load_frontiers(folder)) == 1


def test_each_reading_is_saved_under_its_metric_and_margin(small, cli):
    folder, args = small
    for margin in ("0.5", "0.25"):
        result = cli(*args, "--family", "local:w=4", "--table-only", "--margin", margin)
        assert result.exit_code == 0, result.output
    names = sorted(load_frontiers(folder))
    assert len(names) == 3 and [n.rsplit("-", 2)[1:] for n in names] == [
        ["query_acc", "margin0.01"],
        ["query_acc", "margin0.25"],
        ["query_acc", "margin0.5"],
    ]
    assert {float(t.margin.iloc[0]) for t in load_frontiers(folder).values()} == {0.01, 0.25, 0.5}


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ["--family", "local:w=4,8", "--lengths", "16", "--margin", "0"],
            "margin 0.0: an equivalence margin must be a finite number > 0",
        ),
        (
            ["--family", "local:w=4,8", "--lengths", "16", "--margin", "inf"],
            "margin inf: an equivalence margin must be a finite number > 0",
        ),
        (["--family", "local:w=4,8", "--lengths", "16", "--margin", "1e308"], "query_acc lies in [0, 1]"),
        (
            ["--family", "strided:l=4|local:w=4,8", "--lengths", "16"],
            "only the first pattern's parameter may list budgets",
        ),
        (["--family", "local:x=4,8", "--lengths", "16"], "has no parameter 'x'"),
        (["--family", "local:w=4,8", "--lengths", "4"], "seq_len=4 is too small"),
        (["--family", "local:w=4,8", "--lengths", "16", "--length-key", "nope"], "nope"),
        (["--family", "moba:b=32,k=1,2", "--lengths", "16"], "moba"),
        (["--family", "local:w=4,8", "--lengths", "16", "--length-key", ""], "--length-key '': name the task setting"),
        (["--family", "local:w=4,8", "--lengths", "16,16"], "--lengths 16,16: a length named twice"),
        (  # --dry-run: refused before the plan is printed (the cells ran, then the table refused it)
            ["--family", "local:w=4,8", "--lengths", "16", "--metric", "nonexist", "--dry-run"],
            "--metric nonexist: runs of task 'recall' do not record it; they record loss, query_acc, seq_acc",
        ),
        (["--family", "local:w=4,8", "--lengths", "16,abc"], "'abc' is not a length"),
        (
            ["--family", "local:w=4,8", "--family", "local:w=4,8", "--lengths", "16"],
            "--family 'local' is given twice (w=4,8 and w=4,8)",
        ),
        (
            ["--family", "moba:b=4,k=1,2", "--family", "moba:k=1,b=4,8", "--lengths", "16"],
            "pattern 'moba:b=4,k=1,gate=token' is a budget of two families ('moba b=4' and 'moba k=1')",
        ),
        (
            ["--decode-family", "local:w=4,8", "--lengths", "16"],
            "--decode-pattern local:w=4: task 'recall' is not scored by generation",
        ),
        (
            [
                "--family",
                "local:w=4",
                "--decode-family",
                "local:w=8",
                "--set",
                "decode_pattern=full",
                "--lengths",
                "16",
            ],
            "--set decode_pattern=...: a frontier sets each cell's decode pattern from its families",
        ),
        (["--lengths", "16"], "give the budgets to study: --family, --prefill-family or --decode-family"),
    ],
)
def test_bad_frontiers_say_so_in_one_line_and_run_nothing(tmp_path, args, match, cli):
    result = cli("frontier", *RECALL, *args, "--results", tmp_path / "r")
    assert result.exit_code == 2, result.output
    assert match in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r" / "runs").exists()


def test_the_frontier_figure_refuses_other_tables():
    import pandas as pd

    with pytest.raises(GtxError, match="not a frontier table: missing"):
        plot.frontier(pd.DataFrame({"task": ["copy"], "pattern": ["full"]}))
