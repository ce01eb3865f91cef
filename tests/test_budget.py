"""The budget account (gtx.attention.budget) against the attention's own weights.

Every attention call of a model's forward runs a second time with each key's value a one-hot of its
position in its sample: the output rows are then the attention weights over the keys, and the keys
a query read are its nonzero entries (NSA's compressed branch, whose values are mixtures of
tokens, is switched off by its gate and its compressed keys counted by their positions). Summed
over layers, ACT steps (active queries only) and heads, that count must equal what the model's
``Attention`` recorded, for every registered pattern and every kind of model.
"""

from __future__ import annotations

import json

import pytest
import torch

from gtx.attention.module import Attention
from gtx.data.batch import make_batch
from gtx.errors import GtxError
from gtx.graph.tokens import positions
from gtx.plugins.registry import PATTERNS, load_plugins
from gtx.run.build import build_attention, build_model
from gtx.run.runner import RunConfig, resolve

load_plugins()

#: per registered pattern, specs that choose something at a dozen tokens
SPECS = {
    "full": ["full"],
    "causal": ["causal"],
    "local": ["local:w=2", "local:w=3+alibi"],
    "strided": ["strided:l=3"],
    "dilated": ["dilated:w=2,d=2"],
    "fixed": ["fixed:l=4,c=1"],
    "longformer": ["longformer:w=2,g=1"],
    "bigbird": ["bigbird:b=2,r=1"],
    "bipartite": ["bipartite"],
    "act": ["act(local:w=2)"],
    "heads": ["heads(local:w=1,strided:l=3)", "heads(local:w=2,topk:k=3)"],
    "topk": ["topk:k=3", "topk(local:w=5):k=2"],
    "lsh": ["lsh:buckets=4"],
    "moba": ["moba:b=3,k=2", "moba:b=3,k=2,gate=block"],
    "sinks": ["sinks:s=1,w=3"],
    "vslash": ["vslash:v=2,sl=3,last=4,sink=1,local=1"],
    "blocktopk": ["blocktopk:b=2,k=3"],
    "quest": ["quest:p=2,k=2"],
    "nsa": ["nsa:l=4,d=2,s=4,n=4,w=3", "nsa:l=4,d=4,s=2,n=4,w=2,phi=mean"],
    "dsa": ["dsa:k=3,dense=0", "dsa:k=3", "dsa:k=6,b=3,dense=0"],
}
SMALL = {"dim": "32", "heads": "2", "dim_ff": "16"}  # head_dim 16: each sample's keys fit one-hot
FEW = {"n_train": "8", "n_valid": "2", "n_test": "2"}
RECALL = {"layers": "2", "seq_len": "14", "n_pairs": "2", "queries_per_key": "1", "train_min_len": "8", **FEW}
COPY = {"mean_len": "6", "std_len": "3", **FEW}
MODELS = {
    "lm": ("recall", RECALL),
    "lm universal": ("recall", {**RECALL, "universal": "true", "max_depth": "3"}),
    "encoder": (
        "listops",
        {"layers": "2", "form": "classify", "task.min_len": "4", "task.max_len": "14", "task.max_depth": "2", **FEW},
    ),
    "transformer": ("copy", {"layers": "1", **COPY}),
    "ut": ("copy", {"max_depth": "3", **COPY}),
}


def test_every_registered_pattern_has_specs_here():
    assert set(SPECS) == set(PATTERNS.entries())


def _oracle(forward, seen):
    """``Attention.forward`` that also counts, per stage, the keys each active query's weights put mass on."""

    def wrapped(self, q, k, v, edges, trainable=None, inputs=None):
        out = forward(self, q, k, v, edges, trainable, inputs)
        saved = {s: list(t) for s, t in self.account.stages.items()}
        root = edges.root
        q_lens, k_lens = (torch.as_tensor(x) for x in root.sample_lens())
        k_pos = positions(k_lens)
        assert int(k_lens.max()) <= v.shape[2], (
            "a sample longer than the head dimension: make the test's samples shorter"
        )
        one_hot = torch.zeros_like(v)
        one_hot[torch.arange(len(k_pos)), :, k_pos] = 1.0
        module = trainable if trainable is not None else self.trainable
        nsa = (
            edges.pattern is not None
            and edges.pattern.trainable is not None
            and hasattr(module, "phi_k")
            or hasattr(module, "compress")
        )
        gate = None
        if nsa and edges.stage in module.stages:  # the compressed branch off: its values mix tokens
            gate = (module.gate.weight.data.clone(), module.gate.bias.data.clone())
            module.gate.weight.data.view(q.shape[1], 3, -1)[:, 0] = 0
            module.gate.bias.data.view(q.shape[1], 3)[:, 0] = -1e4
        with torch.no_grad():
            weights = forward(self, q, k, one_hot, edges, trainable, inputs)
        if gate is not None:
            module.gate.weight.data, module.gate.bias.data = gate
        self.account.stages = saved
        active = torch.ones(edges.n_dst, dtype=torch.bool) if edges.keep is None else edges.keep
        q_pos = positions(q_lens)
        allowed = (q_pos + 1 if root.stage == "dd" else torch.repeat_interleave(k_lens, q_lens)).double()
        keys = (weights != 0).sum(-1).double().mean(1)
        if gate is not None:
            c = module.config
            compressed = ((q_pos - c.l + 1).div(c.d, rounding_mode="floor") + 1).clamp_min(0).double()
            keys, allowed = keys + compressed, allowed + compressed
        total = seen.setdefault(edges.stage, [0.0, 0.0, 0.0])
        for i, x in enumerate((keys[active].sum(), active.sum(), allowed[active].sum())):
            total[i] += float(x)
        return out

    return wrapped


@pytest.mark.parametrize("kind", list(MODELS))
def test_recorded_keys_are_the_keys_the_attention_weights_read(kind, monkeypatch):
    task, settings = MODELS[kind]
    model_name = kind.split()[0]
    seen: dict = {}
    monkeypatch.setattr(Attention, "forward", _oracle(Attention.forward, seen))
    checked = 0
    for specs in SPECS.values():
        for spec in specs:
            try:
                r = resolve(
                    RunConfig(
                        task=task, model=model_name, pattern=spec, backend="dense", settings={**SMALL, **settings}
                    )
                )
            except GtxError as e:  # a pattern this model refuses (nsa and dsa attend in dd alone; act without ACT)
                assert ("attends in dd only" in str(e) and model_name == "encoder") or (
                    "(ACT)" in str(e) and spec.startswith("act(") and kind in ("lm", "encoder", "transformer")
                ), (spec, str(e))
                continue
            torch.manual_seed(0)
            attention = build_attention(r)
            model = build_model(r, attention).eval()
            batch = make_batch(r.task, "train", [0, 1, 2], r.pattern)
            seen.clear()
            with torch.no_grad():
                model(batch)
            recorded = attention.take_reads()
            assert set(recorded) == set(seen), spec
            for stage, (keys, queries, allowed) in recorded.items():
                want = seen[stage]
                assert (queries, allowed) == pytest.approx(want[1:]), (spec, stage)
                assert keys == pytest.approx(want[0], rel=1e-9), (spec, stage, keys / queries, want[0] / want[1])
                assert keys <= allowed
            checked += 1
    assert checked >= 12


#: a tiny lm on recall, trained in two steps of 12 sequences (tiny_run's arguments)
RECALL = {
    "task": "recall",
    "model": "lm",
    "seq_len": 32,
    "n_pairs": 2,
    "n_train": 24,
    "n_valid": 4,
    "n_test": 4,
    "batch_size": 12,
}


@pytest.mark.parametrize("universal", [False, True])
def test_topk_rows_record_at_most_k_keys_per_query_in_plain_and_universal_models(tmp_path, tiny_run, universal):
    rows = tiny_run(tmp_path, pattern="topk:k=4", universal=universal, **RECALL).rows
    assert (rows.edges_per_query_dd <= 4).all() and (rows.edges_per_query_dd > 3).all() and (rows.density <= 1).all()


def test_dsa_runs_say_their_stage_and_are_no_full_attention_evaluated_in_the_stage_they_trained_to(
    tmp_path, cli, tiny_run
):
    from gtx.records.results import load

    sparse = tiny_run(tmp_path, pattern="dsa:k=8,dense=0", quiet=False, **RECALL)
    assert "full attention" not in sparse.result.output and "note:" not in sparse.result.output, sparse.result.output
    run_id = sparse.rows.run_id.iloc[0]
    # the spec's dense stage is 100 steps
    again = cli("eval", run_id, "--pattern", "dsa:k=8", "--results", sparse.folder)
    assert (
        again.exit_code == 0 and "(sparse stage, indexer trained 2 steps, freeze=false (from scratch))" in again.output
    ), again.output
    evaluated = load(sparse.folder).query("eval_of == @run_id")
    assert (evaluated.edges_per_query_dd <= 8).all() and evaluated.pattern.str.contains("dense=100").all()
    dense = tiny_run(tmp_path / "warm", pattern="dsa:k=8", quiet=False, **RECALL).result
    assert (
        "full attention" not in dense.output
        and "it ran in its dense stage, indexer trained 2 steps, freeze=false (from scratch)" in dense.output
    ), dense.output


def test_nsa_counts_a_key_both_branches_read_once(tmp_path, tiny_run):
    rows = tiny_run(tmp_path, pattern="nsa:l=8,d=4,s=8,n=4,w=8", **RECALL).rows
    assert (rows.density <= 1).all() and (rows.density > 0.5).all()
    kept = [json.loads(m) for m in rows.metrics]
    assert all(
        row.edges_per_query_dd < m["kept_compressed"] + m["kept_selected"] + m["kept_window"]
        for row, m in zip(rows.itertuples(), kept)
    )


def test_the_note_judges_head_groups_and_chosen_keys_by_what_they_read(tmp_path, tiny_run):
    full = tiny_run(tmp_path, pattern="heads(causal,full)", quiet=False, **RECALL).result
    assert "read (nearly) every key its queries could see in epoch 1's train phase (density dd 1.000)" in full.output, (
        full.output
    )
    half = tiny_run(tmp_path, pattern="heads(local:w=1,full)", quiet=False, **RECALL).result
    assert "note:" not in half.output, half.output


@pytest.mark.parametrize(
    "spec",
    [
        "moba:b=8,k=2",
        "moba:b=8,k=2,gate=block",
        "dsa:k=8,dense=0",
        "topk:k=8",
        "lsh:buckets=8",
        "nsa:l=16,d=8,s=16,w=16",
    ],
)
def test_bench_attention_times_the_method_and_counts_its_keys_as_runs_do(spec):
    from gtx.measure.bench import AttentionCell, run_attention_cell

    row = run_attention_cell(AttentionCell(spec, 256, "auto", repeats=1, warmup=0))
    assert "flash-complete" not in row["choice"] and row["choice"].startswith(
        "dd: " if spec[:3] in ("mob", "dsa", "nsa") else "ee: "
    )
    assert row["density"] < 0.5 and abs(row["edges"] - row["keys_per_query"] * 256) <= 0.5
    if not spec.startswith(("lsh", "nsa")):
        assert row["keys_per_query"] <= 20


@pytest.mark.parametrize("stage", ["ee", "dd", "ed"])
@pytest.mark.parametrize("q_lens,k_lens", [((4, 1, 3), (4, 1, 3)), ((2, 5), (6, 5)), (None, None)])
def test_a_full_sets_allowed_keys_total_is_the_per_query_counts_summed(stage, q_lens, k_lens):
    """The account's total from the lengths alone equals the per-query counts' sum (samples known or not)."""
    from gtx.attention.budget import allowed_keys, allowed_total
    from gtx.graph.tokens import EdgeSet

    n_dst, n_src = (sum(q_lens), sum(k_lens)) if q_lens else (5, 7)
    edges = EdgeSet(
        torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), n_src, n_dst, stage, q_lens, k_lens
    )
    assert allowed_total(edges) == float(allowed_keys(edges).sum())


@pytest.mark.parametrize("spec, stage", [("dsa:k=8", "dense stage"), ("dsa:k=8,dense=0", "sparse stage")])
def test_bench_attention_names_the_stage_a_method_with_stages_is_timed_in(spec, stage):
    """dsa's default dense=100 times its dense stage (density 1.0) under the spec's label: the row says so."""
    from gtx.measure.bench import AttentionCell, run_attention_cell

    row = run_attention_cell(AttentionCell(spec, 64, "auto", repeats=1, warmup=0))
    assert f"({stage}, indexer trained 0 steps" in row["choice"], row["choice"]
    assert (row["density"] == 1.0) == (stage == "dense stage")
