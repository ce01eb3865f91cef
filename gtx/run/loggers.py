"""Run loggers (``gtx run --log NAME``): the base class, and TensorBoard built in.

A logger sees a run's rows as they are written (see ``hookspecs.register_loggers``); a plugin adds
MLflow or Weights & Biases the same way. An exception inside a logger stops the run with one line
naming the logger's plugin; the rows and checkpoints already written stay.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gtx import hookimpl
from gtx.errors import GtxError, plugin_code
from gtx.records.layout import ResultsFolder
from gtx.records.results import scalar_metrics

SCALARS = ("loss", "token_acc", "seq_acc", "tokens_per_s", "wall_s", "density", "act_mean_steps")


class Logger:
    """Base class: every method is optional."""

    def __init__(self, run_id: str, results_dir: Path):
        self.run_id, self.results_dir = run_id, Path(results_dir)

    def start(self, config: dict) -> None:
        pass

    def epoch_end(self, epoch: int, rows: list[dict]) -> None:
        pass

    def end(self, rows: list[dict], status: str) -> None:
        pass


def scalars(row: dict) -> dict[str, float]:
    """A result row's numbers worth a curve: the common columns and the task's scalar metrics."""
    out = {k: float(row[k]) for k in SCALARS if row.get(k) is not None and not math.isnan(float(row[k]))}
    return {**out, **scalar_metrics(json.loads(row.get("metrics") or "{}"))}


class TensorBoardLogger(Logger):
    """TensorBoard event files under <results>/tensorboard/<run_id>/: split/metric per epoch."""

    def __init__(self, run_id: str, results_dir: Path):
        super().__init__(run_id, results_dir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise GtxError(
                "--log tensorboard needs the tensorboard package: pip install tensorboard (or -e '.[tensorboard]')"
            ) from None
        self.writer = SummaryWriter(str(ResultsFolder(self.results_dir).tensorboard(run_id)))

    def start(self, config: dict) -> None:
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=2, sort_keys=True)}\n```")

    def epoch_end(self, epoch: int, rows: list[dict]) -> None:
        for row in rows:
            for name, value in scalars(row).items():
                self.writer.add_scalar(f"{row['split']}/{name}", value, epoch)
        self.writer.flush()

    def end(self, rows: list[dict], status: str) -> None:
        for row in rows:
            if row["split"] == "test":
                for name, value in scalars(row).items():
                    self.writer.add_scalar(f"test/{name}", value, row["epoch"])
        self.writer.add_text("status", status)
        self.writer.close()


class Loggers:
    """The loggers a run asked for, called in order; an exception names the logger and its plugin."""

    def __init__(self, names: list[str], run_id: str, results_dir: Path):
        from gtx.plugins.registry import LOGGERS

        self.entries = [LOGGERS.get(name) for name in names]
        self.loggers = [self._call(e, lambda e=e: e.obj(run_id, results_dir)) for e in self.entries]

    @staticmethod
    def _call(entry, fn):
        with plugin_code(f"logger {entry.name!r} (plugin {entry.plugin})"):
            return fn()

    def call(self, method: str, *args) -> None:
        """``logger.method(*args)`` for each logger: ``start``, ``epoch_end`` or ``end``."""
        for entry, logger in zip(self.entries, self.loggers):
            self._call(entry, lambda logger=logger: getattr(logger, method)(*args))


@hookimpl
def register_loggers(register):
    register("tensorboard", TensorBoardLogger)
