"""Checkpoints, resume, gtx eval, and runs that fail well (NaN loss, Ctrl-C, SIGKILL)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch
from kit import TINY_COPY, TINY_MODEL, invoke, sets

from gtx.records import checkpoint
from gtx.records.results import load

#: the kit's tiny model on 64 copy sequences, in batches of 8
TINY = [*sets({**TINY_MODEL, **TINY_COPY, "n_train": 64, "n_valid": 16, "n_test": 16, "batch_size": 8}), "--quiet"]
FIGURES = ["epoch", "split", "loss", "token_acc", "seq_acc"]


def figures(results_dir, run_id=None) -> pd.DataFrame:
    df = load(results_dir)
    if run_id:
        df = df[df.run_id == run_id]
    return df[FIGURES].sort_values(["epoch", "split"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 4-epoch run: the figures a resumed run must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    result = invoke("run", "--epochs", 4, "--seed", 3, "--results", out, *TINY)
    assert result.exit_code == 0, result.output
    return out


def test_every_epoch_writes_last_and_best_checkpoints(reference):
    run_id = load(reference).run_id.iloc[0]
    folder = checkpoint.checkpoint_dir(reference, run_id)
    last, best = (checkpoint.load(folder / name) for name in (checkpoint.LAST, checkpoint.BEST))
    valid = load(reference).query("split == 'valid'")
    assert last["epoch"] == 4 and best["epoch"] == int(valid.epoch[valid.loss.idxmin()])
    assert len(checkpoint.rows_of(last)) == 9 and json.loads(last["common"])["run_id"] == run_id
    assert not list(folder.glob(".*"))  # no temporary file left behind


def test_ctrl_c_keeps_what_is_done_and_resume_reproduces_the_uninterrupted_run(reference, tmp_path, monkeypatch):
    from gtx.run import train

    calls = {"n": 0}
    real = train.Trainer.train_epoch

    def interrupted_in_epoch_3(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(train.Trainer, "train_epoch", interrupted_in_epoch_3)
    result = invoke("run", "--epochs", 4, "--seed", 3, "--results", tmp_path, *TINY)
    assert result.exit_code == 130 and "interrupted in epoch 3: epochs up to 2 are written" in result.output
    run_id = load(tmp_path).run_id.iloc[0]
    assert len(load(tmp_path)) == 4 and f"gtx run --resume {run_id}" in result.output
    monkeypatch.undo()
    result = invoke("run", "--resume", run_id, "--results", tmp_path, "--quiet")
    assert result.exit_code == 0, result.output
    assert set(load(tmp_path).run_id) == {run_id}
    pd.testing.assert_frame_equal(figures(tmp_path), figures(reference), rtol=1e-5)


def test_sigkill_after_epoch_2_then_resume_gives_the_same_figures(reference, tmp_path):
    cmd = [sys.executable, "-m", "gtx.cli", "run", "--epochs", "4", "--seed", "3", "--results", str(tmp_path), *TINY]
    proc = subprocess.Popen(
        cmd,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    runs = tmp_path / "runs"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        files = list(runs.glob("*.csv"))
        if files and len(pd.read_csv(files[0])) >= 4:  # epochs 1 and 2 written
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    df = load(tmp_path)
    assert "test" not in set(df.split), "the run finished before it could be killed"
    run_id = df.run_id.iloc[0]
    result = invoke("run", "--resume", run_id, "--results", tmp_path, "--quiet")
    assert result.exit_code == 0, result.output
    after = figures(tmp_path)
    assert len(after) == 9 and not after.duplicated(["epoch", "split"]).any()
    pd.testing.assert_frame_equal(after, figures(reference), rtol=1e-5)


def test_eval_under_its_own_and_another_pattern_appends_eval_rows(reference, tmp_path):
    run_id = load(reference).run_id.iloc[0]
    results = tmp_path / "evals"
    own = invoke("eval", run_id, "--results", reference)
    assert own.exit_code == 0, own.output
    df = load(reference)
    ev = df[df.eval_of.notna()]
    assert len(ev) == 1 and ev.eval_of.iloc[0] == run_id and ev.split.iloc[0] == "test"
    trained_test = df[(df.run_id == run_id) & (df.split == "test")]
    assert np.isclose(ev.token_acc.iloc[0], trained_test.token_acc.iloc[0])  # same weights, same data: same figures
    path = checkpoint.checkpoint_dir(reference, run_id) / checkpoint.BEST
    assert set(df.definitions) == {"{}"}  # full declares no definition version: the run and its evaluation record none
    other = invoke("eval", path, "--pattern", "local:w=1", "--split", "valid", "--results", results)
    assert other.exit_code == 0, other.output
    assert "evaluated under local:w=1 on valid" in other.output
    row = load(results).iloc[0]
    assert (
        row.pattern == "local:w=1"
        and json.loads(row.config)["trained_pattern"] == "full"
        and row.edges_per_query_ee < 3
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: None, "does not exist"),
        (lambda d: (d / "x.pt").write_bytes(b"not a checkpoint"), "truncated or not a gtx checkpoint"),
        (lambda d: torch.save({"weights": torch.zeros(2)}, d / "x.pt"), "not a gtx checkpoint"),
        (lambda d: (d / "x.pt").write_text("hi"), "truncated or not a gtx checkpoint"),  # a KeyError in the unpickler
        (lambda d: checkpoint.save(d / "x.pt", {"epoch": 1}), "lacks run_config, common, rows"),
    ],
)
def test_eval_of_a_bad_checkpoint_is_one_line(tmp_path, make, message):
    make(tmp_path)
    result = invoke("eval", tmp_path / "x.pt", "--results", tmp_path)
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1


def test_eval_of_a_truncated_checkpoint_and_of_another_vocabulary(reference, tmp_path):
    run_id = load(reference).run_id.iloc[0]
    good = (checkpoint.checkpoint_dir(reference, run_id) / checkpoint.LAST).read_bytes()
    (tmp_path / "cut.pt").write_bytes(good[: len(good) // 2])
    result = invoke("eval", tmp_path / "cut.pt", "--results", tmp_path)
    assert result.exit_code == 2 and "truncated" in result.output
    state = checkpoint.load(checkpoint.checkpoint_dir(reference, run_id) / checkpoint.LAST)
    state["vocab"]["src"] = state["vocab"]["src"] + ["extra"]
    checkpoint.save(tmp_path / "vocab.pt", state)
    result = invoke("eval", tmp_path / "vocab.pt", "--results", tmp_path)
    assert result.exit_code == 2 and "src vocabulary of" in result.output
    assert not (tmp_path / "runs").exists()


def test_a_run_killed_while_it_marks_itself_finished_has_its_test_rows_written(tmp_path, monkeypatch):
    """The last write of a run is its checkpoint marked finished: a kill there leaves the results
    complete (a sweep skips the cell) rather than a checkpoint that refuses --resume beside results
    without test rows (a sweep's resume then failed)."""
    real = checkpoint.save

    def killed_when_finishing(path, state):
        if any(row["split"] == "test" for row in checkpoint.rows_of(state)):
            raise KeyboardInterrupt
        real(path, state)

    monkeypatch.setattr(checkpoint, "save", killed_when_finishing)
    result = invoke("run", "--epochs", 2, "--seed", 3, "--results", tmp_path, *TINY)
    assert result.exit_code == 130
    assert (load(tmp_path).split == "test").sum() == 1


def test_resume_of_unknown_or_finished_runs_is_one_line(reference):
    run_id = load(reference).run_id.iloc[0]
    before = sorted(p.read_bytes() for p in reference.rglob("*.csv"))
    unknown = invoke("run", "--resume", "nope", "--results", reference)
    assert unknown.exit_code == 2 and "--resume: no run 'nope'" in unknown.output and run_id in unknown.output
    finished = invoke("run", "--resume", run_id, "--results", reference)
    assert finished.exit_code == 2 and "that run is finished" in finished.output
    empty = invoke("run", "--resume", "", "--results", reference)
    assert empty.exit_code == 2 and "--resume needs a run id" in empty.output
    settings = invoke("run", "--resume", run_id, "--results", reference, "--set", "dim=8", "--epochs", "2")
    assert (
        settings.exit_code == 2 and "continues the run with its own settings; drop --epochs, --set" in settings.output
    )
    assert sorted(p.read_bytes() for p in reference.rglob("*.csv")) == before


def test_a_checkpoint_copied_into_another_runs_folder_is_refused(reference, tmp_path):
    source = checkpoint.checkpoint_dir(reference, load(reference).run_id.iloc[0]) / checkpoint.LAST
    state = checkpoint.load(source)
    # unfinished, so resumable
    state["rows"] = json.dumps([r for r in checkpoint.rows_of(state) if r["split"] != "test"])
    checkpoint.save(checkpoint.checkpoint_dir(tmp_path, "other-run") / checkpoint.LAST, state)
    result = invoke("run", "--resume", "other-run", "--results", tmp_path)
    claimed = json.loads(state["common"])["run_id"]
    assert result.exit_code == 2 and f"is a checkpoint of run {claimed}, not of other-run" in result.output
    # gtx eval would file its rows as an evaluation of the run the checkpoint claims, not of the one asked for
    result = invoke("eval", "other-run", "--results", tmp_path)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"is a checkpoint of run {claimed}, not of other-run whose folder holds it" in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("blocked", ["runs", "checkpoints"])
def test_an_unwritable_output_place_fails_before_training(tmp_path, blocked):
    (tmp_path / blocked).write_text("a file where a folder goes")
    result = invoke("run", "--results", tmp_path, *TINY)
    assert result.exit_code == 2 and "cannot create the folder" in result.output and "Traceback" not in result.output
    assert "epoch 1" not in result.output and (tmp_path / blocked).read_text() == "a file where a folder goes"


def test_a_nan_loss_stops_with_the_epoch_and_step_and_keeps_earlier_epochs(tmp_path, monkeypatch):
    from gtx.run import train

    real = torch.nn.functional.cross_entropy
    calls = {"n": 0}

    def nan_from_step_10(*a, **kw):
        out = real(*a, **kw)
        if kw.get("reduction") == "sum":  # the training loss
            calls["n"] += 1
            if calls["n"] >= 10:
                return out * float("nan")
        return out

    monkeypatch.setattr(train.F, "cross_entropy", nan_from_step_10)
    stops_keeping_epoch_1(
        tmp_path, "stopped in epoch 2: training loss is nan at step 10"
    )  # 8 steps an epoch: step 10 is in epoch 2


def test_a_nan_loss_before_any_update_points_at_the_attention_not_the_learning_rate(tmp_path, monkeypatch):
    """A first step's NaN (a plugin backend's NaN output, say) comes from the initial weights' forward:
    no learning rate makes it finite."""
    from gtx.run import train

    real = torch.nn.functional.cross_entropy
    monkeypatch.setattr(train.F, "cross_entropy", lambda *a, **kw: real(*a, **kw) * float("nan"))
    result = invoke("run", "--results", tmp_path, *TINY)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.strip().endswith(
        "stopped in epoch 1: training loss is nan at step 1; nothing new was written; no update has run yet, so the "
        "learning rate is not the cause: check the attention (try --backend dense)"
    )


def test_a_nan_valid_loss_stops_before_its_weights_replace_the_last_good_checkpoint(tmp_path, monkeypatch):
    """The last steps of an epoch can leave the weights non-finite with a finite training loss: the
    valid loss then reads NaN, and neither that epoch's rows nor its weights are written."""
    from gtx.run import runner

    real = runner.result_row

    def nan_valid_in_epoch_2(common, epoch, split, *a, **kw):
        row = real(common, epoch, split, *a, **kw)
        return {**row, "loss": float("nan")} if (epoch, split) == (2, "valid") else row

    monkeypatch.setattr(runner, "result_row", nan_valid_in_epoch_2)
    stops_keeping_epoch_1(tmp_path, "stopped in epoch 2: valid loss is nan after step 16")


def stops_keeping_epoch_1(tmp_path, message):
    """A 3-epoch run stops with one line holding ``message``; epoch 1's rows and checkpoint stay."""
    result = invoke("run", "--epochs", 3, "--results", tmp_path, *TINY)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert message in result.output and "epochs up to 1 and their checkpoint are kept" in result.output
    df = load(tmp_path)
    assert sorted(df.epoch) == [1, 1]
    assert checkpoint.load(checkpoint.checkpoint_dir(tmp_path, df.run_id.iloc[0]) / checkpoint.LAST)["epoch"] == 1


def test_eval_under_a_learned_bias_the_run_lacks_names_the_pattern_and_the_reverse_runs(reference, tmp_path):
    """A learned bias's table is the pattern's own parameter, as nsa's and dsa's are: a run trained
    without it is refused under it in one line naming both patterns (it read "parameter ... missing
    from the checkpoint"), and a run trained with it evaluates under a pattern without it."""
    run_id = load(reference).run_id.iloc[0]
    refused = invoke("eval", run_id, "--results", reference, "--pattern", "full+relbias")
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert (
        "attends with learned parameters that checkpoint" in refused.output
        and "(trained under 'full')" in refused.output
    )
    trained = invoke("run", "--pattern", "full+relbias", "--results", tmp_path, *TINY)
    assert trained.exit_code == 0, trained.output
    assert invoke("eval", load(tmp_path).run_id.iloc[0], "--results", tmp_path, "--pattern", "full").exit_code == 0


def test_every_command_that_takes_a_run_takes_its_short_id(reference, tmp_path):
    """gtx eval, gtx run --resume, gtx plot attention and gtx show all resolve the 6-hex tail `gtx runs` prints."""
    run_id = load(reference).run_id.iloc[0]
    tail = run_id.rsplit("-", 1)[1]
    evaluated = invoke("eval", tail, "--results", reference, "--split", "valid")
    assert evaluated.exit_code == 0, evaluated.output
    assert f"run {run_id} (trained with full)" in evaluated.output
    # resolved: then refused for being finished, not for its name
    resumed = invoke("run", "--resume", tail, "--results", reference)
    assert resumed.exit_code == 2 and f"--resume {run_id}: that run is finished" in resumed.output
    drawn = invoke("plot", "attention", tail, "--results", reference, "-o", tmp_path / "a.png")
    assert drawn.exit_code == 0 and (tmp_path / "a.png").is_file(), drawn.output
    assert invoke("show", tail, "--results", reference).output.startswith(f"run         {run_id}")
    ambiguous = invoke("eval", run_id[:4], "--results", reference)  # the eval above is another run of the same year
    assert (
        ambiguous.exit_code == 2
        and ambiguous.output.count("\n") == 1
        and "is ambiguous: it matches" in ambiguous.output
    )
    assert run_id in ambiguous.output  # the candidates are listed


def no_space_for(name: str, nth: int):
    """A ``replace_durably`` whose ``nth`` write of a file called ``name`` (or ending in it) finds the device full."""
    import errno

    from gtx import files

    real, seen = files.replace_durably, {"n": 0}

    def replace(tmp, path):
        if path.name.endswith(name):
            seen["n"] += 1
            if seen["n"] == nth:
                raise OSError(errno.ENOSPC, "No space left on device")
        real(tmp, path)

    return replace


def test_a_full_device_mid_run_is_one_line_and_resume_reproduces_the_run(reference, tmp_path, monkeypatch):
    """Epoch 2's checkpoint meets a full device: one line naming the folder and the epochs kept, every
    file whole, and --resume (once there is room) gives the uninterrupted run's figures."""
    from gtx import files

    kept = 1
    monkeypatch.setattr(files, "replace_durably", no_space_for(checkpoint.LAST, 2))
    result = invoke("run", "--epochs", 4, "--seed", 3, "--results", tmp_path, *TINY)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    run_id = load(tmp_path).run_id.iloc[0]
    assert f"run {run_id} stopped in epoch 2: no space left on the device of {tmp_path}" in result.output
    assert f"epochs up to {kept} are kept in its checkpoint" in result.output
    assert f"continue with: gtx run --resume {run_id} --results {tmp_path}" in result.output
    assert checkpoint.load(checkpoint.checkpoint_dir(tmp_path, run_id) / checkpoint.LAST)["epoch"] == kept
    assert not list(tmp_path.rglob(".*.tmp"))
    monkeypatch.undo()
    result = invoke("run", "--resume", run_id, "--results", tmp_path, "--quiet")
    assert result.exit_code == 0, result.output
    trained = load(reference).query("eval_of.isna()").run_id.iloc[0]  # other tests add eval runs beside it
    pd.testing.assert_frame_equal(figures(tmp_path), figures(reference, trained), rtol=1e-5)


def test_a_full_device_before_anything_is_kept_says_so(tmp_path, monkeypatch):
    from gtx import files

    monkeypatch.setattr(files, "replace_durably", no_space_for(".pt", 1))
    result = invoke("run", "--results", tmp_path, *TINY)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "stopped in epoch 1: no space left" in result.output and "nothing of it is kept" in result.output


def test_a_results_folder_on_a_full_device_is_refused_before_training(tmp_path, monkeypatch):
    import shutil

    from gtx import files

    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 100))
    result = invoke("run", "--results", tmp_path, *TINY)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"--results {tmp_path}: 0.0 MiB free on its device" in result.output and "epoch 1" not in result.output
    assert not (tmp_path / "runs").exists()


def _without(key):
    def drop(state):
        del state[key]

    return drop


DAMAGED = {  # a checkpoint field damaged, or written by a later gtx: what the one line says of it
    "a run_config field a newer gtx adds": (
        lambda s: s["run_config"].update(future=1),
        "its run_config holds 'future', a field gtx",
    ),
    "a common field a newer gtx adds": (
        lambda s: s.update(common=json.dumps({**json.loads(s["common"]), "future": 1})),
        "its common holds 'future', a field gtx",
    ),
    "common not JSON": (lambda s: s.update(common="{not json"), "its common is not JSON"),
    "definitions not versions": (
        lambda s: s.update(common=json.dumps({**json.loads(s["common"]), "definitions": '{"dsa": "two"}'})),
        "its common holds definitions that are not JSON of methods' versions",
    ),
    "rows not JSON": (lambda s: s.update(rows="[{"), "its rows is not JSON"),
    "epoch as text": (lambda s: s.update(epoch="2"), "its epoch is '2', not a count"),
    "a None config": (lambda s: s.update(run_config=None), "its run_config is a NoneType, not a mapping"),
    "no vocab": (_without("vocab"), "lacks vocab"),
    "no rng": (_without("rng"), "lacks rng"),
}


@pytest.mark.parametrize("command", ["eval", "resume"])
@pytest.mark.parametrize("damage", DAMAGED)
def test_a_checkpoint_with_a_damaged_or_newer_field_is_one_line_naming_it(reference, tmp_path, damage, command):
    """gtx eval and gtx run --resume read a checkpoint's fields: each damaged one (or one a newer gtx
    wrote, named as such) is one line naming the checkpoint and the field, before anything is written."""
    state = checkpoint.load(checkpoint.checkpoint_dir(reference, load(reference).run_id.iloc[0]) / checkpoint.LAST)
    state["rows"] = json.dumps([r for r in checkpoint.rows_of(state) if r["split"] != "test"])  # resumable
    run_id = json.loads(state["common"])["run_id"]
    change, message = DAMAGED[damage]
    change(state)
    path = checkpoint.checkpoint_dir(tmp_path, run_id) / checkpoint.LAST
    checkpoint.save(path, state)
    if command == "eval":
        result = invoke("eval", path, "--results", tmp_path)
    else:
        result = invoke("run", "--resume", run_id, "--results", tmp_path)
    if (damage, command) == ("no rng", "eval"):  # evaluating needs no random state
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"checkpoint {path}" in result.output and message in result.output
    if "newer" in damage:
        assert "(written by a newer gtx); read it with the gtx that wrote it" in result.output
    assert not (tmp_path / "runs").exists()


def test_a_beam_wider_than_the_target_vocabulary_is_refused_before_decoding(reference, tmp_path):
    """--beam 100000 held 100,000 hypotheses per sample and ran out of memory (std::bad_alloc)."""
    run_id = load(reference).query("eval_of.isna()").run_id.iloc[0]
    best = checkpoint.checkpoint_dir(reference, run_id) / checkpoint.BEST
    vocab = len(checkpoint.load(best)["vocab"]["tgt"])
    result = invoke("eval", best, "--beam", 100_000, "--results", tmp_path)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert (
        f"--beam 100000: task 'copy' decodes from {vocab} target tokens; give a beam of at most {vocab}"
        in result.output
    )
    assert not (tmp_path / "runs").exists()


def test_eval_into_a_results_folder_it_cannot_write_is_refused_before_it_evaluates(reference, tmp_path, monkeypatch):
    from gtx.run import evaluation

    monkeypatch.setattr(evaluation, "evaluate", lambda *a, **k: pytest.fail("evaluated before checking --results"))
    (tmp_path / "runs").write_text("a file where a folder goes")
    best = checkpoint.checkpoint_dir(reference, load(reference).run_id.iloc[0]) / checkpoint.BEST
    result = invoke("eval", best, "--results", tmp_path)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "cannot create the folder" in result.output


def test_a_run_trained_by_another_process_is_refused_and_a_dead_ones_lock_is_taken_over(reference, tmp_path):
    """Two gtx run --resume of one run at once both trained it; the second is refused in one line. A
    lock left by a killed process (its pid gone) does not stop the next resume."""
    import socket

    from gtx.records import claims

    state = checkpoint.load(checkpoint.checkpoint_dir(reference, load(reference).run_id.iloc[0]) / checkpoint.LAST)
    state["rows"] = json.dumps([r for r in checkpoint.rows_of(state) if r["split"] != "test"])  # resumable
    run_id = json.loads(state["common"])["run_id"]
    folder = checkpoint.checkpoint_dir(tmp_path, run_id)
    checkpoint.save(folder / checkpoint.LAST, state)
    with subprocess.Popen(["sleep", "60"]) as other:
        (folder / claims.LOCK).write_text(f"{other.pid}@{socket.gethostname()}\n")
        result = invoke("run", "--resume", run_id, "--results", tmp_path, "--quiet")
        other.kill()
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"run {run_id} is being trained by process {other.pid}@" in result.output
    assert not (tmp_path / "runs").exists() and (folder / claims.LOCK).exists()
    result = invoke("run", "--resume", run_id, "--results", tmp_path, "--quiet")  # its process has ended
    assert result.exit_code == 0, result.output
    assert not (folder / claims.LOCK).exists() and (load(tmp_path).split == "test").sum() == 1
