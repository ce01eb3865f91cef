"""Run loggers: TensorBoard read back from its event file, a plugin's logger, a logger that raises."""

import pytest
from click.testing import CliRunner

from gtx.cli import cli
from gtx.records.results import load

TINY = [
    "--set",
    "n_train=32",
    "--set",
    "n_valid=8",
    "--set",
    "n_test=8",
    "--set",
    "mean_len=5",
    "--layers",
    "1",
    "--dim",
    "16",
    "--heads",
    "2",
    "--dim-ff",
    "16",
    "--batch-size",
    "8",
    "--quiet",
    "--epochs",
    "2",
]


def gtx(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_tensorboard_event_file_holds_each_epoch(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = gtx("run", "--log", "tensorboard", "--results", tmp_path, *TINY)
    assert result.exit_code == 0, result.output
    run_id = load(tmp_path).run_id.iloc[0]
    events = EventAccumulator(str(tmp_path / "tensorboard" / run_id))
    events.Reload()
    valid = events.Scalars("valid/token_acc")
    assert [e.step for e in valid] == [1, 2]
    df = load(tmp_path).query("split == 'valid'").sort_values("epoch")
    assert [e.value for e in valid] == pytest.approx(df.token_acc.tolist())
    assert {"train/loss", "train/tokens_per_s", "test/seq_acc"} <= set(events.Tags()["scalars"])


LOGGER = '''
import json
from gtx import hookimpl
from gtx.run.loggers import Logger

class Recorder(Logger):
    """Writes what it is told into calls.jsonl."""
    def start(self, config):
        self.write("start", config["task"])
    def epoch_end(self, epoch, rows):
        self.write("epoch_end", epoch, [r["split"] for r in rows])
    def end(self, rows, status):
        self.write("end", len(rows), status)
    def write(self, *call):
        with open(self.results_dir / "calls.jsonl", "a") as f:
            f.write(json.dumps(call) + "\\n")

class Broken(Logger):
    """Raises at the end of the first epoch."""
    def epoch_end(self, epoch, rows):
        raise ConnectionError("tracking server unreachable")

@hookimpl
def register_loggers(register):
    register("recorder", Recorder)
    register("broken", Broken)
'''


def test_hook_register_loggers(tmp_path, plugin_dir):
    folder = plugin_dir(my_logger=LOGGER)
    result = gtx("run", "--plugins-dir", folder, "--log", "recorder", "--results", tmp_path, *TINY)
    assert result.exit_code == 0, result.output
    calls = (tmp_path / "calls.jsonl").read_text().splitlines()
    assert calls == [
        '["start", "copy"]',
        '["epoch_end", 1, ["train", "valid"]]',
        '["epoch_end", 2, ["train", "valid"]]',
        '["end", 5, "finished"]',
    ]


def test_a_logger_that_raises_is_named_and_the_rows_stay(tmp_path, plugin_dir):
    folder = plugin_dir(my_logger=LOGGER)
    result = gtx("run", "--plugins-dir", folder, "--log", "broken", "--results", tmp_path, *TINY)
    assert result.exit_code == 2
    assert (
        "logger 'broken' (plugin" in result.output
        and "my_logger.py) raised: ConnectionError: tracking server unreachable" in result.output
    )
    assert sorted(load(tmp_path).split) == ["train", "valid"]  # epoch 1's rows were written before the logger ran
    unknown = gtx("run", "--log", "mlflow", "--results", tmp_path / "u", *TINY)
    assert (
        unknown.exit_code == 2
        and "unknown logger 'mlflow'; known loggers: " in unknown.output
        and "tensorboard" in unknown.output
    )
    assert not (tmp_path / "u").exists()
