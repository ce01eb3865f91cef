"""Which run a user means: one resolver for every command that takes a run (``gtx show``, ``eval``,
``run --resume``, ``plot attention``, ``plot act``, ``generate``, ``export``).

A run is named by its full id, a unique prefix of it (``20260101-1200``) or a unique suffix (the
6 hex digits ``gtx runs`` prints, ``b54179``). The runs of a results folder are those with a results
table (``runs/<id>.csv``) or a checkpoint folder (``checkpoints/<id>/``). An unknown or ambiguous
name is one GtxError line that lists the candidates.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

from gtx.errors import GtxError
from gtx.records import checkpoint
from gtx.records.layout import ResultsFolder


def short_id(run_id: str) -> str:
    """The run id's random tail (``20260101-120000-copy-ut-b54179`` -> ``b54179``): enough for ``match_run``."""
    return run_id.rsplit("-", 1)[-1]


def run_ids(results_dir: str | Path) -> list[str]:
    """Every run under ``results_dir`` (results table or checkpoint folder), oldest first (ids start with their start time)."""
    root = ResultsFolder(results_dir)
    tables = {p.stem for p in root.runs().glob("*.csv") if not p.name.startswith(".")}  # '.': a table being written
    folders = {p.name for p in root.checkpoints().glob("*") if p.is_dir()}
    return sorted(tables | folders)


def match_run(ids: Iterable[str], ref: str, where: str = "") -> str:
    """The id among ``ids`` that ``ref`` names: the id itself, or a unique prefix or suffix of it. An
    unknown ``ref`` names the closest ids, an ambiguous one those it matches, as one GtxError line."""
    ids = list(dict.fromkeys(ids))
    ref = ref.strip()
    if not ref:
        raise GtxError(f"no run named: give a run id (or its 6-hex-digit tail); `gtx runs{where}` lists them")
    if ref in ids:
        return ref
    matches = [i for i in ids if i.startswith(ref) or i.endswith(ref)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise GtxError(
            f"run {ref!r} is ambiguous: it matches {len(matches)} runs ({', '.join(matches[:5])}{', ...' if len(matches) > 5 else ''}); "
            "give more of the id"
        )
    # the tails are compared too: a mistyped 6-hex id is far from any whole id
    by_tail = {short_id(i): i for i in ids}
    close = [by_tail.get(c, c) for c in difflib.get_close_matches(ref, [*ids, *by_tail], n=3, cutoff=0.5)]
    hint = (
        f"closest: {', '.join(dict.fromkeys(close))}"
        if close
        else f"newest: {', '.join(ids[-3:])}"
        if ids
        else "there are none"
    )
    raise GtxError(
        f"no run {ref!r} among {len(ids)} run{'s' * (len(ids) != 1)}{where}; {hint}; `gtx runs{where}` lists them all"
    )


def resolve_run(ref: str, results_dir: str | Path) -> str:
    """The full id of the run under ``results_dir`` that ``ref`` names (see ``match_run``)."""
    return match_run(run_ids(results_dir), ref, f" --results {results_dir}" if str(results_dir) != "results" else "")


def find_checkpoint(
    ref: str | Path, results_dir: str | Path, names: tuple[str, ...] = (checkpoint.BEST, checkpoint.LAST)
) -> Path:
    """A checkpoint file: ``ref`` itself where it is a file or ends in ``.pt``, else the first of
    ``names`` in the folder of the run ``ref`` names under ``results_dir`` (``resolve_run``)."""
    path = Path(ref)
    if path.is_file() or path.suffix == ".pt":
        return path
    run_id = resolve_run(str(ref), results_dir)
    folder = checkpoint.checkpoint_dir(results_dir, run_id)
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise GtxError(
        f"run {run_id} has no checkpoint ({' or '.join(names)}) under {folder.parent}; "
        "it may still be in its first epoch, or its checkpoints were removed"
    )
