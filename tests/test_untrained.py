"""A pattern's own parameters (NSA's gates and compression, DSA's indexer) on a pretrained folder
that will not train them: refused in one line, or run as initialised when asked for, and said so."""

import json

import pytest

pytest.importorskip("transformers")

from pretrained import save_tiny

from gtx.records.results import load

#: tiny_run's arguments beside path=: the folder's model scored, untrained, on a little text
TEXT = {"task": "text", "model": "hf", "context": 32, "train_tokens": 600, "eval_tokens": 300, "epochs": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("pretrained") / "llama")


@pytest.mark.parametrize("spec", ["nsa:l=8,d=4,s=8,w=8", "dsa:k=8,dense=0"])
def test_scoring_untrained_pattern_parameters_is_refused_unless_asked_for(folder, tmp_path, tiny_run, spec):
    refused = tiny_run(tmp_path, pattern=spec, path=folder, exit_code=2, **TEXT)
    said = refused.result.output
    assert "untrained_attention=true" in said and len(said.strip().splitlines()) == 1, said
    assert not refused.folder.exists()
    ok = tiny_run(tmp_path, pattern=spec, path=folder, untrained_attention=True, **TEXT)
    assert all(json.loads(c)["model_config"]["untrained_attention"] for c in ok.rows.config)


def test_generate_under_an_untrained_indexer_is_refused_or_says_its_stage(folder, cli):
    args = ["generate", "--set", f"path={folder}", "--pattern", "dsa:k=2", "--no-cache", "--prompt", "the quick"]
    bad = cli(*args, "--new", 4, commands=True)  # commands: as gtx's entry point registers them
    assert bad.exit_code == 2 and "lacks" in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output
    ok = cli(*args, "--new", 4, "--set", "untrained_attention=true")
    assert (
        ok.exit_code == 0
        and "(its own parameters untrained) (dense stage, indexer trained 0 steps, freeze=true (a trained start))"
        in ok.output
    ), ok.output


@pytest.mark.parametrize(
    "spec, said", [("dsa:k=8", "freeze=true (a trained start)"), ("dsa:k=8,freeze=false", "freeze=false (given)")]
)
def test_dsa_freezes_a_pretrained_model_in_its_dense_stage_unless_told_and_its_evaluation_says_so(
    folder, tmp_path, cli, tiny_run, spec, said
):
    """Training from a pretrained folder is DeepSeek's case (adapting a trained model): the model frozen in
    the dense stage by default; the evaluation's recorded stage names the freeze the training ran with."""
    import torch

    from gtx.data.batch import batches
    from gtx.run.runner import RunConfig, build_attention, build_model, resolve
    from gtx.run.train import Trainer

    settings = {"path": str(folder), "context": "32", "train_tokens": "600", "eval_tokens": "300", "max_steps": "1"}
    r = resolve(RunConfig(task="text", model="hf", pattern=spec, settings=settings, results_dir=str(tmp_path)))
    model = build_model(r, build_attention(r))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    Trainer(model, r.train, 16, r.device, r.task).train_epoch(batches(r.task, "train", r.pattern, 2))
    changed = {key for key, value in model.state_dict().items() if not torch.equal(before[key], value)}
    own = {key for key in changed if ".indexer." in key or key.endswith((".steps", ".sparse"))}
    assert own and (changed == own) is ("true" in said), sorted(changed - own)[:5]
    trained = tiny_run(tmp_path, pattern=spec, path=folder, **{**TEXT, "epochs": 1, "max_steps": 1})
    rows = trained.rows
    run_id = rows.run_id.iloc[0]
    # every training row records the state its phase left the method in, freeze resolved
    assert {json.loads(m)["attention_stage"] for m in rows.metrics} == {f"dense stage, indexer trained 1 steps, {said}"}
    evaluated = cli("eval", run_id, "--results", trained.folder)
    assert evaluated.exit_code == 0 and f"(dense stage, indexer trained 1 steps, {said})" in evaluated.output
    setup = json.loads(load(trained.folder).query("eval_of == @run_id").config.iloc[0])
    assert setup["attention_stage"] == f"dense stage, indexer trained 1 steps, {said}"
