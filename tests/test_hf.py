"""--model hf: transformers' own causal LMs (llama, qwen2, gpt2) with every attention layer run by gtx.

Checked against the same weights under transformers' own attention: ``full`` (on ``dd``: causal)
gives SDPA's logits, ``local:w`` gives an eager attention with the window's boolean mask, per
sample of a packed batch; gradients reach every weight; content-chosen and trainable patterns run.
"""

import copy
import math
import sys

import pytest
import torch

pytest.importorskip("transformers")  # the test extra installs it; CI always runs these

from kit import sets

from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.data.batch import make_batch
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import MODELS, TASKS

SIZES = {"llama": {"kv_heads": 2}, "qwen2": {"kv_heads": 1}, "gpt2": {}}


def recall_task(seq_len=48):
    entry = TASKS.get("recall")
    task = entry.obj(
        "recall",
        entry.config(
            seq_len=seq_len,
            n_pairs=2,
            queries_per_key=2,
            n_keys=4,
            n_values=4,
            n_train=8,
            n_valid=4,
            n_test=4,
            train_min_len=0,
        ),
    )
    task.splits()
    return task


def hf_model(family, spec, task, seed=0):
    entry = MODELS.get("hf")
    pattern = parse_pattern(spec)
    config = entry.config(family=family, layers=2, heads=4, dim=32, dim_ff=64, max_len=64, **SIZES[family])
    torch.manual_seed(seed)
    model = entry.obj(config, task.src_vocab, task.tgt_vocab, Attention(get_backend("auto"), pattern, 4, 8))
    return model.eval(), pattern


def same_weights(model, implementation):
    """transformers' own model with ``model``'s weights, under one of its attention implementations."""
    import transformers

    # the implementation is the config's: a shared config would switch model.hf too
    config = copy.deepcopy(model.hf.config)
    other = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    other.load_state_dict(model.hf.state_dict())
    return other.eval()


def per_sample(batch):
    """(start, end) of each sample's nodes in the packed batch."""
    starts = (batch.tgt_pos == 0).nonzero().flatten().tolist()
    return list(zip(starts, [*starts[1:], len(batch.tgt_pos)]))


@pytest.mark.parametrize("family", list(SIZES))
def test_full_is_transformers_own_sdpa(family):
    task = recall_task()
    model, pattern = hf_model(family, "full", task)
    batch = make_batch(task, "valid", [0, 1, 2], pattern)  # three samples packed in one row
    own = same_weights(model, "sdpa")
    assert model.hf.config._attn_implementation == "gtx" and own.config._attn_implementation == "sdpa"
    with torch.no_grad():
        logits = model(batch).logits
        for a, b in per_sample(batch):
            expected = own(input_ids=batch.tgt_in[None, a:b], use_cache=False).logits[0]
            torch.testing.assert_close(logits[a:b], expected, atol=1e-4, rtol=0)


def test_grouped_query_heads_reach_sdpa_as_they_are(monkeypatch):
    """Under full, a grouped-query model's keys and values reach SDPA with their own heads
    (``enable_gqa``), as transformers' sdpa hands them: no copy of them repeated per query head."""
    task = recall_task()
    model, pattern = hf_model("llama", "full", task)
    batch = make_batch(task, "valid", [0], pattern)
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(batch)
    assert seen == [(4, 2, True)] * 2  # a call per layer, 4 query heads over 2 key/value heads


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_local_window_is_eager_attention_with_its_mask(family):
    import transformers

    w, task = 5, recall_task()
    model, pattern = hf_model(family, f"local:w={w}", task)

    def window(q, k):
        return (k <= q) & (q - k <= w)  # the query itself and the w keys before it

    def windowed(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """Eager attention, written out: scores, the window as a boolean mask, softmax, values."""
        n, groups = query.shape[2], query.shape[1] // key.shape[1]
        key, value = (x.repeat_interleave(groups, 1) for x in (key, value))
        scores = query @ key.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        scores = scores.masked_fill(~window(q, k), -math.inf)
        return (scores.softmax(-1) @ value).transpose(1, 2), None

    transformers.AttentionInterface.register("test_window", windowed)
    # gtx's local:w is this mask
    assert torch.equal(pattern.dense("dd", 9, 9), window(torch.arange(9)[:, None], torch.arange(9)[None, :]))
    reference = same_weights(model, "test_window")
    batch = make_batch(task, "valid", [0, 3], pattern)
    with torch.no_grad():
        logits = model(batch).logits
        for a, b in per_sample(batch):
            torch.testing.assert_close(
                logits[a:b], reference(input_ids=batch.tgt_in[None, a:b], use_cache=False).logits[0], atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("spec", ["local:w=8", "moba:b=8,k=2", "nsa:l=8,d=4,s=8,n=4,w=8"])
def test_gradients_reach_every_weight(spec):
    task = recall_task()
    model, pattern = hf_model("llama", spec, task)
    batch = make_batch(task, "train", [0, 1], pattern)
    out = model.train()(batch)
    torch.nn.functional.cross_entropy(out.logits, batch.targets, ignore_index=-100).backward()
    missing = [
        name for name, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum())
    ]
    assert not missing, missing


def test_run_trains_and_writes_rows(tmp_path, tiny_run):
    rows = tiny_run(
        tmp_path,
        task="recall",
        model="hf",
        pattern="local:w=8",
        **dict(family="qwen2", heads=4, kv_heads=2, dim=32),  # grouped-query attention: 2 query heads a key head
        **dict(seq_len=32, n_pairs=2, queries_per_key=1, n_train=16, n_valid=4, n_test=4),
    ).rows
    assert set(rows.split) == {"train", "valid", "test"}
    assert (rows.attn_flops > 0).all() and (rows.flops > rows.attn_flops).all()


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"family": "bert"}, "family='bert': choose llama, qwen2, gpt2"),
        ({"family": "gpt2", "kv_heads": 2}, "gpt2 has no grouped-query attention"),
        ({"heads": 4, "kv_heads": 3}, "heads of kv_heads"),
        ({"max_len": 16}, "has positions for 16"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, cli, settings, match):
    task = sets({"seq_len": 32, "n_pairs": 2, "queries_per_key": 1})
    result = cli(
        "run", "--task", "recall", "--model", "hf", *sets(settings), *task, "--epochs", 1, "--results", tmp_path
    )
    assert result.exit_code == 2 and match in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "runs").exists()


def test_without_transformers_one_line_says_how_to_install(monkeypatch):
    module = sys.modules[MODELS.get("hf").obj.__module__]
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(GtxError, match=r"install it: pip install -e '.\[hf\]'"):
        module.transformers()


def test_bench_prefill_of_a_folder_with_fewer_tokens_than_its_random_ids(tmp_path, cli):
    """prefill's ids are drawn below the model's vocabulary: a folder of 100 tokens once raised
    IndexError from the embedding."""
    import tokenizers
    import transformers

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=100, max_position_embeddings=64, hidden_size=32, intermediate_size=64
    )
    config.update(dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(tmp_path / "m")
    sizes = ("--lengths", 32, "--repeats", 1)
    result = cli("bench", "prefill", "--set", f"path={tmp_path / 'm'}", *sizes, "--results", tmp_path)
    assert result.exit_code == 0, result.output


def test_bench_prefill_times_a_pretrained_model_saying_each_load_and_timing(tmp_path, cli):
    """``--set path=`` of a GGUF file (as path=smollm2 names one): its rows named by the path, beside
    transformers' sdpa on the same weights, each load and timing said as it starts."""
    import pandas as pd
    from pretrained import save_tiny_gguf

    file = save_tiny_gguf(tmp_path / "tiny.gguf")
    args = ["bench", "prefill", "--set", f"path={file}", "--pattern", "full", "--pattern", "sinks:s=2,w=4"]
    result = cli(*args, "--lengths", 32, "--repeats", 1, "--results", tmp_path)
    assert result.exit_code == 0, result.output
    (path,) = (tmp_path / "bench").glob("prefill-*.csv")
    df = pd.read_csv(path)
    assert df.attention.tolist() == ["transformers sdpa", "no attention", "gtx", "gtx"]
    assert (df.family == str(file)).all() and df.pattern.tolist()[2:] == ["full", "sinks:s=2,w=4"]
    said = [line.split(maxsplit=2)[2] for line in result.output.splitlines() if line.startswith(str(file))]
    # the ceiling's model, then sinks's, loaded after full's; each row's timing said before its figure
    assert [s for s in said if s.startswith("loading")] == [
        "loading the model for full",
        "loading the model for local:w=0",
        "loading the model for sinks:s=2,w=4",
    ]
    assert sum("timing 1 pass after a warm-up" in s for s in said) == 4


def test_bench_prefill_rows(tmp_path, cli):
    patterns = ("--pattern", "full", "--pattern", "local:w=8")
    sizes = ("--family", "gpt2", "--lengths", 32, "--repeats", 1)
    table = ("--format", "csv", "--results", tmp_path)
    result = cli("bench", "prefill", *sizes, *patterns, "--backends", "auto,blocksparse", *table)
    assert result.exit_code == 0, result.output
    import pandas as pd

    (path,) = (tmp_path / "bench").glob("prefill-*.csv")
    df = pd.read_csv(path)
    assert df[["attention", "pattern"]].values.tolist() == [
        ["transformers sdpa", "causal"],
        ["no attention", "-"],
        ["gtx", "full"],
        ["gtx blocksparse", "full"],
        ["gtx", "local:w=8"],
        ["gtx blocksparse", "local:w=8"],
    ]
    assert df.vs_sdpa.iloc[0] == 1.0 and (df.ms > 0).all() and (df.tokens_per_s > 0).all()
    bad = cli("bench", "prefill", "--set", "heads=3", "--lengths", 32)
    # bench warns on a busy machine
    errors = [line for line in bad.output.splitlines() if not line.startswith("warning:")]
    assert bad.exit_code == 2 and len(errors) == 1 and "heads" in errors[0], bad.output
