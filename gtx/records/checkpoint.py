"""Checkpoints: what a run needs to continue or be evaluated, written atomically beside its results.

    <results>/checkpoints/<run_id>/last.pt   after every epoch: what ``gtx run --resume`` continues
    <results>/checkpoints/<run_id>/best.pt   the epoch with the lowest valid loss: what ``gtx eval`` reads

A checkpoint holds only tensors and plain containers, so ``torch.load(weights_only=True)`` reads it:
the model and optimiser state, the CPU random state (dropout continues as if never stopped), the
run's configuration, its result rows so far (JSON) and both vocabularies.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

import gtx
from gtx.data.task import SPLITS
from gtx.errors import GtxError
from gtx.files import atomic_write
from gtx.records.layout import ResultsFolder
from gtx.records.results import COLUMNS
from gtx.records.run_config import RunConfig

FORMAT = "gtx-checkpoint/1"
REQUIRED = (
    "run_config",
    "common",
    "epoch",
    "rows",
    "model",
    "vocab",
)  # what every reader of a checkpoint takes from it
RESUMABLE = ("optimizer", "step", "rng", "best_valid_loss")  # what --resume takes besides
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
    """Read a checkpoint on the CPU; a missing, truncated or foreign file, or a field damaged or
    written by a newer gtx (one this gtx does not know), is one GtxError line naming the field.
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
    require(state, path, REQUIRED)
    for key, check in _CHECKS.items():
        if key in state:
            check(state, key, path)
    return state


def require(state: dict, path: Path, keys: tuple[str, ...]) -> None:
    """One line naming the fields of ``keys`` that a checkpoint lacks."""
    missing = [key for key in keys if key not in state]
    if missing:
        raise GtxError(f"checkpoint {path} lacks {', '.join(missing)}; use a file written by gtx run")


def run_config(state: dict) -> RunConfig:
    """The run's configuration, from a checkpoint ``load`` checked."""
    return RunConfig(**state["run_config"])


def owner(state: dict, path: Path) -> str:
    """The run a checkpoint belongs to (its ``common``'s run id); one line where it sits in another
    run's folder (``<results>/checkpoints/<run_id>/``): read as that run's, its rows would be filed
    under a run it is not."""
    run_id = json.loads(state["common"])["run_id"]
    folder = Path(path).parent
    if folder.parent.name == "checkpoints" and folder.name != run_id:
        raise GtxError(
            f"{path} is a checkpoint of run {run_id}, not of {folder.name} whose folder holds it; "
            f"use run {run_id}'s own checkpoints, or move it back to {folder.parent / run_id}"
        )
    return run_id


def rows_of(state: dict) -> list[dict]:
    return json.loads(state["rows"])


def _damaged(path: Path, key: str, what: str) -> GtxError:
    return GtxError(f"checkpoint {path}: its {key} {what}, damaged; use a file written by gtx run")


def _newer(state: dict, path: Path, key: str, unknown: list[str]) -> GtxError:
    """Fields this gtx does not know: a later gtx added them, and what they mean is that gtx's to say."""
    try:
        wrote = json.loads(state["common"]).get("gtx_version")
    except (KeyError, TypeError, ValueError, AttributeError):
        wrote = None
    by = f"gtx {wrote}" if isinstance(wrote, str) and wrote != gtx.__version__ else "a newer gtx"
    return GtxError(
        f"checkpoint {path}: its {key} holds {', '.join(map(repr, unknown))}, a field gtx {gtx.__version__} does not know "
        f"(written by {by}); read it with the gtx that wrote it"
    )


_RUN_FIELDS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
_TYPES = {"str": str, "int": int, "dict[str, str]": dict, "list[str]": list}


def _check_run_config(state: dict, key: str, path: Path) -> None:
    value = state[key]
    if not isinstance(value, Mapping):
        raise _damaged(path, key, f"is a {type(value).__name__}, not a mapping")
    if unknown := [k for k in value if k not in _RUN_FIELDS]:
        raise _newer(state, path, key, unknown)
    for name, v in value.items():
        kind = _TYPES[_RUN_FIELDS[name]]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise _damaged(path, f"{key} field {name!r}", f"is a {type(v).__name__}, not a {kind.__name__}")


def _json(state: dict, key: str, path: Path, kind: type):
    try:
        value = json.loads(state[key])
    except (TypeError, ValueError):
        raise _damaged(path, key, "is not JSON") from None
    if not isinstance(value, kind):
        raise _damaged(path, key, f"is JSON of a {type(value).__name__}, not a {kind.__name__}")
    return value


def _check_common(state: dict, key: str, path: Path) -> None:
    common = _json(state, key, path, dict)
    if unknown := [k for k in common if k not in COLUMNS]:
        raise _newer(state, path, key, unknown)
    if bad := [k for k in ("run_id", "pattern") if not isinstance(common.get(k), str)]:
        raise _damaged(path, key, f"has no {bad[0]}")
    if common.get("definitions") is not None and not _versions(common["definitions"]):
        raise _damaged(path, key, "holds definitions that are not JSON of methods' versions")


def _versions(text) -> bool:
    """Whether ``text`` is what a run records as its definitions: JSON of method names to whole numbers."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return False
    return isinstance(value, dict) and all(type(v) is int for v in value.values())


def _check_rows(state: dict, key: str, path: Path) -> None:
    rows = _json(state, key, path, list)
    if any(not isinstance(row, dict) or row.get("split") not in SPLITS for row in rows):
        raise _damaged(path, key, "holds a row without a split")
    if unknown := sorted({k for row in rows for k in row if k not in COLUMNS}):
        raise _newer(state, path, key, unknown)


def _check_count(state: dict, key: str, path: Path) -> None:
    value = state[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _damaged(path, key, f"is {value!r}, not a count")


def _check_vocab(state: dict, key: str, path: Path) -> None:
    vocab = state[key]
    sides = [vocab.get(side) for side in ("src", "tgt")] if isinstance(vocab, Mapping) else [None]
    if not all(isinstance(v, list) and all(isinstance(t, str) for t in v) for v in sides):
        raise _damaged(path, key, "is not a src and a tgt list of tokens")


def _check_tensors(state: dict, key: str, path: Path) -> None:
    if not isinstance(state[key], Mapping) or not all(isinstance(v, torch.Tensor) for v in state[key].values()):
        raise _damaged(path, key, "is not a mapping of tensors")


def _check_optimizer(state: dict, key: str, path: Path) -> None:
    if not isinstance(state[key], Mapping) or not {"state", "param_groups"} <= set(state[key]):
        raise _damaged(path, key, "is not an optimiser's state")


def _check_rng(state: dict, key: str, path: Path) -> None:
    shape = torch.get_rng_state().shape
    rng = state[key]
    if not (
        isinstance(rng, (list, tuple))
        and rng
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == shape for t in rng)
    ):
        raise _damaged(path, key, "is not a random state per process")


def _check_loss(state: dict, key: str, path: Path) -> None:
    if not isinstance(state[key], (int, float)) or isinstance(state[key], bool):
        raise _damaged(path, key, f"is {state[key]!r}, not a loss")


#: each field's check: it is what gtx writes, or one line naming the checkpoint and the field
_CHECKS = {
    "run_config": _check_run_config,
    "common": _check_common,
    "epoch": _check_count,
    "rows": _check_rows,
    "model": _check_tensors,
    "vocab": _check_vocab,
    "optimizer": _check_optimizer,
    "step": _check_count,
    "rng": _check_rng,
    "best_valid_loss": _check_loss,
}


def check_vocab(state: dict, task, path: Path) -> None:
    """The task must encode tokens as the checkpoint's model learned them."""
    for side in ("src", "tgt"):
        mine, theirs = getattr(task, f"{side}_vocab").itos, state["vocab"][side]
        if mine != theirs:
            raise GtxError(
                f"checkpoint {path} was trained with a {side} vocabulary of {len(theirs)} tokens; task {task.name!r} here has "
                f"{len(mine)}{' (other tokens)' if len(mine) == len(theirs) else ''}: evaluate it on the task and settings it was trained on"
            )


def recorded_definitions(state: dict) -> dict[str, int]:
    """The definition versions a checkpoint's run recorded (its ``common``'s ``definitions``); {} for a
    checkpoint written before runs recorded them."""
    text = json.loads(state["common"]).get("definitions")
    return json.loads(text) if isinstance(text, str) else {}


def check_definitions(state: dict, definitions: Mapping[str, int], path: Path) -> None:
    """One line where a method the checkpoint was trained with has another definition version here
    (``definitions``: this gtx's, of the pattern the checkpoint is read under): its weights were
    learned for a computation this code no longer runs under that name."""
    recorded = recorded_definitions(state)
    for name, version in sorted(definitions.items()):
        if name in recorded and recorded[name] != version:
            raise GtxError(
                f"checkpoint {path} was trained under {name} definition {recorded[name]}; this gtx's {name} is definition "
                f"{version}, which computes something else: train again, or evaluate it under a pattern without {name}"
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
