"""gtx plot and gtx report: the drawn adjacency is the pattern's, long sequences are binned, the
results figure and the HTML report render from a results folder, and bad input is one line, exit 2."""

import base64
import html
import io
import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
import torch
from rows import row as schema_row

from gtx.errors import GtxError
from gtx.graph.pattern import STAGES
from gtx.graph.spec import parse_pattern
from gtx.pictures import plot
from gtx.pictures.report import write_report
from gtx.records.results import load, write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def image_of(path_or_bytes) -> np.ndarray:
    """RGB(A) floats of a PNG; asserts it is one and is not blank."""
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else open(path_or_bytes, "rb").read()
    assert data.startswith(PNG_MAGIC)
    pixels = mpimg.imread(io.BytesIO(data), format="png")
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels[..., :3].var() > 0
    return pixels


def dense_from_edges(spec, stage, n_q, n_k) -> np.ndarray:
    src, dst = parse_pattern(spec).edges(stage, n_q, n_k)
    adj = torch.zeros(n_q, n_k, dtype=torch.bool)
    adj[dst, src] = True
    return adj.numpy()


# ---------------------------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["local:w=1", "local:w=1|strided:l=3", "bigbird"])
def test_pattern_grid_is_the_mask_of_the_edges(spec):
    for stage in STAGES:
        n_q, n_k = plot.stage_lengths(stage, 8, 6)
        assert np.array_equal(plot.pattern_grid(spec, stage, n_q, n_k), dense_from_edges(spec, stage, n_q, n_k)), stage


def test_edge_cells_are_drawn_dark_and_the_others_light():
    fig = plot.pattern("local:w=1", 8)
    image_of(fig._repr_png_())  # what a notebook shows inline
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].mean(axis=2)
    height = pixels.shape[0]
    assert len(fig.axes) == 3 and "dd: decoder self-attention" in fig.axes[1].get_title()
    for ax, stage in zip(fig.axes, STAGES):
        mask = dense_from_edges("local:w=1", stage, 8, 8)
        for q in range(8):
            for k in range(8):
                x, y = ax.transData.transform((k, q))  # position k, q: the centre of its cell
                shade = pixels[int(height - y), int(x)]
                assert (shade < 64) if mask[q, k] else (shade > 192), (stage, q, k, shade)


def test_long_sequences_are_binned_into_a_band():
    grid = plot.pattern_grid("local:w=32", "dd", 4096, 4096)
    assert grid.shape == (512, 512)  # blocks of 8x8 positions
    i, j = np.indices(grid.shape)
    assert (grid[i == j] > 0).all() and (grid[j > i] == 0).all()  # the diagonal, nothing above it (causal)
    assert (grid[i - j > 32 // 8 + 1] == 0).all()  # nothing beyond the window's blocks
    src, _ = parse_pattern("local:w=32").edges("dd", 4096, 4096)
    assert grid.sum() * 64 == pytest.approx(src.numel())  # fractions x block area = every edge once


def test_a_short_last_block_counts_only_its_positions():
    grid = plot.pattern_grid("full", "ee", 10, 10, max_cells=4)  # blocks of 3: 3, 3, 3 and 1 positions
    assert grid.shape == (4, 4) and np.allclose(grid, 1.0)


def test_more_than_1e5_positions_is_an_error(cli):
    with pytest.raises(GtxError, match="cannot plot 100,001 positions; the limit is 100,000 per side"):
        plot.pattern("local:w=1", 100_001)
    result = cli("plot", "pattern", "local:w=1", "--tgt-len", 100_001, "--stages", "dd")
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "limit is 100,000" in result.output


def test_plot_pattern_writes_png_svg_and_pdf(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    result = cli("plot", "pattern", "local:w=1", "--src-len", 8, "--tgt-len", 6)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "pattern-local-w-1.png"
    image_of(tmp_path / "pattern-local-w-1.png")
    result = cli("plot", "pattern", "local:w=2", "--stages", "dd", "-o", tmp_path / "new" / "deeper" / "p.svg")
    assert result.exit_code == 0, result.output
    assert "<svg" in (tmp_path / "new" / "deeper" / "p.svg").read_text()  # missing parents are created
    result = cli("plot", "pattern", "full", "--src-len", 4, "-o", tmp_path / "p", "--format", "pdf")
    # the path as given: no suffix appended
    assert result.exit_code == 0 and (tmp_path / "p").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "bmp"], "unknown format 'bmp'; use png, svg or pdf"),
        (["-o", "x.jpg"], "cannot tell the format of x.jpg"),
        (["--stages", "ee,xx"], "unknown stage(s) xx; stages are ee, dd, ed"),
        (["-o", "a-file/p.png"], "cannot write a-file/p.png"),
        (["-o", "no-suffix"], "cannot tell the format of no-suffix: name it .png, .svg or .pdf"),  # no .png appended
        (["-o", "a-folder"], "a-folder is a folder; give a file name"),
        (["-o", "a-folder", "--format", "png"], "a-folder is a folder"),
        (["-o", "x.png", "--format", "pdf"], "x.png is named .png but --format is pdf; name it .pdf"),
    ],
)
def test_bad_plot_input_is_one_line_exit_2(tmp_path, monkeypatch, args, message, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "a-folder").mkdir()
    result = cli("plot", "pattern", "local:w=1", "--src-len", 4, *args)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert message in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "a-folder"]  # nothing written


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_an_error(tmp_path, cli):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        result = cli("plot", "pattern", "local:w=1", "--src-len", 4, "-o", folder / "p.png")
        assert result.exit_code == 2 and "cannot write" in result.output
    finally:
        folder.chmod(0o700)


# ---------------------------------------------------------------------------------------------
# Results and the report
# ---------------------------------------------------------------------------------------------


def row(run_id, pattern, seed, split, epoch, acc, tps=1000.0, **kw):
    """A row of one seed's run: loss 1 - acc, seq_acc half of acc (none in training), a configuration to show."""
    kw = {
        "loss": 1.0 - acc,
        "context_len": 12,
        "config": json.dumps({"pattern": pattern, "seed": seed, "dim": 16}),
        **kw,
    }
    return schema_row(run_id, pattern, split, epoch, acc, np.nan if split == "train" else acc / 2, tps, seed=seed, **kw)


def fake_results(folder) -> None:
    """2 patterns x 2 seeds x 2 epochs: full is slower and more accurate than local:w=1."""
    for pattern, acc, tps in (("full", 0.8, 1000.0), ("local:w=1", 0.6, 3000.0)):
        for seed in (0, 1):
            run_id = f"{pattern.replace(':', '-')}-s{seed}"
            rows = []
            for epoch in (1, 2):
                a = acc * epoch / 2 + 0.02 * seed
                rows += [
                    row(run_id, pattern, seed, "train", epoch, a, tps + 100 * seed),
                    row(run_id, pattern, seed, "valid", epoch, a),
                ]
            rows.append(row(run_id, pattern, seed, "test", 2, acc))
            write_run(folder, run_id, rows)


def test_run_table_holds_each_runs_best_and_speed(tmp_path):
    fake_results(tmp_path)
    runs = plot.run_table(load(tmp_path), ["task", "model"], "best_valid_token_acc").set_index("run_id")
    assert runs.loc["full-s1", "value"] == pytest.approx(0.82) and runs.loc["full-s1", "tokens_per_s"] == 1100.0
    assert plot.run_table(load(tmp_path), [], "best_valid_loss").set_index("run_id").loc[
        "full-s0", "value"
    ] == pytest.approx(0.2)
    with pytest.raises(GtxError, match="metric 'best_valid_bleu' has no values"):
        plot.run_table(load(tmp_path), [], "best_valid_bleu")
    # a repeat of a cell (same configuration and seed) is no new seed: the latest finished run counts, as in gtx compare
    write_run(
        tmp_path,
        "again",
        [
            row("again", "full", 0, "valid", 1, 0.1, cell="c0", started_at="2026-01-02T00:00:00+00:00"),
            row("again", "full", 0, "test", 1, 0.1, cell="c0", started_at="2026-01-02T00:00:00+00:00"),
        ],
    )
    write_run(
        tmp_path,
        "first",
        [row("first", "full", 0, "valid", 1, 0.9, cell="c0"), row("first", "full", 0, "test", 1, 0.9, cell="c0")],
    )
    assert "first" not in set(plot.run_table(load(tmp_path), [], "best_valid_token_acc").run_id)


def test_many_groups_wrap_into_rows_of_three(tmp_path):
    fake_results(tmp_path)
    df = load(tmp_path)
    df = pd.concat([df.assign(task=f"t{i}", run_id=df.run_id + f"-{i}") for i in range(7)], ignore_index=True)
    fig = plot.results(df)
    width, height = fig.get_size_inches()
    # 7 groups: 3 rows of 3 columns, not one row of 7
    assert width == pytest.approx(3 * 5.6) and height == pytest.approx(3 * 8.4)
    titled = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titled == [f"task=t{i}, model=transformer" for i in range(7)]
    assert sum(not ax.axison for ax in fig.axes) == 2 * 2  # the last row's two empty places, top and bottom


def test_task_metrics_come_from_the_metrics_json(tmp_path):
    rows = [
        row("r", "full", 0, "train", 1, 0.5),
        row("r", "full", 0, "valid", 1, 0.5, metrics='{"bpc": 2.5}'),
        row("r", "full", 0, "valid", 2, 0.6, metrics='{"bpc": 2.0}'),
    ]
    write_run(tmp_path, "r", rows)
    assert plot.run_table(load(tmp_path), [], "bpc").value.tolist() == [2.0]  # lower is better: the minimum


def test_results_figure_and_command(tmp_path, cli):
    fake_results(tmp_path)
    fig = plot.results(load(tmp_path))
    assert len(fig.axes) == 2 and fig.axes[0].get_title() == "task=copy, model=transformer"
    assert {t.get_text() for t in fig.axes[0].get_legend().get_texts()} == {
        "full (n=2)",
        "local:w=1 (n=2)",
        "Pareto front",
    }
    front = next(line for line in fig.axes[0].get_lines() if line.get_label() == "Pareto front")
    assert list(front.get_xdata()) == [1050.0, 3050.0]  # mean tokens/s: full is slower but better, so both are on it
    result = cli("plot", "results", "--results", tmp_path)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "plots" / "results.png")
    image_of(tmp_path / "plots" / "results.png")
    result = cli(
        "plot",
        "results",
        "--results",
        tmp_path,
        "--by",
        "task,pattern",
        "--metric",
        "test_seq_acc",
        "-o",
        tmp_path / "r.svg",
    )
    assert result.exit_code == 0 and "<svg" in (tmp_path / "r.svg").read_text()


def test_results_and_report_plot_each_tasks_own_metric(tmp_path, cli):
    """text is judged by bpc (lower is better), recall by query_acc, copy by token_acc: as gtx compare picks them."""
    fake_results(tmp_path)
    for task, metrics in (("text", lambda a: {"bpc": 3.0 - a}), ("recall", lambda a: {"query_acc": a / 4})):
        for seed in (0, 1):
            run_id = f"{task}-s{seed}"
            rows = [
                row(
                    run_id,
                    "full",
                    seed,
                    split,
                    1,
                    0.5 + 0.1 * seed,
                    task=task,
                    metrics=json.dumps(metrics(0.5 + 0.1 * seed)),
                )
                for split in ("train", "valid", "test")
            ]
            write_run(tmp_path, run_id, rows)
    df = load(tmp_path)
    assert [plot.own_metric(df, t) for t in ("text", "recall", "copy")] == [
        "best_valid_bpc",
        "best_valid_query_acc",
        "best_valid_token_acc",
    ]
    fig = plot.results(df)
    labels = {ax.get_title(): ax.get_ylabel() for ax in fig.axes if ax.get_title()}
    assert labels == {
        "task=copy, model=transformer": "best_valid_token_acc (higher is better)",
        "task=recall, model=transformer": "best_valid_query_acc (higher is better)",
        "task=text, model=transformer": "best_valid_bpc (lower is better)",
    }
    text_panel = next(ax for ax in fig.axes if ax.get_title() == "task=text, model=transformer")
    # mean bpc of the two seeds, not their token_acc
    assert sorted(text_panel.get_lines()[0].get_ydata()) == pytest.approx([2.45])
    # one panel holding three metrics: refused, one line
    result = cli("plot", "results", "--results", tmp_path, "--by", "model")
    assert (
        result.exit_code == 2
        and "holds tasks judged by different metrics" in result.output
        and result.output.count("\n") == 1
    )
    assert cli("report", "--results", tmp_path).exit_code == 0
    assert "each task&#x27;s own metric" in (tmp_path / "report.html").read_text()


def test_no_runs_is_one_line_exit_2(tmp_path, cli):
    for args in (["plot", "results"], ["report"]):
        result = cli(*args, "--results", tmp_path / "empty")
        assert result.exit_code == 2 and result.output.count("\n") == 1 and "no runs under" in result.output


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.images, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        assert tag not in ("script", "link"), "the report must be self-contained"

    def handle_data(self, data):
        self.text.append(data)


def test_report_is_one_self_contained_page(tmp_path, cli):
    fake_results(tmp_path)
    # still training
    write_run(
        tmp_path,
        "full-s2",
        [row("full-s2", "full", 2, "train", 1, 0.1, 1000.0), row("full-s2", "full", 2, "valid", 1, 0.1)],
    )
    result = cli("report", "--results", tmp_path)
    assert result.exit_code == 0, result.output
    path = tmp_path / "report.html"
    assert result.output.strip() == str(path)
    page = Page()
    page.feed(path.read_text())
    text = "".join(page.text)
    assert page.tags.count("details") == 5 and '"dim": 16' in text  # one configuration per run
    # the comparison pools finished runs only
    assert "Left out: 1 unfinished run(s), without test rows yet: full-s2" in text
    assert "table" in page.tags and "best_valid_token_acc" in text and "local:w=1" in text
    assert len(page.images) == 3  # the results figure, one picture per pattern
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        image_of(base64.b64decode(src.split(",", 1)[1]))
    assert write_report(tmp_path, tmp_path / "sub" / "r.html").exists()


def test_report_and_plots_never_write_over_a_results_table(tmp_path, cli):
    fake_results(tmp_path)
    table = next((tmp_path / "runs").glob("*.csv"))
    before = table.read_bytes()
    for args in (["report", "-o", table], ["plot", "results", "--format", "png", "-o", table]):
        result = cli(*args[:-2], "--results", tmp_path, *args[-2:])
        assert result.exit_code == 2 and "holds data (.csv file); it is not replaced" in result.output, result.output
    assert table.read_bytes() == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--metric", "nosuch"], "metric 'nosuch' has no values in these runs"),
        (["--by", "nosuch"], "cannot group by ['nosuch']"),
    ],
)
def test_report_with_a_bad_metric_or_grouping_is_one_line_and_writes_nothing(tmp_path, args, message, cli):
    fake_results(tmp_path)
    result = cli("report", "--results", tmp_path, *args)
    assert result.exit_code == 2 and message in result.output and not (tmp_path / "report.html").exists()


HEADER = "task,model,length,family,budget,pattern,metric,runs,mean\n"
NOT_FRONTIERS = {
    "random bytes": (bytes(range(256)) * 2, "cannot be read as a frontier table"),
    "another program's table": (b"a,b\n1,2\n", "is no gtx frontier table: it lacks task, model"),
    "an empty file": (b"", "cannot be read as a frontier table (No columns to parse"),
    "text where numbers belong": (
        (HEADER + "recall,lm,64,local,8,local:w=8,q,zz,zz\n").encode(),
        "its runs column holds text",
    ),
    "a table cut mid-row": (
        (HEADER + "recall,lm,64,local,8,loc").encode(),
        "a row without its family, budget, pattern or metric",
    ),
    "a folder named x.csv": (None, "Is a directory"),
}


@pytest.mark.parametrize("case", list(NOT_FRONTIERS))
def test_report_names_a_file_among_the_frontiers_that_is_no_frontier_table(tmp_path, case, cli):
    content, message = NOT_FRONTIERS[case]
    fake_results(tmp_path)
    where = tmp_path / "frontiers" / "x.csv"
    where.parent.mkdir()
    where.mkdir() if content is None else where.write_bytes(content)
    result = cli("report", "--results", tmp_path)
    assert result.exit_code == 2 and message in result.output and "x.csv" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "report.html").exists()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium to render the report")
def test_report_renders_in_a_headless_browser(tmp_path):
    fake_results(tmp_path)
    path = write_report(tmp_path)
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            f"--screenshot={shot}",
            "--window-size=1200,2000",
            path.resolve().as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    rgb = image_of(shot)[..., :3]
    assert (rgb.mean(axis=2) < 0.5).mean() > 0.01  # text, tables and figures, not an empty page
    # the page's text is black and grey: coloured pixels come from the embedded results figure's markers
    assert (np.abs(rgb[..., 0] - rgb[..., 2]) > 0.3).sum() > 50


def test_real_runs_plot_and_report(tmp_path, cli, tiny_run):
    for pattern in ("full", "local:w=1"):
        folder = tiny_run(tmp_path, pattern=pattern, epochs=2).folder
    assert cli("plot", "results", "--results", folder).exit_code == 0
    image_of(folder / "plots" / "results.png")
    assert cli("report", "--results", folder).exit_code == 0
    assert (folder / "report.html").read_text().count("data:image/png;base64,") == 3


def test_bench_attention_figure(tmp_path):
    df = pd.DataFrame(
        {
            "pattern": ["local:w=32"] * 4,
            "backend": ["dense", "dense", "dgl", "dgl"],
            "n": [1024, 2048] * 2,
            "ms": [1.0, 4.0, 2.0, 3.0],
        }
    )
    image_of(plot.save(plot.attention_bench(df), tmp_path / "bench.png"))


# ---------------------------------------------------------------------------------------------
# Trained models: attention weights and ACT steps
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_run):
    """Checkpoints of two tiny runs, trained once: a transformer under local:w=1 and a ut with ACT."""
    folder = tmp_path_factory.mktemp("trained")
    tiny_run(folder, model="transformer", pattern="local:w=1", layers=2)
    results = tiny_run(folder, model="ut", pattern="local:w=1", max_depth=3).folder
    found = {p.parent.name.split("-")[3]: p for p in results.glob("checkpoints/*/best.pt")}
    return {"transformer": found["transformer"], "ut": found["ut"], "results": results}


class Spy:
    """A backend recording what it returned, to check the recorded weights against."""

    name, supports_bias = "spy", True

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, q, k, v, edges, bias=None):
        out = self.inner(q, k, v, edges) if bias is None else self.inner(q, k, v, edges, bias=bias)
        self.seen.append((q, k, v, out))
        return out


def test_recorded_weights_are_the_softmax_that_makes_the_output(trained):
    from gtx.measure import probe

    model, r, _ = probe.load_model(trained["transformer"])
    spy = model.attention.backend = Spy(model.attention.backend)
    seen = probe.run_example(model, r, "test", 1)
    assert [(c.stage, c.index) for c in seen.calls] == [
        ("ee", 0),
        ("ee", 1),
        ("dd", 0),
        ("ed", 0),
        ("dd", 1),
        ("ed", 1),
    ]
    assert model.attention.backend is spy  # the recorder is gone afterwards
    for call, (q, k, v, out) in zip(seen.calls, spy.seen):
        (part,) = call.parts
        sums = torch.zeros(call.n_q, call.heads).index_add(0, part.dst, part.weights)
        torch.testing.assert_close(sums, torch.ones(call.n_q, call.heads))  # every query has an edge under local:w=1
        mixed = torch.zeros_like(out).index_add(0, part.dst, part.weights[..., None] * v[part.src])
        torch.testing.assert_close(mixed, out, atol=1e-5, rtol=1e-5)  # they weight the values into the backend's output
        # the softmax of q.k over the row's edges, densely
        dense = torch.full((call.n_q, call.n_k, call.heads), float("-inf"))
        dense[part.dst, part.src] = (q[part.dst] * k[part.src]).sum(-1)
        torch.testing.assert_close(dense.softmax(1)[part.dst, part.src], part.weights)


@pytest.mark.parametrize(
    "spec",
    [
        "heads(local:w=1,strided:l=3)",
        "local:w=2+alibi",
        "heads(topk:k=2,local:w=1)+relbias:buckets=8,max_distance=16",
        "topk:k=3",
    ],
)
def test_head_groups_biases_and_selections_are_recorded_per_head(spec):
    from types import SimpleNamespace

    from gtx.attention.module import Attention
    from gtx.backends import get_backend
    from gtx.graph.tokens import build_graph
    from gtx.measure import probe

    edges = build_graph(parse_pattern(spec), [7]).edges["ee"]
    q, k, v = (torch.randn(7, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    attention = Attention(get_backend("torch"), parse_pattern(spec), 4)
    with probe.recording(SimpleNamespace(attention=attention)) as calls:
        out = attention(q, k, v, edges)
    (call,) = calls
    assert call.heads == 4 and call.covered() == 4
    for head in range(4):  # every head's weights mix its values into its column of the output
        src, dst, w = call.weights(head)
        torch.testing.assert_close(
            torch.zeros(7, 8).index_add(0, dst, w[:, None] * v[src, head]), out[:, head], atol=1e-5, rtol=1e-5
        )
    src, dst, w = call.weights()
    assert torch.zeros(7).index_add(0, dst, w).allclose(torch.ones(7))  # the mean over heads still sums to 1 per query


def test_block_selections_are_an_error():
    from types import SimpleNamespace

    from gtx.attention.module import Attention
    from gtx.backends import get_backend
    from gtx.graph.tokens import build_graph
    from gtx.measure import probe

    pattern = parse_pattern("moba:b=2,k=2,gate=block")
    edges = build_graph(pattern, None, [8]).edges["dd"]
    q = torch.randn(8, 2, 4)
    attention = Attention(get_backend("torch"), pattern, 2)
    with pytest.raises(GtxError, match="cannot be recorded"), probe.recording(SimpleNamespace(attention=attention)):
        attention(q, q, q, edges)


def cell_colours(fig, ax, n_q, n_k) -> np.ndarray:
    """(n_q, n_k, 3) RGB bytes at the centre of each drawn cell."""
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    out = np.zeros((n_q, n_k, 3), dtype=int)
    for q in range(n_q):
        for k in range(n_k):
            x, y = ax.transData.transform((k, q))
            out[q, k] = pixels[int(pixels.shape[0] - y), int(x)]
    return out


def test_non_edges_are_grey_exactly_where_the_pattern_has_none(trained):
    from gtx.measure import probe
    from gtx.pictures import plot_model

    model, r, _ = probe.load_model(trained["transformer"])
    seen = probe.run_example(model, r, "test", 0)
    fig = plot_model.attention_figure(seen)
    image_of(fig._repr_png_())
    assert [ax.get_title().split(":")[0] for ax in fig.axes[:3]] == ["ee", "dd", "ed"]  # then their colour bars
    assert "layer 1 (layers 0-1), mean over heads" in fig.axes[0].get_title()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == seen.src and seen.src[-1] == "<eos>"
    grey = round(plot_model.MASKED[0] * 255)
    for ax, stage in zip(fig.axes, STAGES):
        call = seen.stage(stage)[-1]
        edge = dense_from_edges("local:w=1", stage, call.n_q, call.n_k)
        grid = plot_model.attention_grid(call)[0]
        assert np.array_equal(np.isnan(grid), ~edge), stage
        colours = cell_colours(fig, ax, call.n_q, call.n_k)
        is_grey = (np.abs(colours - grey) <= 1).all(-1)
        assert np.array_equal(is_grey, ~edge), stage  # viridis has no grey: an edge of weight ~0 is dark purple


def test_act_attention_is_one_call_per_step(trained):
    from gtx.measure import probe

    model, r, _ = probe.load_model(trained["ut"])
    seen = probe.run_example(model, r, "test", 0)
    for stage, side in (("ee", "enc"), ("dd", "dec"), ("ed", "dec")):
        calls, steps = seen.stage(stage), seen.steps[side]
        assert len(calls) == int(steps.max())
        for t, call in enumerate(calls):  # queries still running at step t, and only they, have edges
            src, dst, _ = call.weights()
            assert set(dst.tolist()) == set((steps > t).nonzero().flatten().tolist()), (stage, t)


def test_act_attention_defaults_to_the_step_where_most_queries_are_active(trained):
    from gtx.measure import probe
    from gtx.pictures import plot_model

    model, r, _ = probe.load_model(trained["ut"])
    seen = probe.run_example(model, r, "test", 0)
    fig = plot_model.attention_figure(seen)
    panels = [a for a in fig.axes if a.get_label() != "<colorbar>"]
    for ax, stage in zip(panels, [s for s in ("ee", "dd", "ed") if seen.stage(s)]):
        active = [plot_model.active_queries(c) for c in seen.stage(stage)]
        best = active.index(max(active))  # the earliest of the most active
        assert (
            f"step {best} (" in ax.get_title()
            and f"{active[best]} of {seen.stage(stage)[best].n_q} queries active" in ax.get_title()
        )
    last = plot_model.attention_figure(seen, layer=len(seen.stage("ee")) - 1)
    assert f"step {len(seen.stage('ee')) - 1} (" in last.axes[0].get_title()  # an explicit step is drawn as asked


def test_act_figure_shows_the_models_step_counts(trained):
    from gtx.data.batch import make_batch
    from gtx.measure import probe
    from gtx.pictures import plot_model

    model, r, _ = probe.load_model(trained["ut"])
    fig = plot.act(trained["ut"], examples=[0, 2])
    image_of(fig._repr_png_())
    for row, index in enumerate([0, 2]):
        batch = make_batch(r.task, "test", [index], r.pattern)
        with torch.no_grad():
            steps = model(batch).steps
        for col, want in enumerate(steps):
            ax = fig.axes[row * 2 + col]
            assert [p.get_height() for p in ax.patches] == want.tolist()
    totals = probe.split_steps(model, r, "test")
    histogram = fig.axes[-1]  # decoder: nodes per step count, all of them
    assert (
        sum(p.get_height() for p in histogram.patches)
        == len(totals["dec"])
        == sum(len(y) + 1 for _, y in r.task.splits()["test"])
    )
    assert plot_model.act_figure  # the drawing half of plot.act


def test_plot_attention_and_act_commands(trained, tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    run_id = trained["transformer"].parent.name
    result = cli(
        "plot", "attention", run_id, "--results", trained["results"], "--example", 2, "--layer", 0, "--head", 1
    )
    assert result.exit_code == 0, result.output
    # under the results folder, not the working directory
    picture = Path(trained["results"]) / "plots" / f"attention-{run_id}-test-2.png"
    assert result.output.strip() == str(picture)
    image_of(picture)
    result = cli("plot", "attention", trained["ut"], "--split", "valid", "-o", tmp_path / "a.svg")
    assert result.exit_code == 0 and "<svg" in (tmp_path / "a.svg").read_text()
    result = cli("plot", "act", trained["ut"], "--example", 0, "--example", 1)
    assert result.exit_code == 0, result.output
    image_of(tmp_path / "results" / "plots" / f"act-{trained['ut'].parent.name}-test.png")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["act", "transformer"],
            "model 'transformer' does not use adaptive computation time; train ut or --set universal=true",
        ),
        (
            ["attention", "transformer", "--example", 12],
            "example 12 is out of range: the test split has 10 examples (0-9)",
        ),
        (["act", "ut", "--example", -1], "example -1 is out of range"),
        (["attention", "transformer", "--layer", 2], "layer 2 is out of range: the model has 2 layers (0-1)"),
        (["attention", "ut", "--layer", 3], "step 3 is out of range: the model has 3 steps (0-2)"),
        (["attention", "transformer", "--head", 2], "head 2 is out of range: the model has 2 heads (0-1)"),
        (["attention", "missing.pt"], "checkpoint missing.pt does not exist"),
        (["attention", "foreign.pt"], "checkpoint foreign.pt is truncated or not a gtx checkpoint"),
        (["act", "no-such-run"], "no run 'no-such-run' among"),
    ],
)
def test_bad_model_plot_input_is_one_line_exit_2(trained, tmp_path, monkeypatch, args, message, cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "foreign.pt").write_text("not a checkpoint")
    command, ref, *rest = args
    ref = trained.get(ref, ref)
    result = cli("plot", command, ref, *rest, "--results", trained["results"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert message in result.output


@pytest.mark.parametrize(
    "spec, stages, budget",
    [
        ("dsa:k=8", ["dd"], "at most 8 keys per query"),
        ("topk:k=4", ["ee", "dd", "ed"], "at most 4 keys per query"),
        ("moba:b=8,k=2", ["dd"], "at most 16 keys per query"),
        ("lsh", ["ee", "dd", "ed"], "no fixed number of keys per query"),
        ("nsa:l=8,d=4,s=8,n=4,w=16", ["dd"], "at most 15 compressed + 32 selected + 16 window keys per query"),
    ],
)
def test_content_chosen_patterns_say_their_keys_are_chosen_at_run_time_and_their_budget(spec, stages, budget, cli):
    fig = plot.pattern(spec, src_len=64)
    title = fig._suptitle.get_text()
    assert "keys are chosen among them at run time" in title and f"({', '.join(stages)}): {budget}" in title, title
    panels = {ax.get_title().split(":")[0]: ax.get_title() for ax in fig.axes}
    for stage in stages:  # never "density 1.000 of the causal triangle": the candidates are not what a query reads
        assert "density" not in panels[stage] and "candidates (keys chosen at run time)" in panels[stage]
    assert all("density" in t for s, t in panels.items() if s not in stages)  # full attention there, read as drawn
    shown = cli("show-pattern", spec, "--src-len", 64, "--tgt-len", 64, "--max-width", 8).output
    assert f"shown are the candidates; {budget}" in shown


def test_head_groups_get_a_row_of_panels_each():
    fig = plot.pattern("heads(local:w=1,strided:l=3)", src_len=8)
    titles = [ax.get_title() for ax in fig.axes]
    assert (
        len(titles) == 6
        and titles[0].startswith("heads 1/2: local:w=1")
        and titles[3].startswith("heads 2/2: strided:l=3")
    )


def test_report_counts_and_draws_evaluations_as_evaluations_not_runs(tmp_path):
    """A gtx eval under another pattern was counted in the page's runs, its pattern drawn as the runs'
    and its configuration summarised as a run of its own."""
    fake_results(tmp_path)
    evaluation = row("full-s0-eval", "local:w=2", 0, "test", 2, 0.5, eval_of="full-s0")
    write_run(tmp_path, "full-s0-eval", [evaluation])
    page = Page()
    page.feed(write_report(tmp_path).read_text())
    text = " ".join("".join(page.text).split())
    assert "4 runs and 1 evaluations of them (gtx eval)" in text
    assert "patterns: full, local:w=1; evaluated under local:w=2." in text
    assert "local:w=2 (evaluations only: gtx eval)" in text
    assert "full-s0-eval: evaluation of run full-s0 under local:w=2 / dgl on its test split" in text


def test_throughput_error_bars_and_axes_stop_at_zero(tmp_path):
    """Two seeds at 100 and 4,000 tokens/s: mean +- std reached below zero, and the axis with it."""
    for seed, tps in ((0, 100.0), (1, 4000.0)):
        rows = [row(f"r{seed}", "full", seed, split, 1, 0.5, tps) for split in ("train", "valid", "test")]
        write_run(tmp_path, f"r{seed}", rows)
    fig = plot.results(load(tmp_path))
    top = fig.axes[0]
    (bars,) = [c for c in top.containers if c.has_xerr]
    xs = [x for segment in bars.lines[2][0].get_segments() for x, _ in segment]
    assert min(xs) == 0.0 and max(xs) == pytest.approx(2050 + np.std([100, 4000], ddof=1))
    assert top.get_xlim()[0] >= 0 and top.get_ylim()[0] >= 0


def test_the_report_table_puts_the_verdict_beside_the_metric_and_fits_1400_px(tmp_path):
    """At 1400 px the table hid welch_p, vs_full and pareto behind a sideways scroll: they now follow
    the judged metric's interval, headers break after their underscores, and the unbreakable text of
    a row (about 7.5 px a character at the table's .85em, plus each cell's padding and border) fits."""
    import re

    fake_results(tmp_path)
    text = write_report(tmp_path).read_text()
    table = text[text.index("<table>") : text.index("</table>")]
    heads = re.findall(r"<th>(.*?)</th>", table)
    names = [h.replace("<wbr>", "") for h in heads]
    at = names.index("ci95")
    assert names[at + 1 : at + 4] == ["vs_full", "welch_p", "pareto"]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
    widths = [
        max(max(len(piece) for piece in head.split("<wbr>")), *(len(html.unescape(r[i])) for r in cells))
        for i, head in enumerate(heads)
    ]
    assert sum(7.5 * w + 2 * 0.4 * 13.6 + 1 for w in widths) < 1400 - 2 * 16
