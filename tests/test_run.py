"""End to end through the CLI: tiny runs, the results they append, gtx compare, and bad input."""

import json

import pytest
from click.testing import CliRunner

from gtx.cli import cli
from gtx.records.results import load

TINY = [
    "--set",
    "n_train=40",
    "--set",
    "n_valid=10",
    "--set",
    "n_test=10",
    "--set",
    "mean_len=5",
    "--dim",
    "16",
    "--heads",
    "2",
    "--dim-ff",
    "16",
    "--batch-size",
    "8",
    "--quiet",
]


def gtx(*args):
    return CliRunner().invoke(cli, list(args))


def test_tiny_runs_then_compare(tmp_path):
    out = str(tmp_path / "res")
    for pattern in ("full", "local:w=1"):
        result = gtx("run", "--pattern", pattern, "--layers", "1", "--epochs", "2", "--results", out, *TINY)
        assert result.exit_code == 0, result.output
        assert "token_acc" in result.output and "results: " in result.output
    df = load(out)
    assert len(df) == 2 * (2 * 2 + 1)  # two runs x (2 epochs x train/valid + test)
    assert set(df.pattern) == {"full", "local:w=1"} and (df.edges_per_query_ee > 0).all()
    assert df[df.split == "valid"].seq_acc.notna().all() and df[df.split == "train"].seq_acc.isna().all()
    result = gtx("compare", "--results", out)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "speed_vs_full" in lines[0] and len(lines) == 3
    assert any(line.split()[2] == "local:w=1" for line in lines[1:])
    md = gtx("compare", "--results", out, "--format", "markdown", "--by", "pattern")
    assert md.output.startswith("| pattern")


def test_mission_command_shape_ut_local(tmp_path):
    result = gtx(
        "run",
        "--pattern",
        "local",
        "--model",
        "ut",
        "--epochs",
        "1",
        "--results",
        str(tmp_path),
        *TINY,
        "--set",
        "max_depth=3",
    )
    assert result.exit_code == 0, result.output
    df = load(tmp_path)
    assert set(df.pattern) == {"local:w=4"} and set(df.model) == {"ut"}
    assert df.act_mean_steps.between(1, 3).all()


@pytest.mark.parametrize(
    "model, settings", [("ut", {}), ("lm", {"universal": "true"}), ("encoder", {"universal": "true"})]
)
def test_act_given_to_a_model_that_adds_act_itself_is_wrapped_once(model, settings):
    from gtx.run.config import resolve_configs
    from gtx.run.runner import RunConfig

    for spec in ("act(local:w=2)", "local:w=2"):
        config = RunConfig(task="copy", model=model, pattern=spec, settings=settings)
        assert resolve_configs(config).pattern.spec == "act(local:w=2)"  # what the run's header and rows say
    # the chosen pattern itself wrapped, bias and union included
    for spec, run in (("local:w=2+alibi", "act(local:w=2+alibi)"), ("local|strided:l=4", "act(local:w=4|strided:l=4)")):
        configs = resolve_configs(RunConfig(task="copy", model=model, pattern=spec, settings=settings))
        assert configs.pattern.spec == run and configs.chosen.spec == run[4:-1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "nope"], "unknown task 'nope'; known tasks: addition, copy"),
        (
            ["--pattern", "act(local:w=2)"],
            "which model 'transformer' does not have: it would do nothing; use a model with ACT (encoder --set "
            "universal=true, lm --set universal=true, ut), or drop the act(...)",
        ),
        (["--pattern", "lokal"], "unknown pattern 'lokal'"),
        (["--set", "nope=1"], "--set nope: no such setting; known settings: model transformer: layers"),
        (["--set", "dim=abc"], "--set dim=abc: model 'transformer' expects int for dim"),
        (["--task", "translation"], "task translation needs its data: --set data_dir=DIR"),
        (["--task", "translation", "--set", "data_dir=/nonexistent"], "missing /nonexistent/train.src"),
        (["--device", "cuda"], "--device cuda: no CUDA GPU is visible to torch here"),
        (["--model", "ut", "--layers", "2"], "--set layers: no such setting"),
        (["--set", "dim"], "write key=value"),
        (
            ["--dim", "10", "--heads", "3"],
            "bad settings for model 'transformer': d_model=10 must be divisible by heads=3",
        ),
        (
            ["--task", "reverse", "--set", "train_len=10", "--set", "test_len=5"],
            "bad settings for task 'reverse': need train_len >= 1 and test_len > train_len",
        ),
        # every setting checked against its declared range before anything runs
        (["--set", "heads=-2"], "--set heads=-2: model 'transformer' needs heads in [1, inf)"),
        (["--set", "dim=-1"], "--set dim=-1: model 'transformer' needs dim in [1, inf)"),
        (["--set", "batch_size=0"], "--set batch_size=0: training needs batch_size in [1, inf)"),
        (["--set", "warmup=0"], "--set warmup=0: training needs warmup in [1, inf)"),
        (["--set", "lr_factor=-1"], "--set lr_factor=-1.0: training needs lr_factor in (0, inf)"),
        (["--set", "dropout=nan"], "--set dropout=nan: model 'transformer' needs dropout in [0, 1)"),
        (["--set", "mean_len=-3"], "--set mean_len=-3.0: task 'copy' needs mean_len in [1, inf)"),
        (["--seed", str(2**70)], "--seed 1180591620717411303424: choose a seed from 0 to 2147483647"),
        (["--backend", "flex", "--device", "cpu"], "backend 'flex' has no backward on cpu, so it cannot train"),
    ],
)
def test_bad_input_one_line_exit_2_writes_nothing(tmp_path, args, message):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = tmp_path / "res"
    result = gtx("run", "--results", str(out), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not out.exists()


def test_compare_without_runs_says_what_to_do(tmp_path):
    result = gtx("compare", "--results", str(tmp_path))
    assert result.exit_code == 2 and "no runs under" in result.output


def test_models_and_tasks_list_like_patterns():
    models = gtx("models").output
    assert models.startswith("NAME") and "transformer" in models and "max_depth=8" in models
    tasks = gtx("tasks").output
    for name in ("copy", "sort", "reverse", "addition", "listops", "g2p", "translation"):
        assert any(line.startswith(name) for line in tasks.splitlines()), name
    # what a pretrained model's tokenizer writes
    assert [line.split()[0] for line in tasks.splitlines() if "lm, text" in line] == [
        "cwe",
        "needle",
        "niah",
        "text",
        "vt",
    ]


def test_runs_are_reproducible_from_the_seed(tmp_path):
    args = ["run", "--layers", "1", "--epochs", "1", *TINY]
    for name in ("a", "b"):
        assert gtx(*args, "--results", str(tmp_path / name)).exit_code == 0
    a, b = load(tmp_path / "a"), load(tmp_path / "b")
    assert a.loss.tolist() == b.loss.tolist() and a.token_acc.tolist() == b.token_acc.tolist()
    assert gtx(*args, "--seed", "1", "--results", str(tmp_path / "c")).exit_code == 0
    assert load(tmp_path / "c").loss.tolist() != a.loss.tolist()


@pytest.mark.parametrize(
    "task, extra, metric",
    [
        ("g2p", ["--set", "max_words=150", "--set", "beam=2"], "per"),
        ("listops", ["--set", "n_train=40", "--set", "n_valid=8", "--set", "n_test=8", "--set", "max_len=30"], None),
        (
            "addition",
            [
                "--set",
                "n_train=40",
                "--set",
                "n_valid=8",
                "--set",
                "n_test=8",
                "--set",
                "train_len=6",
                "--set",
                "test_len=9",
            ],
            None,
        ),
    ],
)
def test_other_tasks_end_to_end(tmp_path, task, extra, metric):
    result = gtx(
        "run",
        "--task",
        task,
        "--layers",
        "1",
        "--epochs",
        "1",
        "--dim",
        "16",
        "--heads",
        "2",
        "--dim-ff",
        "16",
        "--quiet",
        "--results",
        str(tmp_path),
        *extra,
    )
    assert result.exit_code == 0, result.output
    df = load(tmp_path)
    test = df[df.split == "test"].iloc[0]
    assert 0 <= test.seq_acc <= 1
    if metric:
        assert metric in json.loads(test.metrics)


def test_translation_end_to_end_with_beam_and_bleu(tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    pairs = [("a b c", "x y z"), ("b c d", "y z w"), ("c d e", "z w v"), ("d e a", "w v x")] * 5
    for stem in ("train", "val", "test"):
        (data / f"{stem}.src").write_text("\n".join(s for s, _ in pairs) + "\n")
        (data / f"{stem}.tgt").write_text("\n".join(t for _, t in pairs) + "\n")
    result = gtx(
        "run",
        "--task",
        "translation",
        "--set",
        f"data_dir={data}",
        "--set",
        "beam=3",
        "--layers",
        "1",
        "--epochs",
        "2",
        "--dim",
        "16",
        "--heads",
        "2",
        "--dim-ff",
        "16",
        "--quiet",
        "--results",
        str(tmp_path / "res"),
    )
    assert result.exit_code == 0, result.output
    test = load(tmp_path / "res").query("split == 'test'").iloc[0]
    metrics = json.loads(test.metrics)
    assert metrics["beam"] == 3 and 0 <= metrics["bleu"] <= 100


def test_a_task_beam_wider_than_its_target_vocabulary_is_refused_before_training(tmp_path):
    data = tmp_path / "corpus"
    data.mkdir()
    for stem in ("train", "val", "test"):
        (data / f"{stem}.src").write_text("a b\nb c\n")
        (data / f"{stem}.tgt").write_text("x y\ny z\n")
    result = gtx(
        "run", "--task", "translation", "--set", f"data_dir={data}", "--set", "beam=100000", "--results", str(tmp_path)
    )
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "--set beam=100000: task 'translation' decodes from" in result.output and "epoch" not in result.output
    assert not (tmp_path / "runs").exists()


def test_cell_key_names_the_experiment_not_how_it_was_spelled():
    from gtx.run.runner import RunConfig, cell_key

    key = cell_key(RunConfig(pattern="local", settings={"epochs": "4", "dim": "16"}))
    assert key == cell_key(RunConfig(pattern="local:w=4", settings={"train.epochs": "4", "model.dim": "16"}))
    assert key != cell_key(RunConfig(pattern="local", seed=1, settings={"epochs": "4", "dim": "16"}))
    assert key != cell_key(RunConfig(pattern="local", settings={"epochs": "3", "dim": "16"}))
    assert key == cell_key(
        RunConfig(pattern="local", device="cpu", results_dir="elsewhere", settings={"epochs": "4", "dim": "16"})
    )
    # equal settings, other task
    assert key != cell_key(RunConfig(task="sort", pattern="local", settings={"epochs": "4", "dim": "16"}))


def test_the_backend_is_found_once_when_the_run_is_resolved():
    """The resolved run holds its backend, checked on its device; the attention it builds uses that one."""
    from gtx.run.build import build_attention
    from gtx.run.config import RunConfig, resolve

    r = resolve(RunConfig(backend="dense", settings={"dim": "16", "heads": "2", "n_train": "8", "n_valid": "4"}))
    assert r.backend.name == "dense" and build_attention(r).backend is r.backend


def test_a_run_stopped_by_max_steps_labels_every_row_with_the_epoch_that_ran(tmp_path):
    result = gtx(
        "run",
        "--max-steps",
        "2",
        "--epochs",
        "3",
        "--layers",
        "1",
        "--results",
        str(tmp_path),
        *[a for a in TINY if a != "--quiet"],
    )
    assert result.exit_code == 0, result.output
    df = load(tmp_path)
    assert df[["split", "epoch"]].values.tolist() == [["train", 1], ["valid", 1], ["test", 1]]
    summary = result.output[result.output.index("split") :].splitlines()
    assert [line.split()[0] for line in summary[1:4]] == ["train", "valid", "test"]


@pytest.mark.parametrize("given", [["--batch-size", "100000000"], ["--set", "batch_size=41"]])
def test_a_batch_larger_than_the_training_data_is_refused_before_training(tmp_path, given):
    small = [a for a in TINY if a not in ("--batch-size", "8")]  # 40 training examples
    result = gtx("run", "--layers", "1", *given, "--results", str(tmp_path), *small)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "task 'copy' has 40 training examples, fewer than one batch; give at most 40" in result.output
    assert not (tmp_path / "runs").exists()
    if given[0] == "--batch-size":  # one batch of all of them is allowed
        whole = gtx("run", "--layers", "1", "--batch-size", "40", "--epochs", "1", "--results", str(tmp_path), *small)
        assert whole.exit_code == 0, whole.output
