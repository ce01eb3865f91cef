"""Benchmarks produce their tables (tiny sizes here); the auto backend's choices are sensible."""

import json
import math
import os
import random
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from gtx.backends import get_backend
from gtx.backends.auto import estimate, work
from gtx.cli import cli
from gtx.data.batch import make_batch
from gtx.data.task import SPLITS, Task
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.measure import bench, reference
from gtx.measure.reference import SDPA_CAUSAL, SDPA_MASK, reference_model, references
from gtx.measure.train_bench import TRAIN_COLUMNS, TrainBench, bench_train
from gtx.model.engine import propagate_attention
from gtx.plugins.registry import MODELS


def test_bench_attention_cli_writes_a_table(tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "attention",
            "--pattern",
            "local:w=4",
            "--lengths",
            "96",
            "--backends",
            "dense,auto",
            "--repeats",
            "1",
            "--no-plot",
            "--format",
            "csv",
            "--results",
            str(tmp_path),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    files = list((tmp_path / "bench").glob("attention-*.csv"))
    df = pd.read_csv(files[0])
    assert list(df.columns) == bench.ATTENTION_COLUMNS and len(df) == 2
    assert df.ms.notna().all() and (df.edges > 0).all()
    assert set(df[df.backend == "auto"].choice) <= {
        "dense",
        "blocksparse:16",
        "blocksparse:32",
        "blocksparse:64",
        "dgl",
        "torch",
        "packed",
    }


def test_bench_attention_measures_each_cells_own_peak_memory():
    # dense builds (n, n) scores per head: at 2048 tokens and 4 heads, 64 MB each for scores, weights and their gradients;
    # the window's blocks are a small fraction of that
    df = bench.bench_attention(["local:w=4"], [2048], ["dense", "auto"], repeats=1).set_index("backend")
    # it read 0.0 for every backend
    assert df.peak_mem_mb["auto"] > 0 and df.peak_mem_mb["dense"] > 128 + df.peak_mem_mb["auto"]


def test_attention_cells_hold_plain_attention_as_training_does_without_its_edges():
    """A causal or complete cell is an edge set by its structure, as a training batch is: planning from
    8.4 M edges at 4096 tokens (their keys and checks) took 140 MB inside the steps' peak that no
    training step or plain torch row pays."""
    from dataclasses import replace

    from gtx.graph.spec import parse_pattern
    from gtx.graph.tokens import EdgeSet, batch_edges

    for spec, n, choice, count in (
        ("causal", 300, "flash-causal", 300 * 301 // 2),
        ("full", 200, "flash-complete", 200**2),
    ):
        cell = bench.AttentionCell(spec, n, "auto", repeats=1, warmup=0)
        bench.run_attention_cell(cell)  # plugins loaded: the pattern below is the one the cell runs
        pattern = parse_pattern(spec)
        pattern._cache.clear()
        row = bench.run_attention_cell(cell)
        assert parse_pattern(spec) is pattern and (row["edges"], row["choice"]) == (count, choice)
        assert not pattern._cache.get(("memo", "edges")), "the cell built its edges"
        # plain torch's mode from the declared structure, as from the edges themselves
        counted = replace(pattern, structures={}, _cache={})
        assert bench.sdpa_mode(batch_edges(pattern, "ee", [n], [n])) == bench.sdpa_mode(
            EdgeSet(*counted.edges("ee", n, n), n, n, "ee")
        )


def test_bench_attention_has_a_plain_torch_sdpa_row():
    df = bench.bench_attention(["causal", "full", "local:w=2"], [48], [bench.SDPA], repeats=1)
    assert list(df.backend) == ["sdpa"] * 3 and df.ms.notna().all()
    assert list(df.choice) == ["is_causal", "unmasked", "bool mask"]


def test_bench_attention_reports_a_failing_cell_instead_of_stopping():
    df = bench.bench_attention(["local:w=1"], [8], ["flex"], repeats=1)
    assert (
        df.ms.isna().all()
        and df.choice.iloc[0].startswith("error:")
        and "runs on the CPU without gradients only" in df.choice.iloc[0]
    )


def test_bench_attention_forward_times_the_forward_alone():
    df = bench.bench_attention(["local:w=2"], [64], ["dense", bench.SDPA], repeats=1, forward=True)
    assert df.ms.notna().all() and list(df["mode"]) == ["forward", "forward"]


def test_bench_train_compares_backends_and_torch_transformer():
    settings = {
        "n_train": "64",
        "n_valid": "8",
        "n_test": "8",
        "layers": "1",
        "dim": "16",
        "heads": "2",
        "dim_ff": "16",
        "batch_size": "16",
    }
    df = bench_train(
        TrainBench(
            "copy", "transformer", "full", ["auto", "dgl-seed"], steps=2, warmup_steps=1, settings=settings, rounds=2
        )
    )
    assert list(df.columns) == TRAIN_COLUMNS
    assert list(df.backend) == ["auto", "dgl-seed", "(no attention)", "torch.nn"] and (df.tokens_per_s > 0).all()
    assert (df.steps == 2).all() and (df.rounds == 2).all()
    assert json.loads(df.choice.iloc[0])  # auto's choices per stage
    assert df.attention_ms.iloc[2] == 0 and df.attention_ms.isna().iloc[3]
    # a backend's attention: its step minus the bound's, left empty where it ran faster than the bound
    # (noise); which of the two is faster depends on the machine's load, so neither is asserted
    bound = df.step_ms.iloc[2]
    assert df.step_ms.map(math.isfinite).all() and (df.step_ms > 0).all()
    for step, attention in zip(df.step_ms.iloc[:2], df.attention_ms.iloc[:2]):
        assert math.isnan(attention) if step < bound else attention == pytest.approx(step - bound)
    # torch.nn.Transformer is the reference; memory off
    assert df.vs_reference.iloc[3] == 1 and df.peak_mem_mb.isna().all()
    ut_settings = {**{k: v for k, v in settings.items() if k != "layers"}, "max_depth": "2"}
    ut = bench_train(
        TrainBench("copy", "ut", "local:w=2", ["auto"], steps=2, warmup_steps=1, settings=ut_settings, rounds=1)
    )
    assert list(ut.model) == ["ut", "ut", "ut[act=false]", "ut[act=false]"]
    assert list(ut.backend) == ["auto", "(no attention)", "auto", "(no attention)"]
    assert (ut.attention_ms.iloc[[1, 3]] == 0).all()  # each bound belongs to its own model variant


TINY_COPY = {"n_train": "16", "n_valid": "4", "n_test": "4", "layers": "1", "dim": "16", "heads": "2", "dim_ff": "16"}


@pytest.mark.parametrize("walls, median", [((1.0, 3.0), 2.0), ((1.0, 5.0, 2.0), 2.0), ((4.0,), 4.0)])
def test_a_row_reports_the_median_of_its_rounds(monkeypatch, walls, median):
    """Of an even number of rounds, the mean of the middle two: not the slower one, which would charge
    a row for whichever round a slow spell of the machine hit."""
    from gtx.measure import train_bench

    def rounds(bench, variants, data, log):  # tokens, seconds, data seconds per round
        return [[(1000, wall, wall / 10) for wall in walls] for _ in variants], [{} for _ in variants]

    monkeypatch.setattr(train_bench, "_time_rounds", rounds)
    bench = TrainBench("copy", "transformer", "full", ["auto"], steps=1, warmup_steps=1, settings=TINY_COPY)
    df = bench_train(bench)
    assert df.step_ms.tolist() == [pytest.approx(1000 * median)] * 3
    assert df.data_ms.tolist() == [pytest.approx(100 * median)] * 3
    assert df.tokens_per_s.tolist() == [pytest.approx(1000 / median)] * 3


def test_a_row_faster_than_its_ceiling_gets_no_attention_ms_or_ceiling_share(monkeypatch):
    """Timings where gtx's row beats the model without attention (noise): what would be derived from
    that ceiling is left empty and the run says so, rather than a negative attention time."""
    from gtx.measure import train_bench

    def rounds(bench, variants, data, log):  # tokens, seconds, data seconds per round: gtx, bound, reference
        walls = {"auto": 1.0, "(no attention)": 1.2, "torch.nn": 3.0}
        return [[(1000, walls[v.fields["backend"]], 0.1)] for v in variants], [{} for _ in variants]

    monkeypatch.setattr(train_bench, "_time_rounds", rounds)
    lines = []
    df = bench_train(
        TrainBench("copy", "transformer", "full", ["auto"], steps=1, warmup_steps=1, settings=TINY_COPY), lines.append
    )
    assert list(df.backend) == ["auto", "(no attention)", "torch.nn"]
    assert df.attention_ms.isna().iloc[0] and df.ceiling_share.isna().iloc[0]
    assert df.vs_reference.iloc[0] == 3.0  # what does not read the ceiling stays
    (line,) = [s for s in lines if s.startswith("ceiling:")]
    assert "transformer full auto ran faster" in line and "left empty" in line


def test_bench_train_times_a_round_as_one_pass_and_counts_only_timed_batches(tiny_task):
    """A round's timed batches go to the trainer as one pass (per-pass set-up is not charged to each
    step), the warm-up batches as another, untimed; each batch rebuilt under the run's pattern."""
    from types import SimpleNamespace

    from gtx.measure.train_bench import _time_steps

    pattern = parse_pattern("local:w=1")
    data = [make_batch(tiny_task, "train", [i, i + 1], parse_pattern("full")) for i in range(0, 8, 2)]
    passes = []
    run = SimpleNamespace(task=tiny_task, pattern_run=pattern, device=torch.device("cpu"))
    tokens, wall, data_s = _time_steps(lambda batches: passes.append(list(batches)), data, 1, run)
    assert [len(p) for p in passes] == [1, 3]
    assert all(b.graph.pattern is pattern for p in passes for b in p)
    assert tokens == sum(b.n_tokens for b in passes[1]) and 0 < data_s <= wall


def test_bench_train_cli_writes_a_table(tmp_path, monkeypatch):
    monkeypatch.setenv("GTX_CACHE", str(tmp_path / "cache"))
    sets = [
        a
        for kv in ("n_train=32", "n_valid=8", "n_test=8", "layers=1", "dim=16", "heads=2", "dim_ff=16", "batch_size=16")
        for a in ("--set", kv)
    ]
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "train",
            "--backends",
            "auto",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--no-baseline",
            "--no-memory",
            "--results",
            str(tmp_path),
            *sets,
        ],
    )
    assert result.exit_code == 0, result.output
    (path,) = (tmp_path / "bench").glob("train-*.csv")
    assert list(pd.read_csv(path).backend) == ["auto", "(no attention)"]


def tiny_text(tmp_path, context):
    """Settings of a tiny ``text`` lm run over a file of random letters."""
    rng = random.Random(0)
    path = tmp_path / "letters.txt"
    path.write_text("".join(rng.choice("abcdefghij \n") for _ in range(12_000)))
    return {
        "data_file": str(path),
        "context": str(context),
        "batch_size": "4",
        "layers": "1",
        "dim": "16",
        "heads": "2",
        "dim_ff": "16",
    }


class Letters(Task):
    form = "lm"
    cache = False

    def generate(self):
        seqs = [[chr(97 + (i * j) % 7) for j in range(10 + i)] for i in range(6)]
        return {split: [(s, []) for s in seqs] for split in SPLITS}


@pytest.mark.parametrize(
    "spec, masked", [("causal", False), ("causal", True), ("full", False), ("local:w=2", True), ("strided:l=3", True)]
)
def test_torch_lm_computes_gtx_lm_with_the_same_weights(spec, masked):
    """The plain-torch reference is the same model: gtx's lm weights load into it by name, and it
    gives the same logits (eval mode) on a batch of unequal lengths (padding) and of equal ones."""
    task = Letters("letters", None)
    task.splits()
    entry = MODELS.get("lm")
    config = entry.config(layers=2, heads=2, dim=16, dim_ff=32)
    gtx_lm = entry.obj(config, task.src_vocab, task.tgt_vocab, get_backend("auto")).eval()
    ref = reference_model(SDPA_MASK if masked else SDPA_CAUSAL, config, task, spec).eval()
    state = gtx_lm.state_dict()
    assert torch.equal(state.pop("embed.src.weight"), state["embed.tgt.weight"])  # one shared table
    ref.load_state_dict(state)  # strict: the same parameters, names and shapes
    for index in ([0, 3, 5], [2, 2]):
        batch = make_batch(task, "train", index, parse_pattern(spec))
        torch.testing.assert_close(ref(batch).logits, gtx_lm(batch).logits, atol=1e-5, rtol=1e-4)


def test_references_per_model():
    lm_config = MODELS.get("lm").config()
    lm, transformer, ut = (MODELS.get(m).obj for m in ("lm", "transformer", "ut"))  # each model declares its references
    assert references(lm, lm_config, ["full", "local:w=4", "causal"]) == [
        (SDPA_CAUSAL, "causal"),
        (SDPA_MASK, "local:w=4"),
    ]
    assert references(lm, MODELS.get("lm").config(universal=True), ["full"]) == []  # no ACT in plain torch
    assert (
        references(transformer, None, ["local:w=4"]) == [("torch.nn", "full")] and references(ut, None, ["full"]) == []
    )


def test_bench_train_cli_repeats_pattern_and_compares_lm_with_sdpa(tmp_path):
    sets = [a for kv in tiny_text(tmp_path, 32).items() for a in ("--set", "=".join(kv))]
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "train",
            "--task",
            "text",
            "--model",
            "lm",
            "--pattern",
            "full",
            "--pattern",
            "local:w=2",
            "--backends",
            "auto",
            "--steps",
            "2",
            "--rounds",
            "2",
            "--no-memory",
            "--format",
            "csv",
            "--results",
            str(tmp_path),
            *sets,
        ],
    )
    assert result.exit_code == 0, result.output
    (path,) = (tmp_path / "bench").glob("train-*.csv")
    df = pd.read_csv(path)
    assert list(df.columns) == TRAIN_COLUMNS
    assert list(zip(df.pattern, df.backend)) == [
        ("full", "auto"),
        ("local:w=2", "auto"),
        ("-", "(no attention)"),
        ("causal", "torch SDPA is_causal"),
        ("local:w=2", "torch SDPA bool mask"),
    ]
    assert (
        (df.model == "lm").all()
        and (df.tokens_per_s > 0).all()
        and (df.steps == 2).all()
        and df.peak_mem_mb.isna().all()
    )
    ref, top = df.tokens_per_s.iloc[3], df.tokens_per_s.iloc[2]
    assert df.vs_reference.tolist() == pytest.approx((df.tokens_per_s / ref).tolist())
    share = (df.tokens_per_s - ref) / (top - ref) if top > ref else df.tokens_per_s * float("nan")
    beaten = df.tokens_per_s > top  # faster than the bound (noise at this size): left empty
    assert df.ceiling_share.tolist() == pytest.approx(share.mask(beaten).tolist(), nan_ok=True)
    # the SDPA rows are the bound's model too
    assert df.attention_ms.iloc[2] == 0 and (df.attention_ms.notna() == ~beaten).all()


def test_bench_train_memory_pass_measures_each_row_in_a_fresh_process(tmp_path):
    df = bench_train(
        TrainBench(
            "text",
            "lm",
            ["full"],
            ["dense"],
            steps=1,
            warmup_steps=0,
            settings=tiny_text(tmp_path, 256),
            rounds=1,
            bound=False,
            memory=True,
            memory_steps=2,
        )
    )
    assert list(df.backend) == ["dense", SDPA_CAUSAL]
    mem = df.set_index("backend").peak_mem_mb
    # each row is measured in its own process, above that process's baseline: a few MB at this size, whose ratio is noise
    # (full on dense runs SDPA's own causal kernel and lists no edges, so it costs what plain torch does)
    assert (mem > 0).all() and (mem < 200).all()


def test_skip_attention_has_the_output_shape_and_sends_gradients_to_q_k_v():
    q, k = torch.randn(5, 2, 3, requires_grad=True), torch.randn(7, 2, 3, requires_grad=True)
    v = torch.randn(7, 2, 4, requires_grad=True)
    out = reference.SkipAttention()(q, k, v, None)
    assert out.shape == (5, 2, 4)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_calibration_fits_and_is_used(tmp_path, monkeypatch):
    from gtx.backends import auto
    from gtx.measure import calibrate

    monkeypatch.setattr(
        calibrate, "CALIBRATION_SUITE", [("local:w=2", [64]), ("full", [48]), ("local:w=4", [100]), ("full", [8] * 12)]
    )  # sizes of one flex block (128): one compilation
    tables = calibrate.calibrate("cpu", heads=2, head_dim=8, repeats=1)
    fitted, forward = tables["cpu"], tables["cpu-forward"]
    assert {"dense", "blocksparse:32", "dgl", "torch"} <= set(fitted) and "flex" not in fitted
    assert {"dense", "blocksparse:32", "flex"} <= set(forward)  # flex runs on the CPU without gradients
    assert auto.costs("cpu")["dense"] == tuple(fitted["dense"])
    assert auto.costs("cpu-forward")["flex"] == tuple(forward["flex"])
    for table in tables:
        auto.costs_path(table).unlink()
    auto.costs.cache_clear()


@pytest.mark.parametrize("blocked", ["cache", "table"])
def test_calibrate_checks_that_it_can_save_before_it_measures(tmp_path, monkeypatch, blocked):
    """A cache it cannot save into (GTX_CACHE a file: this process would cache in a temporary folder,
    deleted at its end), or a folder where the table goes: one line before any measuring (it measured
    for minutes first)."""
    from click.testing import CliRunner

    from gtx.cli import cli
    from gtx.measure import calibrate

    monkeypatch.setattr(calibrate, "_samples", lambda *a: pytest.fail("measured before checking the cache"))
    if blocked == "cache":
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("GTX_CACHE", str(tmp_path / "file"))
        message = f"gtx bench calibrate saves into gtx's cache, and GTX_CACHE={tmp_path / 'file'} cannot be used"
    else:
        monkeypatch.setenv("GTX_CACHE", str(tmp_path))
        (tmp_path / "costs-cpu.json").mkdir()
        message = "costs-cpu.json is not a file, so no calibration can be saved there: move it away"
    result = CliRunner().invoke(cli, ["bench", "calibrate", "--device", "cpu"])
    assert result.exit_code == 2 and message in result.output, result.output
    errors = [line for line in result.output.splitlines() if not line.startswith("warning: ")]  # a busy machine's
    assert len(errors) == 1 and errors[0].startswith("Error: "), result.output


@pytest.mark.parametrize(
    "text",
    [
        "{bad",
        "[1, 2]",
        '{"dense": "abc"}',
        '{"dense": [1, "x"]}',
        '{"dense": [NaN, 0.001]}',  # an IndexError at the first sparse forward
        '{"dense": [1e-9, -0.001]}',
        '{"dense": [Infinity, 0]}',
    ],
)
def test_a_broken_calibration_file_is_one_line_naming_it(tmp_path, monkeypatch, text):
    from gtx.backends import auto

    (tmp_path / "costs-cpu.json").write_text(text)
    monkeypatch.setattr(auto, "costs_path", lambda table: tmp_path / f"costs-{table}.json")
    auto.costs.cache_clear()
    try:
        with pytest.raises(GtxError, match="costs-cpu.json is not a calibration table .* gtx bench calibrate"):
            auto.costs("cpu")
    finally:
        auto.costs.cache_clear()


def test_auto_offers_flex_on_cpu_only_without_gradients(monkeypatch):
    from gtx.backends import auto as auto_module

    auto = auto_module.AutoBackend()
    local = build_graph(parse_pattern("local:w=2"), [100]).edges["ee"]
    cpu = torch.device("cpu")
    assert "flex" in auto.candidates(cpu, grad=False) and "flex" not in auto.candidates(cpu, grad=True)
    # a forward table where flex is cheapest: chosen without gradients, never with them
    cheap = {name: (1.0, 1.0) for name in auto_module.COSTS["cpu"]} | {"flex": (1e-15, 0.0)}
    monkeypatch.setitem(auto_module.COSTS, "cpu-forward", cheap)
    auto_module.costs.cache_clear()
    try:
        assert auto.choose(local, 2, 8, cpu, grad=False) == "flex"
        assert auto.choose(local, 2, 8, cpu, grad=True) != "flex"
        q, k, v = (torch.randn(100, 2, 8, requires_grad=True) for _ in range(3))
        propagate_attention(q, k, v, local, auto).sum().backward()  # gradients: not flex, no error
        assert "flex" not in auto.reset_choices()["ee"]
    finally:
        auto_module.costs.cache_clear()


def test_auto_chooses_flash_for_plain_attention_and_a_window_kernel_for_long_local():
    from gtx.backends.packed import available

    auto = get_backend("auto")
    full = build_graph(parse_pattern("full"), [256]).edges["ee"]
    causal = build_graph(parse_pattern("causal"), [64] * 8).edges["ee"]
    local = build_graph(parse_pattern("local:w=32"), [8192]).edges["ee"]
    assert auto.choose(full, 4, 32, torch.device("cpu")) == "flash-complete"
    assert auto.choose(causal, 4, 32, torch.device("cpu")) == "flash-causal"
    choice = auto.choose(local, 4, 32, torch.device("cpu"))
    assert choice == "packed" if available(torch.zeros(1)) else choice.startswith("blocksparse")
    predicted = estimate(local, 4, 32, torch.device("cpu"), {"dense", "blocksparse", "dgl", "torch"})
    assert predicted["dense"] > 10 * min(predicted.values())
    assert work(local, 1, 1, {"dgl"})["dgl"] == local.num_edges


def test_runs_record_the_auto_plan(tmp_path):
    from gtx.records.results import load

    args = [
        "run",
        "--epochs",
        "1",
        "--results",
        str(tmp_path),
        "--quiet",
        "--dim",
        "16",
        "--heads",
        "2",
        "--dim-ff",
        "16",
        "--layers",
        "1",
        "--set",
        "n_train=32",
        "--set",
        "n_valid=8",
        "--set",
        "n_test=8",
        "--pattern",
        "local:w=1",
    ]
    assert CliRunner().invoke(cli, args).exit_code == 0
    df = load(tmp_path)
    plans = [json.loads(p) for p in df.backend_plan]
    assert all(set(p) == {"ee", "dd", "ed"} for p in plans)


@pytest.mark.slow
def test_targets_attention_local_8192():
    """The CPU speed bars, side by side in one process (run with -m slow)."""
    df = bench.bench_attention(["local:w=32"], [8192], ["dense", "dgl", "auto"], repeats=3)
    ms = df.set_index("backend").ms
    assert ms["dense"] / ms["auto"] >= 10 and ms["dgl"] / ms["auto"] >= 2


def test_auto_times_close_candidates_and_keeps_the_fastest(monkeypatch):
    """Where the cost model sees candidates within MEASURE_WITHIN of each other, the measured time
    decides: here it wrongly predicts edge-wise torch to be best, and timing overrules it. The
    candidates run; the clock they are timed by is given (each call of torch takes 3 of its seconds,
    of blocksparse 1): the verdict does not depend on what else runs on the machine."""
    from gtx.backends import auto as auto_module

    edges = build_graph(parse_pattern("local:w=8"), [1024]).edges["ee"]
    monkeypatch.setattr(auto_module, "estimate", lambda *a, **k: {"torch": 1.0, "blocksparse:32": 1.2, "dense": 10.0})
    now, cost, time_candidates = [0.0], {"torch": 3.0, "blocksparse:32": 1.0}, auto_module.time_candidates

    def costly(name, backend):
        def call(*args, **kwargs):
            now[0] += cost[name]
            return backend(*args, **kwargs)

        return call

    monkeypatch.setattr(
        auto_module,
        "time_candidates",
        lambda backends, *args, **kwargs: time_candidates(
            {n: costly(n, b) for n, b in backends.items()}, *args, clock=lambda: now[0], **kwargs
        ),
    )
    q, k, v = (torch.randn(1024, 2, 8, requires_grad=True) for _ in range(3))
    cpu = torch.device("cpu")
    measuring = auto_module.AutoBackend(measure=True)
    assert measuring.choose(edges, 2, 8, cpu, (q, k, v)) == "blocksparse:32"
    ((_, times),) = measuring.measured.items()
    assert times == cost  # dense is not close: never run; the fastest of the rounds, each call timed
    assert q.grad is None  # timed on copies
    assert auto_module.AutoBackend().choose(edges, 2, 8, cpu, (q, k, v)) == "torch"  # plain auto: the model decides
    assert auto_module.AutoBackend(measure=True).choose(edges, 2, 8, cpu) == "torch"  # nothing to time with
    assert get_backend("auto-tuned").measure and not get_backend("auto").measure


def test_a_busy_machine_is_named_where_more_than_a_quarter_of_its_cores_are_busy(monkeypatch):
    from gtx.measure.load import busy_note

    assert busy_note("these timings", 0.4, 2) is None and busy_note("these timings", 3.5, 16) is None
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    note = busy_note("these timings", 1.2, 2)
    assert note.startswith("other processes keep 1.2 of 2 cores busy: they share this machine, so these timings do not")
    assert "set OMP_NUM_THREADS=1" in note
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "set OMP_NUM_THREADS" not in busy_note("these timings", 1.2, 2)


def test_busy_cores_is_the_busy_share_of_the_ticks_between_two_readings_times_the_cores(tmp_path):
    from gtx.measure.load import busy_cores, cpu_ticks

    readings, slept = iter([(1000, 600), (1200, 650)]), []  # 200 ticks, 50 of them idle: 3/4 busy
    assert busy_cores(0.5, ticks=lambda: next(readings), sleep=slept.append, cores=4) == 3.0 and slept == [0.5]
    stalled = iter([(1000, 600), (1000, 600)])  # no tick passed: nothing to tell
    assert busy_cores(ticks=lambda: next(stalled), sleep=lambda s: None, cores=4) is None

    def unreadable():
        raise OSError("no /proc/stat")

    assert busy_cores(ticks=unreadable, sleep=lambda s: None) is None
    stat = tmp_path / "stat"  # user nice system idle iowait irq softirq steal ...: steal left out
    stat.write_text("cpu  10 1 5 80 4 0 0 7 0 0\ncpu0 5 0 2 40 2 0 0 3 0 0\n")
    assert cpu_ticks(str(stat)) == (100, 84)
    stat.write_text("")
    with pytest.raises(IndexError):
        cpu_ticks(str(stat))


def test_gtx_busy_check_0_looks_at_nothing(monkeypatch):
    from gtx.measure import load

    monkeypatch.setattr(load, "busy_cores", lambda *a, **k: pytest.fail("the machine's load was read"))
    monkeypatch.setenv("GTX_BUSY_CHECK", "0")
    assert load.busy_note("these timings") is None


def test_bench_and_run_warn_once_on_a_busy_machine_and_go_on(tmp_path, monkeypatch):
    """One line on stderr as each starts, from the load it reads (a fake here: every core busy); not an error."""
    from gtx.measure import load

    reads = []
    monkeypatch.setenv("GTX_BUSY_CHECK", "1")
    monkeypatch.setattr(load, "busy_cores", lambda *a, **k: reads.append(1) or float(load.usable_cores()))
    run = CliRunner().invoke(
        cli,
        ["run", "--task", "copy", "--model", "transformer", "--pattern", "full", "--epochs", "0", "--quiet"]
        + [f"--set={k}={v}" for k, v in TINY_COPY.items()]
        + ["--results", str(tmp_path)],
    )
    assert run.exit_code == 0, run.output
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("warning: ")]
    assert line.startswith("warning: other processes keep") and "its wall_s and tokens_per_s do not compare" in line
    assert "warning" not in run.stdout and reads == [1]
    args = ["bench", "attention", "--lengths", "16", "--backends", "dense", "--repeats", "1", "--no-plot"]
    bench = CliRunner().invoke(cli, [*args, "--results", str(tmp_path)])
    assert bench.exit_code == 0, bench.output
    assert [line for line in bench.stderr.splitlines() if line.startswith("warning: ")] == [
        line.replace("its wall_s and tokens_per_s", "these timings")
    ] and reads == [1, 1]


@pytest.mark.slow
def test_busy_cores_counts_a_process_that_spins_now_and_not_one_that_has_finished():
    """The real reading, on this machine: marked slow, and skipped unless the machine is quiet (other
    processes' load would decide the verdict)."""
    from gtx.measure.load import busy_cores

    before = busy_cores(0.5)
    if before is None:
        pytest.skip("no /proc/stat")
    if before > 0.3:
        pytest.skip(f"other processes keep {before:.1f} cores busy: the reading cannot be checked now")
    spin = "import time\nend = time.monotonic() + 2\nwhile time.monotonic() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the child has started
        assert busy_cores(0.5) >= 0.6
    finally:
        spinner.wait()
    assert busy_cores(0.5) < 0.6  # the load average still counts it for a minute


def test_the_gpu_cells_script_times_training_rows_on_the_cpu(tmp_path):
    """bench/gpu_cells.py (what a lent card runs) keeps working where CI can run it: a row per spec,
    the ceiling and a window, each a step time and none failing."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "bench/gpu_cells.py",
            "train",
            "--device",
            "cpu",
            "--context",
            "128",
            "--csv",
            str(tmp_path / "t.csv"),
        ]
        + ["none/float32/-", "local:w=16/bfloat16/-"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [line for line in out.stdout.splitlines() if line.startswith("TRAIN")]
    assert out.returncode == 0 and len(rows) == 2, out.stdout + out.stderr
    assert all(" step " in r and "FAIL" not in r for r in rows), rows
    table = pd.read_csv(tmp_path / "t.csv")
    assert list(table.pattern) == ["none", "local:w=16"] and (table.step_ms > 0).all()


def test_the_gpu_cells_script_times_a_cells_backends_in_turns(monkeypatch):
    """Every backend of a (pattern, n) timed in ROUNDS rounds, its ratio against the first; a row that
    cannot run (FlexAttention's backward on the CPU) is reported and left out."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_cells.py"
    spec = importlib.util.spec_from_file_location("gpu_cells", path)
    cells = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cells)
    monkeypatch.setattr(
        cells,
        "ATTENTION",
        [("causal", 64, ("sdpa", "auto", "sdpa-rows")), ("local:w=8", 256, ("flexattention", "auto"))],
    )
    monkeypatch.setattr(cells, "REPEATS", 2)
    rows = cells.attention("cpu")
    assert [(r["pattern"], r["backend"]) for r in rows] == [
        ("causal", "sdpa"),
        ("causal", "auto"),
        ("causal", "sdpa-rows"),  # SDPA on gtx's layout
        ("local:w=8", "auto"),
    ]
    assert rows[0]["ratio"] == 1 and rows[1]["choice"] == "flash-causal"
    assert len(rows[1]["rounds_ms"].split()) == cells.ROUNDS and rows[2]["choice"] == "sdpa on rows"
    assert math.isnan(rows[3]["ratio"])  # the window's reference could not run
