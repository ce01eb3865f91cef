"""Run loggers: TensorBoard read back from its event file, a plugin's logger, a logger that raises."""

import pytest


def test_tensorboard_event_file_holds_each_epoch(tmp_path, tiny_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tiny_run(tmp_path, "--log", "tensorboard", epochs=2)
    events = EventAccumulator(str(run.folder / "tensorboard" / run.rows.run_id.iloc[0]))
    events.Reload()
    valid = events.Scalars("valid/token_acc")
    assert [e.step for e in valid] == [1, 2]
    df = run.rows.query("split == 'valid'").sort_values("epoch")
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


def test_hook_register_loggers(tmp_path, plugin_dir, tiny_run):
    folder = plugin_dir(my_logger=LOGGER)
    run = tiny_run(tmp_path, "--plugins-dir", folder, "--log", "recorder", epochs=2)
    calls = (run.folder / "calls.jsonl").read_text().splitlines()
    assert calls == [
        '["start", "copy"]',
        '["epoch_end", 1, ["train", "valid"]]',
        '["epoch_end", 2, ["train", "valid"]]',
        '["end", 5, "finished"]',
    ]


def test_a_logger_that_raises_is_named_and_the_rows_stay(tmp_path, plugin_dir, tiny_run):
    folder = plugin_dir(my_logger=LOGGER)
    broken = tiny_run(tmp_path, "--plugins-dir", folder, "--log", "broken", epochs=2, exit_code=2)
    assert (
        "logger 'broken' (plugin" in broken.result.output
        and "my_logger.py) raised: ConnectionError: tracking server unreachable" in broken.result.output
    )
    assert sorted(broken.rows.split) == ["train", "valid"]  # epoch 1's rows were written before the logger ran
    unknown = tiny_run(tmp_path / "u", "--log", "mlflow", epochs=2, exit_code=2)
    assert (
        "unknown logger 'mlflow'; known loggers: " in unknown.result.output and "tensorboard" in unknown.result.output
    )
    assert not (tmp_path / "u").exists()
