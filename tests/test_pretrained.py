"""--model hf --set path=DIR: a save_pretrained folder's model and tokenizer under gtx patterns.

Scored untrained (``--epochs 0``) in bits per byte against the same weights under transformers'
own model, fine-tuned on a subset of its weights, evaluated under another pattern, and generating
with a key/value cache that keeps only the keys the pattern can still read.
"""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")  # the test extra installs it; CI always runs these

from pretrained import reference_bpc, save_tiny

from gtx import plugins
from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.errors import GtxError
from gtx.graph.spec import parse_pattern
from gtx.plugins.registry import MODELS, TASKS
from gtx.records.checkpoint import checkpoint_dir
from gtx.records.results import load

TEXT = ["--task", "text", "--set", "context=32", "--set", "train_tokens=600", "--set", "eval_tokens=300", "--quiet"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    return {
        **{family: save_tiny(root / family, family) for family in ("llama", "gpt2")},
        "mistral": save_tiny(root / "mistral", "mistral", sliding_window=8),
        # an embedding padded past the tokenizer's ids, as Qwen2's (151,936 rows for 151,665 ids): 320 rows for 300
        "qwen2-padded": save_tiny(root / "qwen2-padded", "qwen2", rows=320),
    }


def run(folder, *args):
    return CliRunner().invoke(cli, ["run", "--model", "hf", "--set", f"path={folder}", *args])


def model(folder, spec):
    entry = MODELS.get("hf")
    config = entry.config(path=str(folder))
    tokenizer = entry.obj.tokenizer(config)
    pattern = parse_pattern(spec)
    attention = Attention(get_backend("auto"), pattern, config.heads, config.dim // config.heads)
    return entry.obj(config, tokenizer.vocab, tokenizer.vocab, attention).eval(), tokenizer, pattern


def test_the_folder_gives_sizes_positions_and_tokenizer(folders):
    config = MODELS.get("hf").config(path=str(folders["llama"]))
    assert (config.family, config.layers, config.heads, config.kv_heads, config.dim, config.max_len) == (
        "llama",
        2,
        4,
        2,
        32,
        256,
    )
    _, tokenizer, _ = model(folders["gpt2"], "full")
    tokens = tokenizer.tokenize("the lazy dog")
    assert tokenizer.detokenize(tokens) == "the lazy dog" and tokenizer.n_bytes(tokens) == 12
    assert tokenizer.vocab.decode(tokenizer.vocab.encode(tokens)) == tokens  # ids are the tokenizer's own


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2-padded"])
def test_untrained_bits_per_byte_are_transformers_own(folders, tmp_path, family):
    """--epochs 0 scores the folder's weights: valid bpc is the nats of transformers' own model's
    predictions of the same windows over the bytes they write, in bits (Mistral: within its sliding
    window of 8 keys, shorter than the windows of 32 tokens; Qwen2's padded embedding: a softmax over
    all its 320 rows, as transformers' own)."""
    result = run(folders[family], *TEXT, "--epochs", "0", "--results", str(tmp_path))
    assert result.exit_code == 0, result.output
    df = load(tmp_path)
    assert df.split.tolist() == ["valid", "test"] and (df.epoch == 0).all()
    assert not checkpoint_dir(tmp_path, df.run_id.iloc[0]).exists()  # nothing trained: the weights are the folder's

    _, tokenizer, _ = model(folders[family], "full")
    task = TASKS.get("text").obj("text", TASKS.get("text").config(context=32, train_tokens=600, eval_tokens=300))
    task.tokenizer = tokenizer
    expected = reference_bpc(folders[family], tokenizer, [window for window, _ in task.splits()["valid"]])
    assert json.loads(df.query("split == 'valid'").metrics.iloc[0])["bpc"] == pytest.approx(expected, rel=1e-4)


def test_a_padded_embedding_is_read_id_for_id(folders):
    """The vocabulary is the embedding's rows: the tokenizer's ids (300, and a special token), then
    rows that write no text."""
    m, tokenizer, _ = model(folders["qwen2-padded"], "full")
    assert len(tokenizer.vocab) == m.hf.get_input_embeddings().num_embeddings == 320
    known = len(tokenizer.hf)
    assert known == 301 and tokenizer.vocab.decode(range(known, 320)) == [""] * (320 - known)
    tokens = tokenizer.tokenize("the lazy dog")
    assert tokenizer.detokenize([*tokens, *tokenizer.vocab.decode([310])]) == "the lazy dog"


def test_a_special_token_past_the_embedding_is_one_line_where_the_text_writes_it(tmp_path):
    """A token added to the tokenizer beside its 300 written ones, past the model's 300 rows: text
    without it reads as ever; a text that writes it out is refused, naming it."""
    import transformers

    folder = save_tiny(tmp_path / "model", "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    tokenizer.save_pretrained(folder)
    _, tokenizer, _ = model(folder, "full")
    assert len(tokenizer.hf) == 301 and len(tokenizer.vocab) == 300
    assert tokenizer.detokenize(tokenizer.tokenize("the lazy dog")) == "the lazy dog"
    with pytest.raises(
        GtxError, match=r"the text holds token '<extra>' \(id 300\), past the model's 300 embedding rows"
    ):
        tokenizer.tokenize("the <extra> dog")


def test_a_bfloat16_folder_runs_in_float32_and_its_row_says_so(folders, tmp_path):
    half = save_tiny(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    result = run(half, *TEXT, "--epochs", "0", "--results", str(tmp_path / "r"))
    assert result.exit_code == 0, result.output
    assert json.loads(load(tmp_path / "r").config.iloc[0])["model_config"]["weights"] == "bfloat16, run in float32"
    m, _, _ = model(half, "full")
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert MODELS.get("hf").config(path=str(folders["llama"])).weights == "float32"


def test_a_run_stores_its_path_absolute_and_rebuilds_from_another_folder(folders, tmp_path, monkeypatch):
    """--set path=llama, typed relative to the working folder, is stored absolute: gtx eval of the
    run from another folder loads the same model (it read 'has no config.json')."""
    results = tmp_path / "r"
    monkeypatch.chdir(folders["llama"].parent)
    result = run("llama", *TEXT, "--epochs", "1", "--results", str(results))
    assert result.exit_code == 0, result.output
    run_id, absolute = load(results).run_id.iloc[0], str(folders["llama"].resolve())
    state = torch.load(checkpoint_dir(results, run_id) / "last.pt", weights_only=False)
    assert state["run_config"]["settings"]["path"] == absolute
    assert json.loads(load(results).config.iloc[0])["settings"]["path"] == absolute
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = CliRunner().invoke(cli, ["eval", run_id, "--results", str(results), "--split", "valid"])
    assert again.exit_code == 0, again.output


def test_three_patterns_untrained_compare(folders, tmp_path):
    for spec in ("full", "local:w=8", "moba:b=8,k=2"):
        assert (
            run(folders["gpt2"], *TEXT, "--epochs", "0", "--pattern", spec, "--results", str(tmp_path)).exit_code == 0
        )
    result = CliRunner().invoke(cli, ["compare", "--results", str(tmp_path), "--format", "csv"])
    assert result.exit_code == 0 and result.output.count("\ntext,hf,") == 3, result.output


def test_fine_tune_a_subset_then_evaluate_under_another_pattern(folders, tmp_path):
    result = run(
        folders["llama"], *TEXT, "--set", "train_params=self_attn", "--epochs", "1", "--results", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    run_id = load(tmp_path).run_id.iloc[0]
    trained = torch.load(checkpoint_dir(tmp_path, run_id) / "last.pt", weights_only=False)["model"]
    original, _, _ = model(folders["llama"], "full")
    for name, before in original.state_dict().items():
        assert torch.equal(before, trained[name]) != ("self_attn" in name), name  # only the attention's weights moved
    again = CliRunner().invoke(cli, ["eval", run_id, "--results", str(tmp_path), "--pattern", "local:w=8"])
    assert again.exit_code == 0, again.output
    assert load(tmp_path).query("eval_of == @run_id").pattern.tolist() == ["local:w=8"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("spec, held", [("full", 17), ("local:w=4", 5), ("longformer:w=3,g=1", 5)])
def test_generation_with_the_cache_equals_without(folders, family, spec, held):
    m, tokenizer, pattern = model(folders[family], spec)
    prompt = tokenizer.vocab.encode(tokenizer.tokenize("a needle in the"))
    assert len(prompt) == 6  # 6 + 12 - 1 positions run as queries: full attention holds them all
    cached, again = m.generate(prompt, 12, pattern, cache=True), m.generate(prompt, 12, pattern, cache=False)
    assert cached.tokens == again.tokens and len(cached.tokens) == 12
    assert cached.cached == held  # a window keeps its last w + 1 keys; longformer its global first key too


def test_generate_command_and_its_refusals(folders):
    plugins.call_each("register_commands", cli=cli)  # what gtx's entry point does before running a command
    ok = CliRunner().invoke(
        cli,
        [
            "generate",
            "--set",
            f"path={folders['llama']}",
            "--pattern",
            "local:w=4",
            "--prompt",
            "the quick",
            "--new",
            "6",
        ],
    )
    assert (
        ok.exit_code == 0
        and ok.output.startswith("the quick")
        and "the cache held at most 5 keys per layer" in ok.output
    ), ok.output
    for args, match in (
        (["--pattern", "moba:b=4,k=2"], "without the cache (--no-cache)"),
        ([], "or --set path=DIR"),
        (["--new", "300"], "the model has 256 positions"),
    ):
        path = [] if not args else ["--set", f"path={folders['llama']}"]
        bad = CliRunner().invoke(cli, ["generate", *path, *args, "--prompt", "the quick"])
        assert bad.exit_code == 2 and match in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output


@pytest.mark.parametrize(
    "remove, match",
    [
        ("config.json", "has no config.json"),
        ("model.safetensors", "has no weights"),
        ("tokenizer.json", "has no tokenizer"),
    ],
)
def test_incomplete_folders_are_one_line(folders, tmp_path, remove, match):
    folder = tmp_path / "model"
    shutil.copytree(folders["gpt2"], folder)
    (folder / remove).unlink()
    result = run(folder, *TEXT, "--epochs", "0", "--results", str(tmp_path / "r"))
    assert result.exit_code == 2 and match in result.output and len(result.output.strip().splitlines()) == 1, (
        result.output
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "args, match",
    [
        (["--task", "recall"], "writes its own symbols, not text"),
        (["--task", "text", "--set", "context=300"], "has positions for 256"),
        (
            ["--task", "text", "--set", "context=32", "--set", "train_params=nothing_is_called_this"],
            "matches no parameter",
        ),
    ],
)
def test_bad_runs_are_one_line(folders, tmp_path, args, match):
    result = run(folders["gpt2"], *args, "--epochs", "1", "--results", str(tmp_path))
    # the progress line said before the weights are read is not part of the error
    said = [line for line in result.output.strip().splitlines() if not line.startswith("loading model")]
    assert result.exit_code == 2 and match in result.output and len(said) == 1, result.output
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def tuned(folders, tmp_path_factory):
    """A run fine-tuned from the llama folder under dsa (so its pattern has trained parameters of its own), and its 6-hex tail."""
    results = tmp_path_factory.mktemp("tuned")
    result = run(folders["llama"], *TEXT, "--pattern", "dsa:k=8,dense=0", "--epochs", "1", "--results", str(results))
    assert result.exit_code == 0, result.output
    return results, load(results).run_id.iloc[0].rsplit("-", 1)[1]


def test_generate_and_export_a_fine_tuned_run_by_its_short_id(tuned, tmp_path):
    import transformers
    from safetensors import safe_open

    plugins.call_each("register_commands", cli=cli)
    results, tail = tuned
    run_id = load(results).run_id.iloc[0]
    prompt = ["--prompt", "the quick", "--new", "6", "--pattern", "full"]
    own = CliRunner().invoke(
        cli, ["generate", tail, "--results", str(results), "--prompt", "the quick", "--new", "4", "--no-cache"]
    )
    assert own.exit_code == 0 and "4 tokens under dsa:k=8" in own.output, own.output  # the run's own pattern by default
    from_run = CliRunner().invoke(cli, ["generate", tail, "--results", str(results), *prompt])
    assert from_run.exit_code == 0, from_run.output
    out = tmp_path / "exported"
    exported = CliRunner().invoke(cli, ["export", tail, str(out), "--results", str(results)])
    assert exported.exit_code == 0, exported.output
    assert {"config.json", "model.safetensors", "tokenizer.json", "gtx_pattern.safetensors", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    # a plain loader runs full attention over weights trained under dsa: said on export and in the folder
    said = "a plain transformers loader runs full causal attention over these weights, which computes something else"
    assert said in exported.output and "--pattern 'dsa:k=8" in exported.output
    assert said in (out / "README.md").read_text()
    trained = torch.load(checkpoint_dir(results, run_id) / "best.pt", weights_only=False)["model"]
    # transformers' own attention: the folder names no gtx
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert json.loads((out / "config.json").read_text()).get("_attn_implementation") in (None, "sdpa")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[f"hf.{name}"]), name  # the fine-tuned weights, not the folder's
    with safe_open(
        str(out / "gtx_pattern.safetensors"), "pt"
    ) as f:  # dsa's indexer, trained with the run, beside the model
        assert (
            f.metadata()["pattern"].startswith("dsa:k=8")
            and f.keys()
            and all(torch.equal(f.get_tensor(k), trained[k]) for k in f.keys())
        )
    from_folder = CliRunner().invoke(cli, ["generate", "--set", f"path={out}", *prompt])
    # the exported folder generates what the run does
    assert from_folder.output.splitlines()[0] == from_run.output.splitlines()[0]
    again = CliRunner().invoke(cli, ["export", tail, str(out), "--results", str(results)])
    assert again.exit_code == 2 and "is not empty" in again.output and again.output.count("\n") == 1
    under_a_file = CliRunner().invoke(
        cli, ["export", tail, str(out / "config.json" / "sub"), "--results", str(results)]
    )
    assert under_a_file.exit_code == 2 and "is not a folder); choose another export folder" in under_a_file.output
    unknown = CliRunner().invoke(cli, ["generate", "zzzzzz", "--results", str(results), *prompt])
    assert unknown.exit_code == 2 and "no run 'zzzzzz'" in unknown.output and unknown.output.count("\n") == 1


def test_prefill_lengths_are_checked_against_memory_with_their_logits(monkeypatch):
    """Hidden states of 10^8 tokens x 16 (12 GiB) fit a 16 GiB machine; with their logits over the
    random model's 256 tokens they do not: refused before a model is built (it was killed for memory)."""
    from gtx.measure import prefill

    monkeypatch.setattr(prefill, "_physical_bytes", lambda: 16 * 2**30)
    with pytest.raises(
        GtxError, match=r"at least 107.3 GiB \(hidden states of 99,999,999 tokens x 16, twice, and their logits"
    ):
        prefill.check_lengths("llama", {"dim": "16"}, [99_999_999])
    prefill.check_lengths("llama", {"dim": "16"}, [4096])


@pytest.mark.parametrize(
    "spec, same", [("full", True), ("causal", True), ("local:w=16", False), ("full+alibi", False), ("topk:k=4", False)]
)
def test_an_export_says_when_a_plain_loader_runs_something_else(spec, same):
    """transformers' own attention is full causal attention: an export under anything else says so."""
    from gtx.cli.pretrained import runs_as_transformers

    assert runs_as_transformers(parse_pattern(spec)) is same
