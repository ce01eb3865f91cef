"""Checkpoints: what a run needs to continue or be evaluated, written atomically beside its results.

    <results>/checkpoints/<run_id>/last.pt   after every epoch: what ``gtx run --resume`` continues
    <results>/checkpoints/<run_id>/best.pt   the epoch with the lowest valid loss: what ``gtx eval`` reads

A checkpoint holds only tensors and plain containers, so ``torch.load(weights_only=True)`` reads it:
the model and optimiser state, the CPU random state (dropout continues as if never stopped), the
run's configuration, its result rows so far (JSON) and both vocabularies.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
import zipfile
from pathlib import Path

import torch

from gtx.errors import GtxError
from gtx.files import atomic_write

FORMAT = "gtx-checkpoint/1"
LAST, BEST = "last.pt", "best.pt"


def checkpoint_dir(results_dir: str | Path, run_id: str) -> Path:
    return Path(results_dir) / "checkpoints" / run_id


def save(path: Path, state: dict) -> None:
    """Write ``state`` atomically (``task.atomic_write``): a kill leaves the previous file whole."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buffer)
    atomic_write(path, buffer.getvalue())


def load(path: str | Path, mmap: bool = False) -> dict:
    """Read a checkpoint on the CPU; a missing, truncated or foreign file is one GtxError line.
    ``mmap``: map the tensors instead of reading them, for a cheap look at the rest (its epoch, rows)."""
    path = Path(path)
    if not path.is_file():
        raise GtxError(
            f"checkpoint {path} does not exist; runs keep theirs under <results>/checkpoints/<run_id>/ ({LAST}, {BEST})"
        )
    try:
        with warnings.catch_warnings():  # torch warns before some of the errors below; the one line says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise GtxError(
            f"checkpoint {path} is truncated or not a gtx checkpoint ({type(e).__name__}); use a file written by gtx run"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GtxError(
            f"checkpoint {path} is not a gtx checkpoint (no {FORMAT!r} marker); use a file written by gtx run"
        )
    return state


def rows_of(state: dict) -> list[dict]:
    return json.loads(state["rows"])


def check_vocab(state: dict, task, path: Path) -> None:
    """The task must encode tokens as the checkpoint's model learned them."""
    for side in ("src", "tgt"):
        mine, theirs = getattr(task, f"{side}_vocab").itos, state["vocab"][side]
        if mine != theirs:
            raise GtxError(
                f"checkpoint {path} was trained with a {side} vocabulary of {len(theirs)} tokens; task {task.name!r} here has "
                f"{len(mine)}{' (other tokens)' if len(mine) == len(theirs) else ''}: evaluate it on the task and settings it was trained on"
            )
