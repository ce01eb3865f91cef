"""The results folder's layout: where each thing gtx leaves lives under ``<results>``, written once.

Every reader and writer asks :class:`ResultsFolder` for its path rather than joining names by hand,
and results/README.md is generated from it (``make docs``; tests/test_docs.py checks it is current).
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path


class ResultsFolder:
    """The places under one results folder. A method's docstring is its line in results/README.md."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def runs(self) -> Path:
        """The runs' tables, one file each (below)."""
        return self.root / "runs"

    def run_table(self, run_id: str) -> Path:
        """One file per `gtx run` or `gtx eval`: a row per epoch and split, the schema in
        `gtx/records/results.py`; `gtx compare`, `gtx runs` and `load_results` read them all."""
        return self.runs() / f"{run_id}.csv"

    def checkpoints(self) -> Path:
        """Every run's checkpoint folder (below)."""
        return self.root / "checkpoints"

    def checkpoint_dir(self, run_id: str) -> Path:
        """A run's checkpoints: `last.pt` after every epoch, `best.pt` at its best validation; `gtx run
        --resume`, `gtx eval`, `gtx plot attention` and `gtx.probe` read them."""
        return self.checkpoints() / run_id

    def tensorboard(self, run_id: str) -> Path:
        """A run's TensorBoard event files, with `--log tensorboard`."""
        return self.root / "tensorboard" / run_id

    def sweeps(self) -> Path:
        """What sweeps keep beside their runs (below)."""
        return self.root / "sweeps"

    def sweep_logs(self, sweep: str) -> Path:
        """Each cell's output, `<index>.log`, under a sweep's name (`gtx sweep`, `gtx frontier`)."""
        return self.sweeps() / sweep / "logs"

    def sweep_jobs(self, sweep: str) -> Path:
        """submitit's job files and logs, with `--launcher submitit`."""
        return self.sweeps() / sweep / "submitit"

    def claims(self) -> Path:
        """One file per cell being run, naming the process that runs it: two sweeps sharing a results
        folder never run one cell twice. A claim is removed when its cell ends."""
        return self.sweeps() / "claims"

    def frontiers(self) -> Path:
        """`gtx frontier`'s tables (`<name>.csv`) and figures (`<name>.png`); `load_frontiers` reads
        the tables and `gtx report` shows both."""
        return self.root / "frontiers"

    def bench(self, kind: str, stamp: str) -> Path:
        """`gtx bench` tables (`attention` and `train`, by time), and their figures beside them."""
        return self.root / "bench" / f"{kind}-{stamp}.csv"

    def plot(self, name: str) -> Path:
        """`gtx plot`'s figures where no `--output` is given."""
        return self.root / "plots" / name

    def report(self) -> Path:
        """`gtx report`'s page: one self-contained HTML file."""
        return self.root / "report.html"


#: the places results/README.md lists, in its order (the folders marked "below" are not listed apart)
LISTED = (
    "run_table",
    "checkpoint_dir",
    "tensorboard",
    "sweep_logs",
    "sweep_jobs",
    "claims",
    "frontiers",
    "bench",
    "plot",
    "report",
)
FILES = {"run_table", "bench", "plot", "report"}  # the others are folders: "/" ends their path

WIDTH = 100  # the column the README is wrapped at, as the docs are
README_HEADER = """# results/

Where gtx writes by default (`--results DIR` for another folder); generated from
`gtx/records/layout.py` (`make docs`). Only this README and `.gitignore` are tracked: the rest is
yours.
"""


def readme() -> str:
    """results/README.md: each place :data:`LISTED`, its path as the method builds it, and its docstring."""
    folder = ResultsFolder("")
    lines = [README_HEADER]
    for name in LISTED:
        method = getattr(folder, name)
        path = method(*(f"<{p}>" for p in inspect.signature(method).parameters)).as_posix()
        text = " ".join(inspect.getdoc(method).split())
        entry = f"- `{path}{'' if name in FILES else '/'}` — {text}"
        lines.append(textwrap.fill(entry, WIDTH, subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(lines) + "\n"
