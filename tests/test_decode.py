"""Prefill and decode apart: ``HFModel.generate(ids, new, pattern, decode=...)`` reads the prompt under
one pattern and each new token under another, with the key/value cache or without it.

The references are written out here: transformers' own greedy generation for (full, full), and for
other pairs greedy decoding by transformers' model whose attention is an eager softmax under a
boolean mask: a prompt query's row is the prompt pattern's, a new token's the decode pattern's.
"""

import copy
import math

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

from pretrained import save_tiny

from gtx import plugins
from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.data.vocab import Vocab
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import MODELS

PROMPT = 24
NEW = 10


@pytest.fixture(scope="module")
def tiny():
    """A random Llama of 2 layers over 30 tokens, its weights spread wide enough that greedy
    generation does not settle on one token; a prompt of 24 ids."""
    entry = MODELS.get("hf")
    vocab = Vocab(list("abcdefghijklmnopqrstuvwxyz"))
    config = entry.config(family="llama", layers=2, heads=4, kv_heads=2, dim=32, dim_ff=64, max_len=64)
    torch.manual_seed(0)
    model = entry.obj(config, vocab, vocab, Attention(get_backend("auto"), parse_pattern("full"), 4, 8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    ids = torch.randint(4, len(vocab), (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, ids


def own_model(model, implementation="sdpa"):
    import transformers

    other = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(model.hf.config), attn_implementation=implementation
    )
    other.load_state_dict(model.hf.state_dict())
    other.generation_config.eos_token_id = None  # every step generates, as gtx's does
    return other.eval()


def masked_greedy(model, ids, prompt_rule, decode_rule):
    """Greedy decoding by transformers' own model with an eager attention written out: query q reads
    key k where ``prompt_rule(q, k)`` (q in the prompt) or ``decode_rule(q, k)`` (a new token), both
    also causal; the whole sequence again per token."""
    import transformers

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n, groups = query.shape[2], query.shape[1] // key.shape[1]
        key, value = (x.repeat_interleave(groups, 1) for x in (key, value))
        scores = query @ key.transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (k <= q) & torch.where(q < len(ids), prompt_rule(q, k), decode_rule(q, k))
        return (scores.masked_fill(~allowed, -math.inf).softmax(-1) @ value).transpose(1, 2), None

    transformers.AttentionInterface.register("test_prefill_decode", attend)
    reference = own_model(model, "test_prefill_decode")
    seq = list(ids)
    with torch.no_grad():
        for _ in range(NEW):
            seq.append(int(reference(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(ids) :]


def everything(q, k):
    return torch.ones_like(q + k, dtype=torch.bool)


def window(w):
    return lambda q, k: q - k <= w


def test_full_then_full_is_transformers_own_greedy_generation(tiny):
    model, ids = tiny
    full = parse_pattern("full")
    expected = own_model(model).generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    expected = expected[0, PROMPT:].tolist()
    assert len(set(expected)) > 3  # a generation that says something
    assert model.generate(ids, NEW, full, decode=full).tokens == expected
    assert model.generate(ids, NEW, full, cache=False).tokens == expected


@pytest.mark.parametrize(
    "prompt, decode, prompt_rule, decode_rule, held",
    [
        ("local:w=3", "full", window(3), everything, PROMPT + NEW - 1),
        ("full", "local:w=3", everything, window(3), 4),
    ],
)
def test_prompt_and_new_tokens_read_under_their_own_patterns(tiny, prompt, decode, prompt_rule, decode_rule, held):
    """The prompt's queries read by the prompt pattern, new tokens by the decode pattern: the same
    tokens with the cache, without it, and from the masked reference; the cache holds what the
    decode pattern reads (full: every position that runs as a query; a window: its last w + 1 keys)."""
    model, ids = tiny
    p, d = parse_pattern(prompt), parse_pattern(decode)
    expected = masked_greedy(model, ids, prompt_rule, decode_rule)
    cached = model.generate(ids, NEW, p, decode=d)
    assert cached.tokens == expected and cached.cached == held
    assert model.generate(ids, NEW, p, cache=False, decode=d).tokens == expected
    # a window over the prompt changes what full attention after it writes
    assert expected != model.generate(ids, NEW, parse_pattern("full")).tokens


def test_a_content_chosen_prompt_pattern_runs_with_the_cache(tiny):
    """The prompt runs once, as in training: moba reads it, and fixed decoding continues on the cache
    exactly as recomputing the whole sequence per token does."""
    model, ids = tiny
    moba, full = parse_pattern("moba:b=4,k=2"), parse_pattern("full")
    cached = model.generate(ids, NEW, moba, decode=full)
    assert cached.tokens == model.generate(ids, NEW, moba, cache=False, decode=full).tokens
    assert cached.tokens != model.generate(ids, NEW, full).tokens


def test_a_content_chosen_decode_pattern_needs_no_cache(tiny):
    model, ids = tiny
    full, moba = parse_pattern("full"), parse_pattern("moba:b=4,k=2")
    with pytest.raises(
        GtxError, match=r"decode pattern 'moba:b=4,k=2[^']*' chooses .* without the cache \(--no-cache\)"
    ):
        model.generate(ids, NEW, full, decode=moba)
    out = model.generate(ids, NEW, full, cache=False, decode=moba)
    assert len(out.tokens) == NEW and out.cached == PROMPT + NEW - 1


def test_generation_stops_after_a_stop_token(tiny):
    model, ids = tiny
    full = parse_pattern("full")
    tokens = model.generate(ids, NEW, full).tokens
    for cache in (True, False):
        stopped = model.generate(ids, NEW, full, cache=cache, stop={tokens[2]})
        assert stopped.tokens == tokens[: tokens.index(tokens[2]) + 1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("decode") / "llama", "llama")


def test_generate_command_decodes_under_its_own_pattern(folder):
    plugins.call_each("register_commands", cli=cli)
    args = ["generate", "--set", f"path={folder}", "--prompt", "a needle in the", "--new", "6"]
    ok = CliRunner().invoke(cli, [*args, "--pattern", "full", "--decode-pattern", "local:w=4"])
    assert ok.exit_code == 0 and "under full, decoded under local:w=4" in ok.output, ok.output
    assert "the cache held at most 5 keys per layer" in ok.output
    for extra, match in (
        (["--decode-pattern", "moba:b=4,k=2"], "without the cache (--no-cache)"),
        (["--decode-pattern", "dsa:k=8"], "parameters of its own"),
    ):
        bad = CliRunner().invoke(cli, [*args, *extra])
        assert bad.exit_code == 2 and match in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output


@pytest.mark.parametrize(
    "args, match",
    [
        (["--task", "text", "--set", "context=32", "--decode-pattern", "local:w=4"], "not scored by generation"),
        (["--task", "niah", "--set", "context=200", "--decode-pattern", "dsa:k=8"], "parameters of its own"),
    ],
)
def test_run_refuses_a_decode_pattern_it_cannot_use(folder, tmp_path, args, match):
    result = CliRunner().invoke(
        cli, ["run", "--model", "hf", "--set", f"path={folder}", *args, "--epochs", "0", "--results", str(tmp_path)]
    )
    assert result.exit_code == 2 and match in result.output and len(result.output.strip().splitlines()) == 1, (
        result.output
    )
    assert not (tmp_path / "runs").exists()


def test_a_decode_pattern_is_part_of_the_experiment():
    """Decoding under the run's own pattern is the run without a decode pattern (the same cell, no
    setting stored); another decode pattern is another experiment, stored canonical."""
    from gtx.run.config import resolve_configs
    from gtx.run.runner import RunConfig, cell_key

    def config(**settings):
        return RunConfig(task="niah", model="hf", pattern="local:w=8", settings=settings)

    plain = cell_key(config())
    assert cell_key(config(decode_pattern="local:w=8")) == plain
    assert cell_key(config(decode_pattern="full")) != plain
    assert resolve_configs(config(decode_pattern=" local:w=8 ")).train.decode_pattern == ""
    assert resolve_configs(config(decode_pattern="local")).train.decode_pattern == "local:w=4"
