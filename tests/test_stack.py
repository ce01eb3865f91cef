"""The one-stage models: lm (decoder only) and encoder (classifier), plain and universal; task forms
and the runner's checks for them."""

import pytest
import torch

from gtx.backends import get_backend
from gtx.data.batch import IGNORE, make_batch
from gtx.data.task import Task
from gtx.data.vocab import Vocab
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import MODELS

TINY = dict(layers=2, heads=2, dim=16, dim_ff=16, max_depth=3)
LM_TASK = '''
from dataclasses import dataclass
from gtx import hookimpl
from gtx.data.task import Task

@dataclass
class Config:
    length: int = 12

class Counting(Task):
    """Count up modulo 5; every other prediction scored, in two groups."""
    form = "lm"
    train_defaults = {"batch_size": 4, "warmup": 7}

    def generate(self):
        n = self.config.length
        def ex(start):
            return [str((start + i) % 5) for i in range(n)], ["" if i % 2 else ("even" if i % 4 == 0 else "odd") for i in range(n - 1)]
        return {"train": [ex(s) for s in range(5)] * 4, "valid": [ex(1)], "test": [ex(2)]}

@hookimpl
def register_tasks(register):
    register("counting", Counting, config=Config)
'''


class Letters(Task):
    form = "lm"
    cache = False

    def generate(self):
        seqs = [[chr(97 + (i * j) % 7) for j in range(10 + i)] for i in range(6)]
        return {split: [(s, []) for s in seqs] for split in ("train", "valid", "test")}


def lm(universal=False, seed=0, **kw):
    task = Letters("letters", None)
    task.splits()
    entry = MODELS.get("lm")
    torch.manual_seed(seed)
    config = entry.config(**{**TINY, "universal": universal, **kw})
    model = entry.obj(config, task.src_vocab, task.tgt_vocab, get_backend("auto"))
    pattern = parse_pattern(f"act({'full'})") if universal else parse_pattern("full")
    return task, model.eval(), pattern


@pytest.mark.parametrize("universal", [False, True])
def test_lm_reads_no_future_token(universal):
    task, model, pattern = lm(universal, act=False) if universal else lm()
    batch = make_batch(task, "train", [0, 3], pattern)
    logits = model(batch).logits
    assert logits.shape == (batch.targets.numel(), len(task.src_vocab))
    changed = batch.tgt_in.clone()
    changed[6] = (changed[6] + 1) % len(task.src_vocab)  # sample 0 has 9 inputs: change its 7th
    other = model(type(batch)(**{**batch.__dict__, "tgt_in": changed})).logits
    torch.testing.assert_close(other[:6], logits[:6])
    assert not torch.allclose(other[6:9], logits[6:9])
    torch.testing.assert_close(other[9:], logits[9:])  # the other sample is untouched


def test_lm_batch_shifts_tokens_and_ignores_unscored():
    task, _, pattern = lm()
    batch = make_batch(task, "train", [1], pattern)
    ids = task.src_vocab.encode(task.splits()["train"][1][0])
    assert batch.tgt_in.tolist() == ids[:-1] and batch.targets.tolist() == ids[1:]
    assert batch.src is None and set(batch.graph.edges) == {"dd"} and batch.group_ids is None


@pytest.mark.parametrize("universal", [False, True])
def test_lm_trains(universal):
    from gtx.run.train import TrainConfig, Trainer

    task, model, pattern = lm(universal)
    trainer = Trainer(model, TrainConfig(lr_factor=2.0, warmup=10), 16, torch.device("cpu"), task)
    data = [make_batch(task, "train", list(range(6)), pattern)]
    first = trainer.train_epoch(data).row()["loss"]
    for _ in range(40):
        last = trainer.train_epoch(data)
    assert last.row()["loss"] < 0.7 * first
    assert last.row()["context_len"] == 14 and last.row()["density"] == 1.0
    assert universal == (last.row()["act_mean_steps"] == last.row()["act_mean_steps"])  # NaN without ACT


def test_encoder_pools_each_sample_alone():
    from gtx.plugins.registry import TASKS

    entry = TASKS.get("listops")
    task = entry.obj("listops", entry.config(n_train=16, n_valid=4, n_test=4, form="classify"))
    task.splits()
    model_entry = MODELS.get("encoder")
    torch.manual_seed(0)
    model = model_entry.obj(model_entry.config(**TINY), task.src_vocab, task.tgt_vocab, get_backend("auto")).eval()
    pattern = parse_pattern("local:w=2")
    both = model(make_batch(task, "train", [0, 1], pattern)).logits
    alone = model(make_batch(task, "train", [1], pattern)).logits
    assert both.shape == (2, len(task.tgt_vocab)) and make_batch(task, "train", [0], pattern).targets.shape == (1,)
    torch.testing.assert_close(both[1:], alone, atol=1e-5, rtol=1e-5)


def test_groups_are_scored_and_counted(plugin_dir, tmp_path, tiny_run):
    folder = plugin_dir(counting=LM_TASK)
    tiny_run(tmp_path, "--plugins-dir", folder, task="counting", model="lm")
    from gtx.plugins.registry import TASKS

    task = TASKS.get("counting").obj("counting", TASKS.get("counting").config())
    batch = make_batch(task, "train", [0, 1], parse_pattern("causal"))
    scored = batch.targets != IGNORE
    assert int(scored.sum()) == 12 and batch.group_names == ["even", "odd"]
    assert (batch.group_ids[~scored] == -1).all() and set(batch.group_ids[scored].tolist()) == {0, 1}


def test_form_mismatch_lists_the_models_that_fit(tmp_path, tiny_run):
    bad = tiny_run(tmp_path, task="copy", model="lm", exit_code=2)
    assert (
        "model 'lm' does not serve seq2seq tasks such as 'copy'; models that do: transformer, ut" in bad.result.output
    )
    bad = tiny_run(tmp_path, task="listops", model="encoder", exit_code=2)
    assert "models that do: transformer, ut" in bad.result.output
    assert not bad.folder.exists()


def test_context_beyond_the_positions_is_one_line(plugin_dir, tmp_path, tiny_run):
    folder = plugin_dir(counting=LM_TASK)
    bad = tiny_run(tmp_path, "--plugins-dir", folder, task="counting", model="lm", max_len=8, exit_code=2)
    assert (
        "task 'counting' has sequences of 11 tokens but model 'lm' has positions for 8; raise --set max_len=11"
        in bad.result.output
    )
    assert not bad.folder.exists()


def test_a_pattern_leaking_under_lm_is_one_line_and_writes_nothing(plugin_dir, tmp_path, tiny_run):
    leaky = '''
from gtx import hookimpl
from gtx.graph.pattern import Pattern, everything

@hookimpl
def register_patterns(register):
    def leaky():
        """Every key, future ones too."""
        return Pattern(ee=everything, dd=everything, ed=everything)
    register("leaky", leaky)
'''
    folder = plugin_dir(counting=LM_TASK, leaky=leaky)
    bad = tiny_run(tmp_path, "--plugins-dir", folder, task="counting", model="lm", pattern="leaky", exit_code=2)
    output = bad.result.output
    assert "stage dd" in output and "lets position 0 see later position 1" in output
    assert len(output.strip().splitlines()) == 1 and not bad.folder.exists()


def test_a_pattern_that_is_full_attention_here_is_called_out(tmp_path, tiny_run):
    run = tiny_run(tmp_path, pattern="bigbird", max_steps=1, quiet=False)
    assert "note: pattern bigbird" in run.result.output and "is (nearly) full attention" in run.result.output
    assert (run.rows.density > 0.99).all()


def test_vocab_of_an_lm_task_is_shared():
    task = Letters("letters", None)
    task.splits()
    assert task.src_vocab is task.tgt_vocab and isinstance(task.src_vocab, Vocab)


def test_task_train_defaults_apply_under_the_users_settings(plugin_dir, tmp_path, tiny_run):
    import json

    folder = plugin_dir(counting=LM_TASK)
    for extra, batch_size in (([], 4), (["--batch-size", "3"], 3), (["--set", "train.batch_size=2"], 2)):
        args = [tmp_path / str(batch_size), "--plugins-dir", folder, *extra]
        run = tiny_run(*args, task="counting", model="lm", max_steps=1, batch_size=None)  # no batch size of the kit's
        train = json.loads(run.rows.config.iloc[0])["train"]
        assert train["batch_size"] == batch_size and train["warmup"] == 7
