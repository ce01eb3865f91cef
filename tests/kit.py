"""The test kit: gtx's command line invoked in this process, ``--set`` arguments from a dict, and tiny
runs into a results folder (conftest.py serves ``invoke`` and ``tiny_run`` as the fixtures ``cli`` and
``tiny_run``)."""

import dataclasses
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import pytest
from click.testing import CliRunner, Result

from gtx import native
from gtx.cli import cli as gtx_cli
from gtx.errors import UnknownNameError
from gtx.plugins import registry as plugins
from gtx.records.results import load

#: a model that trains in a second on a CPU: one layer of width 16 with 2 heads
TINY_MODEL = {"layers": 1, "dim": 16, "heads": 2, "dim_ff": 16}
#: one epoch in batches of 8
TINY_TRAIN = {"epochs": 1, "batch_size": 8}
#: the copy task with 40 training sequences of about 5 tokens
TINY_COPY = {"n_train": 40, "n_valid": 10, "n_test": 10, "mean_len": 5}


def invoke(*args, commands: bool = False) -> Result:
    """``gtx ARGS`` (each given as ``str(arg)``), click's Result: exit code and output (stdout and stderr).
    ``commands``: the loaded plugins' commands registered first, as gtx's entry point does."""
    if commands:
        plugins.call_each("register_commands", cli=gtx_cli)
    return CliRunner().invoke(gtx_cli, [str(a) for a in args])


def sets(settings: dict) -> list[str]:
    """``--set key=value`` for each item, in order; a value of None is left out, a bool written true/false."""
    return [
        a
        for key, value in settings.items()
        if value is not None
        for a in ("--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    ]


def model_sizes(model: str, settings: dict) -> dict:
    """TINY_MODEL's sizes that ``model`` has (a ut has no layers), all of them for a model not registered
    yet (a plugin's); none for a model read from a folder (a ``path`` setting): the folder's are its sizes."""
    if settings.get("path"):
        return {}
    try:
        config = plugins.MODELS.get(model).config
    except UnknownNameError:
        return TINY_MODEL
    fields = {f.name for f in dataclasses.fields(config)} if config else set()
    return {k: v for k, v in TINY_MODEL.items() if k in fields}


class Run(NamedTuple):
    result: Result  # the exit code and what the command said
    folder: Path  # the results folder
    rows: pd.DataFrame  # every row the folder holds after the run (results.load)


def tiny_run(
    tmp_path,
    *args,
    task: str = "copy",
    pattern: str = "full",
    model: str = "transformer",
    quiet: bool = True,
    exit_code: int = 0,
    **settings,
) -> Run:
    """``gtx run`` of a tiny model into ``tmp_path/results`` (runs into one folder add up there), asserting
    its exit code. ``settings``: ``--set`` values over the model's sizes of TINY_MODEL (model_sizes),
    TINY_TRAIN and, for the copy task, TINY_COPY; None leaves one out. ``args``: further options
    (``--plugins-dir``, ``--log``, ``--seed``...). ``quiet=False`` keeps what a run says as it goes (its
    notes among it)."""
    folder = Path(tmp_path) / "results"
    given = {
        **model_sizes(model, settings),
        **TINY_TRAIN,
        **(TINY_COPY if task == "copy" else {}),
        **settings,
    }
    result = invoke(
        "run",
        *("--task", task, "--model", model, "--pattern", pattern, "--results", folder),
        *(["--quiet"] if quiet else []),
        *sets(given),
        *args,
    )
    assert result.exit_code == exit_code, result.output
    return Run(result, folder, load(folder))


def on_torch(fn):
    """fn() on torch ops: no Triton, no C kernel (the reference a kernel is held to)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("GTX_KERNELS", "torch")
        m.setattr(native, "kernel", lambda *_: None)
        return fn()
