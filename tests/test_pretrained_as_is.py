"""--model hf --set path=DIR runs the folder's model as it is: each family gtx accepts, with the
attention features its config declares (sliding windows per layer, its own scaling), gives
transformers' own model's predictions; features gtx does not compute, and weights that do not fit
the config, are one line, exit 2, nothing written."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")  # the test extra installs it; CI always runs these

from pretrained import save_tiny
from safetensors.torch import load_file, save_file

from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.plugins.registry import MODELS

# Qwen's: layers from max_window_layers on slide
SLIDING = {
    "use_sliding_window": True,
    "sliding_window": 5,
    "max_window_layers": 1,
}
# family -> (its config beyond the tiny sizes, each layer's sliding window): every family gtx accepts, the features it declares
FAMILIES = {
    "llama": ({}, [None, None]),
    "mistral": ({"sliding_window": 5}, [5, 5]),
    "qwen2": (SLIDING, [None, 5]),
    "qwen3": (SLIDING, [None, 5]),
    "gemma": ({}, [None, None]),
    # scaling 16^-0.5, not 8^-0.5
    "gemma2": (
        {"sliding_window": 5, "attn_logit_softcapping": None, "query_pre_attn_scalar": 16},
        [5, None],
    ),
    "gemma3_text": (
        {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16},
        [5, None],
    ),
    "gpt2": ({"scale_attn_by_inverse_layer_idx": True}, [None, None]),  # layer i's scores over i + 1
    "olmo2": ({"eos_token_id": 0, "pad_token_id": 0}, [None, None]),  # q and k normalised before RoPE
    # rotary on half of each head's 8 dimensions; attention and MLP in parallel
    "gpt_neox": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        [None, None],
    ),
}
LENGTHS = [12, 7, 10]  # packed in one row; each longer than the windows


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("as-is")


def folder(root, family, **config):
    name = family + "".join(f"-{k}={v}" for k, v in config.items())
    return root / name if (root / name).exists() else save_tiny(root / name, family, **config)


def gtx_model(path, spec="full"):
    entry = MODELS.get("hf")
    config = entry.config(path=str(path))
    tokenizer = entry.obj.tokenizer(config)
    attention = Attention(get_backend("auto"), parse_pattern(spec), config.heads, config.dim // config.heads)
    return entry.obj(config, tokenizer.vocab, tokenizer.vocab, attention).eval()


def packed_logits(model, spec, ids):
    """gtx's logits of the samples ``ids`` packed in one row under ``spec``: one tensor per sample."""
    graph = build_graph(parse_pattern(spec), None, [len(x) for x in ids])
    positions = torch.cat([torch.arange(len(x)) for x in ids])
    with torch.no_grad():
        out = model._logits(torch.cat(ids), positions, graph.edges["dd"])
    return out.split([len(x) for x in ids])


def own_logits(path, ids, **config):
    """transformers' own model of the folder (eager attention, its masks), each sample alone; ``config``: settings replacing the folder's."""
    import transformers

    own = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **config).eval()
    with torch.no_grad():
        return [own(input_ids=x[None]).logits[0] for x in ids]


def samples(model):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, model.hf.config.vocab_size, (n,), generator=g) for n in LENGTHS]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_under_full_is_transformers_own_model(root, family):
    config, windows = FAMILIES[family]
    path = folder(root, family, **config)
    model = gtx_model(path)
    assert model.windows == windows  # what the config declares, layer by layer
    ids = samples(model)
    for ours, theirs in zip(packed_logits(model, "full", ids), own_logits(path, ids)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_a_pattern_applies_within_the_layers_windows(root):
    """local:w=2 (3 keys) on a Qwen2 whose layer 1 slides over 5 keys: both layers read 3 keys, as
    transformers' model does with windows of 3 on both; local:w=8 within Mistral's 5 keys: the model itself."""
    qwen = folder(root, "qwen2", **SLIDING)
    ids = samples(gtx_model(qwen))
    both = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 3}
    for ours, theirs in zip(
        packed_logits(gtx_model(qwen, "local:w=2"), "local:w=2", ids), own_logits(qwen, ids, **both)
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    mistral = folder(root, "mistral", sliding_window=5)
    for ours, theirs in zip(packed_logits(gtx_model(mistral, "local:w=8"), "local:w=8", ids), own_logits(mistral, ids)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    windowless = packed_logits(gtx_model(mistral), "full", ids)[0]
    # the window matters here
    assert not torch.allclose(windowless, own_logits(mistral, ids, sliding_window=None)[0], rtol=1e-4, atol=1e-5)


def test_generation_with_the_cache_keeps_each_layers_window(root):
    model = gtx_model(folder(root, "qwen2", **SLIDING), "local:w=8")
    pattern = parse_pattern("local:w=8")
    cached, again = (
        model.generate([5, 9, 2, 7], 12, pattern, cache=True),
        model.generate([5, 9, 2, 7], 12, pattern, cache=False),
    )
    assert cached.tokens == again.tokens


def edited(root, tmp_path, family="llama", config=None, weights=None, **made):
    """A copy of a tiny folder with config.json's ``config`` entries set and ``weights(dict)`` applied to its safetensors."""
    path = tmp_path / "model"
    shutil.copytree(folder(root, family, **made), path)
    if config:
        (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **config}))
    if weights:
        w = load_file(path / "model.safetensors")
        weights(w)
        save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    return path


def drop_layer_1(w):
    for name in [n for n in w if n.startswith("model.layers.1.")]:
        del w[name]


def cut(w):
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:-1]


def _cut(name: str, keep: int):
    """An edit of a folder: its file ``name`` cut to its first ``keep`` bytes (a crash or a full disk leaves such a file)."""

    def edit(path):
        (path / name).write_bytes((path / name).read_bytes()[:keep])

    return edit


def _more_tokens(path):
    """An edit of a folder: 5 tokens of its tokenizer's vocabulary that its model has no embedding for."""
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    first = len(tokenizer["model"]["vocab"])
    tokenizer["model"]["vocab"].update({f"extra{i}": first + i for i in range(5)})
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))


REFUSED = {
    "a layer's weights missing": ({"weights": drop_layer_1}, "9 missing (model.layers.1.input_layernorm.weight, ...)"),
    "an unexpected weight": ({"weights": lambda w: w.update(extra=torch.zeros(2))}, "1 unexpected (extra)"),
    "a weight of another shape": (
        {"weights": cut},
        "1 mis-shaped (model.layers.0.mlp.up_proj.weight ((63, 32) saved, (64, 32) built))",
    ),
    "qwen2's config over llama's weights": (
        {"config": {"model_type": "qwen2"}},
        "its weights do not fit the Qwen2ForCausalLM",
    ),
    "bert's config over llama's weights": (
        {"config": {"model_type": "bert"}},
        "model_type 'bert' in config.json is not a family gtx checks",
    ),
    "gemma2's logit soft-capping": (
        {"family": "gemma2"},
        "logit soft-capping (attn_logit_softcapping=50.0 in the model's config; layer 0)",
    ),
    "a trainable pattern within a window": (
        {"family": "mistral", "sliding_window": 5, "pattern": "nsa", "args": ["--set", "untrained_attention=true"]},
        "sliding window of 5 keys (sliding_window; on layers 0, 1)",
    ),
    "moba within a window": (
        {"family": "mistral", "sliding_window": 5, "pattern": "moba:b=4,k=2"},
        "not among its candidates",
    ),
    "a truncated tokenizer.json": ({"edit": _cut("tokenizer.json", 100)}, "its tokenizer cannot be loaded"),
    "a truncated config.json": ({"edit": _cut("config.json", 50)}, "config.json cannot be read"),
    "a size beside the folder, other than its own": (
        {"args": ["--set", "layers=5"]},
        "layers=5 beside path=",
    ),
    "a truncated model.safetensors": (
        {"edit": _cut("model.safetensors", 1000)},
        "its weights cannot be read (SafetensorError: Error while deserializing header",
    ),
    "a config.json that holds a list": (
        {"edit": lambda p: (p / "config.json").write_text("[1, 2]")},
        "config.json holds a list",
    ),
    "positions written 256.0": (
        {"config": {"max_position_embeddings": 256.0}},
        "max_position_embeddings=256.0 in config.json is not",
    ),
    "positions written true": (
        {"config": {"max_position_embeddings": True}},
        "max_position_embeddings=true in config.json is not",
    ),
    "3 heads over a width of 32": ({"config": {"num_attention_heads": 3}}, "transformers refuses its config.json"),
    "a model_type transformers does not know": (
        {"config": {"model_type": "nosuch"}},
        "model_type 'nosuch' in config.json is not a family gtx checks",
    ),
    "a family beside path": ({"args": ["--set", "family=nosuch"]}, "family='nosuch' beside path="),
    "a tokenizer of more tokens than the model": (
        {"edit": _more_tokens},
        "its tokenizer has 305 tokens but its model 300 (vocab_size in the model's config)",
    ),
    "a negative sliding window": (
        {"family": "mistral", "sliding_window": 5, "config": {"sliding_window": -4}},
        "sliding_window=-4 in the model's config (layer 0) is no window: give a whole number of keys from 1 up, or null",
    ),
    "an unknown rope_type": (
        {"config": {"rope_scaling": {"rope_type": "bogus", "factor": 2.0}}},
        'rope_type="bogus" (rope_scaling in the model\'s config) is no rotary embedding transformers computes; '
        "choose default, linear, dynamic, yarn",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_gtx_would_not_compute_is_one_line_and_nothing_written(root, tmp_path, case):
    how, match = REFUSED[case]
    how = dict(how)
    pattern, args, edit = how.pop("pattern", "full"), how.pop("args", []), how.pop("edit", None)
    path = edited(root, tmp_path, **how)
    if edit:  # a file of the folder broken as a crash or another program leaves it
        edit(path)
    result = CliRunner().invoke(
        cli,
        [
            "run",
            "--model",
            "hf",
            "--set",
            f"path={path}",
            "--task",
            "text",
            "--set",
            "context=32",
            "--set",
            "train_tokens=600",
            "--set",
            "eval_tokens=300",
            "--pattern",
            pattern,
            "--epochs",
            "0",
            "--quiet",
            "--results",
            str(tmp_path / "r"),
            *args,
        ],
    )
    assert result.exit_code == 2 and match in result.output and len(result.output.strip().splitlines()) == 1, (
        result.output
    )
    assert not (tmp_path / "r").exists()


def test_topk_runs_within_a_window(root):
    model = gtx_model(folder(root, "mistral", sliding_window=5), "topk:k=3")
    ids = samples(model)
    assert all(torch.isfinite(x).all() for x in packed_logits(model, "topk:k=3", ids))
