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
import re
import warnings
from pathlib import Path

import torch

from gtx.errors import GtxError
from gtx.files import atomic_write
from gtx.records.layout import ResultsFolder

FORMAT = "gtx-checkpoint/1"
REQUIRED = ("run_config", "common", "epoch", "rows")  # what every reader of a checkpoint takes from it
LAST, BEST = "last.pt", "best.pt"


def checkpoint_dir(results_dir: str | Path, run_id: str) -> Path:
    """``ResultsFolder.checkpoint_dir``: the run's checkpoint folder."""
    return ResultsFolder(results_dir).checkpoint_dir(run_id)


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
    except Exception as e:  # arbitrary bytes fail the unpickler in many ways (a KeyError for "hi")
        raise GtxError(
            f"checkpoint {path} is truncated or not a gtx checkpoint ({type(e).__name__}); use a file written by gtx run"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GtxError(
            f"checkpoint {path} is not a gtx checkpoint (no {FORMAT!r} marker); use a file written by gtx run"
        )
    missing = [key for key in REQUIRED if key not in state]
    if missing:
        raise GtxError(f"checkpoint {path} lacks {', '.join(missing)}; use a file written by gtx run")
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


def trainable_key(key: str) -> bool:
    """A parameter of a pattern's own (nsa, dsa: ``gtx.attention.trainable``; a learned bias's table,
    ``relbias``), not of the model."""
    return any(key.startswith(f"{part}.") or f".{part}." in key for part in ("trainable", "biases"))


def check_shapes(model: torch.nn.Module, state: dict, path: Path, model_name: str, spec: str) -> None:
    """One line where a checkpoint's parameter has another shape than the model built here: for a
    pattern's own parameters (nsa, dsa), the pattern parameters that differ from the run's spec."""
    built = model.state_dict()
    wrong = [
        (k, tuple(v.shape), tuple(built[k].shape))
        for k, v in state["model"].items()
        if k in built and tuple(v.shape) != tuple(built[k].shape)
    ]
    if not wrong:
        return
    key, saved, here = wrong[0]
    shapes = f"{key}: {saved} saved, {here} here"
    if not trainable_key(key):
        raise GtxError(f"checkpoint {path} does not fit model {model_name!r} as configured here: {shapes}")
    trained = json.loads(state["common"])["pattern"]
    ours, theirs = _spec_params(spec), _spec_params(trained)
    differ = [
        f"{k.partition('.')[2] or k}={ours[k]} (the run's {theirs[k]})"
        for k in ours
        if k in theirs and ours[k] != theirs[k]
    ]
    raise GtxError(
        f"pattern {spec!r} has other shapes for the parameters checkpoint {path} learned under {trained!r}"
        f"{': ' + ', '.join(differ) if differ else ''} ({shapes}); evaluate with the run's values of them"
    )


def _spec_params(spec: str) -> dict[str, str]:
    """``nsa:l=8,d=4`` -> {"nsa.l": "8", "nsa.d": "4"}: every pattern's parameters in a spec, by pattern and name."""
    out = {}
    for name, params in re.findall(r"(\w+):([^|&+()]*)", spec):
        for item in params.split(","):
            key, _, value = item.partition("=")
            out[f"{name}.{key.strip()}" if key.strip() else name] = value.strip()
    return out
