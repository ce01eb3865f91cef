"""A pretrained model as it is (``save_pretrained``'s config, weights and tokenizer, or a GGUF file
holding all three: ``gtx.model.source``), for the hf model plugin: what it holds
(``pretrained_sizes``), its weights loaded in float32 and checked against the model its config
builds (``load_folder``), its tokenizer against its model's embedding (``load_tokenizer``,
``check_vocab``), and the attention features transformers hands each layer, refused where gtx does
not compute them (``check_features``, ``check_window``, ``check_rope``). Each refusal is one line
naming the path and the field."""

from __future__ import annotations

import importlib.util
import json
import pickle
from contextlib import contextmanager
from functools import lru_cache, partial
from pathlib import Path

import torch

from gtx.errors import GtxError
from gtx.graph.pattern import Pattern, within_window
from gtx.graph.tokens import batch_edges
from gtx.model.source import Source, locate, stored_as

# the folders' families tests/test_pretrained.py checks against transformers' own model (model_type in config.json)
CHECKED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gpt2", "olmo2", "gpt_neox")
# what transformers may hand an attention function beyond q, k, v that gtx does not compute: the feature and the config field declaring it
REFUSED = {
    "softcap": ("logit soft-capping", "attn_logit_softcapping"),
    "s_aux": ("attention sinks", "sinks"),
    "sinks": ("attention sinks", "sinks"),
    "attention_mask": ("an attention mask", "attn_implementation"),
}
# handed on, no part of the attention's function
PASSED = (
    "position_ids",
    "is_causal",
    "output_attentions",
    "use_cache",
    "cache_position",
)
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, byte-level BPE
POSITIONS = ("max_position_embeddings", "n_positions")  # what config.json calls the positions a model has
GGUF_NEEDS = ("gguf", "accelerate")  # what transformers' GGUF reader imports
INSTALL = "pip install -e '.[hf]'"


def pretrained_sizes(path: str | Path, t) -> dict:
    """The family and sizes (the hf model's settings) of the model at ``path`` (``source.locate``: a
    folder, a GGUF file or a name), once the folder is checked to hold a config, weights and a
    tokenizer: what a run records and its attention is built for, with its absolute ``path`` and
    what its ``weights`` are stored as (``source.stored_as``). ``t``: the transformers module.
    ValueError naming what is wrong."""
    source = locate(str(path))
    where = f"path={path}"
    raw = _config_json(source.folder, where) if source.gguf is None else {}
    if source.gguf is not None:
        missing = [name for name in GGUF_NEEDS if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(f"{where} is a GGUF file; transformers reads it with {' and '.join(missing)}: {INSTALL}")
    c = read_config(source, t, where)
    if c.model_type not in CHECKED:  # a folder's is refused from its config.json, before transformers reads it
        raise ValueError(_unchecked(where, c.model_type, "in the GGUF file"))
    check_rope(c, "rope_scaling" if "rope_scaling" in raw else "rope_parameters", where)
    positions = next((raw[k] for k in POSITIONS if k in raw), None) or getattr(c, "max_position_embeddings", None)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(f"{where}: its model names no positive number of positions (context_length in the GGUF file)")
    heads = c.num_attention_heads
    return {
        "path": str(source.path),
        "weights": stored_as(source),
        "family": c.model_type,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "dim": c.hidden_size,
        "dim_ff": getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size,
        "max_len": positions,
    }


def _config_json(folder: Path, where: str) -> dict:
    """A save_pretrained folder's config.json, once the folder holds weights and a tokenizer beside
    it and it names a checked family and its positions."""
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{where} has no config.json; give a folder written by save_pretrained (config, weights and tokenizer), "
            "or a GGUF file"
        )
    if not any(any(folder.glob(w)) for w in WEIGHTS):
        raise ValueError(f"{where} has no weights ({' or '.join(WEIGHTS)}); save the model there with save_pretrained")
    if not any((folder / t).is_file() for t in TOKENIZER):
        raise ValueError(
            f"{where} has no tokenizer ({', '.join(TOKENIZER)}); save the model's tokenizer there with save_pretrained"
        )
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (ValueError, OSError) as e:  # cut short, not UTF-8, not JSON
        raise ValueError(
            f"{where}: config.json cannot be read ({str(e).splitlines()[0]}); give the config.json save_pretrained wrote"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{where}: config.json holds a {type(raw).__name__}, not a model's configuration; give the one save_pretrained wrote"
        )
    if raw.get("model_type") not in CHECKED:  # before transformers, whose words for a type it lacks run to 3 lines
        raise ValueError(_unchecked(where, raw.get("model_type"), "in config.json"))
    name, positions = next(((k, raw[k]) for k in POSITIONS if k in raw), (None, None))
    if name is None:
        raise ValueError(
            f"{where}: config.json names no positions ({' or '.join(POSITIONS)}); its model cannot say how long a text it reads"
        )
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(
            f"{where}: {name}={json.dumps(positions)} in config.json is not a positive whole number of positions"
        )
    return raw


def _unchecked(where: str, model_type, written: str) -> str:
    return (
        f"{where}: model_type {model_type!r} {written} is not a family gtx checks against transformers' "
        f"own model ({', '.join(CHECKED)}); its attention may hold features gtx would not compute"
    )


def read_config(source: Source, t, where: str):
    """transformers' configuration of the source (``AutoConfig``: its maps read every family's
    names, n_embd as hidden_size; it validates the sizes), read once per file as it stands.
    ValueError naming what is wrong."""
    file = source.path if source.gguf else source.folder / "config.json"
    stat = file.stat()
    verbosity = t.utils.logging.get_verbosity()
    t.utils.logging.set_verbosity_error()  # its warnings (an unknown rope_type's) come before gtx's one line
    try:
        return _read_config(source, t, stat.st_mtime_ns, stat.st_size)
    except Exception as e:  # transformers' and huggingface_hub's validation: several lines, the reason last
        why = ([line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__])[-1]
        if source.gguf:
            raise ValueError(
                f"{where}: transformers cannot read it as a GGUF file ({why}); give the GGUF file whole"
            ) from None
        raise ValueError(f"{where}: transformers refuses its config.json: {why}") from None
    finally:
        t.utils.logging.set_verbosity(verbosity)


@lru_cache(maxsize=8)
def _read_config(source: Source, t, mtime: int, size: int):
    return t.AutoConfig.from_pretrained(source.folder, **source.kwargs())


def check_rope(c, field: str, where: str) -> None:
    """The rotary embedding ``c`` declares (``rope_type`` in ``field``; per layer type where a model
    has several) is one transformers computes. ValueError naming the field and the allowed values."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ("default", *ROPE_INIT_FUNCTIONS)
    declared = getattr(c, "rope_parameters", None) or {}
    for params in declared.values() if all(isinstance(v, dict) for v in declared.values()) else [declared]:
        kind = params.get("rope_type", "default")
        if kind not in known:
            raise ValueError(
                f"{where}: rope_type={json.dumps(kind)} ({field} in the model's config) is no rotary embedding "
                f"transformers computes; choose {', '.join(known)}"
            )


def load_folder(t, path: str):
    """The causal LM at ``path`` (a folder or a GGUF file, in float32) under gtx's attention; one
    line naming the weights where they do not fit the model its config builds (missing,
    unexpected, another shape), or cannot be read."""
    from safetensors import SafetensorError  # transformers' own dependency

    source = locate(path)
    # a GGUF file's weights unpacked into plain float32 ones (transformers could keep them in blocks, under its kernels)
    dequantized = {"quantization_config": t.GgufConfig(dequantize=True)} if source.gguf else {}
    verbosity = t.utils.logging.get_verbosity()
    t.utils.logging.set_verbosity_error()  # transformers' table of the weights that did not load: gtx's refusal says it in one line
    try:
        with _quiet_gguf(t):
            hf, info = t.AutoModelForCausalLM.from_pretrained(
                source.folder,
                **source.kwargs(),
                **dequantized,
                attn_implementation="gtx",
                dtype=torch.float32,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
            )
    except ValueError as e:  # transformers' words for a family that is no causal LM, or whose attention is its own code
        raise GtxError(
            f"path={path}: transformers cannot load it as a causal LM with gtx's attention: {str(e).splitlines()[0]}"
        ) from None
    except (SafetensorError, OSError, EOFError, pickle.UnpicklingError, RuntimeError) as e:  # the weights' files
        raise GtxError(
            f"path={path}: its weights cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"give {'the GGUF file whole' if source.gguf else 'the folder save_pretrained wrote, whole'}"
        ) from None
    finally:
        t.utils.logging.set_verbosity(verbosity)
    wrong = {
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mis-shaped": sorted(
            f"{k} ({tuple(saved)} saved, {tuple(built)} built)" for k, saved, built in info["mismatched_keys"]
        ),
    }
    wrong = {what: keys for what, keys in wrong.items() if keys}
    if wrong or info["error_msgs"]:
        said = "; ".join(
            f"{len(keys)} {what} ({keys[0]}{', ...' if len(keys) > 1 else ''})" for what, keys in wrong.items()
        )
        raise GtxError(
            f"path={path}: its weights do not fit the {type(hf).__name__} its config.json (model_type {hf.config.model_type!r}) builds: "
            f"{said or info['error_msgs'][0]}; give the folder save_pretrained wrote, config and weights of one model"
        )
    if source.gguf:  # dense now: saved (gtx export) and trained as a folder's model, not as a GGUF file's
        hf.hf_quantizer = None
        vars(hf.config).pop("quantization_config", None)
    return hf


@contextmanager
def _quiet_gguf(t):
    """transformers' GGUF reader draws a progress bar of its own (tqdm's, not transformers' logging):
    noise in a run's log, off while it reads."""
    try:
        module = importlib.import_module(f"{t.__name__}.modeling_gguf_pytorch_utils")
    except ImportError:  # a transformers without GGUF support: from_pretrained says so
        yield
        return
    bar = getattr(module, "tqdm", None)
    if bar is not None:
        module.tqdm = partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            module.tqdm = bar


def load_tokenizer(t, path: str):
    """(tokenizer, rows): the tokenizer saved with the model at ``path`` (a folder's, or the one a GGUF
    file holds) and the rows of the model's embedding; one line where it cannot be loaded or
    writes ids past the embedding (``check_vocab``)."""
    source = locate(path)
    try:
        tokenizer = t.AutoTokenizer.from_pretrained(source.folder, **source.kwargs())
    except Exception as e:  # transformers and tokenizers raise many kinds for a file cut short or of another format
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise GtxError(
            f"path={path}: its tokenizer cannot be loaded ({why}); give the tokenizer files save_pretrained wrote"
        ) from None
    try:
        rows = read_config(source, t, f"path={path}").vocab_size
    except ValueError as e:
        raise GtxError(str(e)) from None
    check_vocab(tokenizer, rows, path)
    return tokenizer, rows


def check_vocab(tokenizer, rows: int, path: str) -> None:
    """One line where the tokenizer writes ids past the model's embedding (``rows``, ``vocab_size``
    in its config): they cannot be read. Tokens added beside the written ones (special ones) may lie
    past it: text never holds them. An embedding of more rows than the tokenizer has ids (Qwen2's,
    padded) is the model's as transformers runs it: its logits, and so its loss, span every row."""
    if isinstance(rows, bool) or not isinstance(rows, int):
        return
    written = tokenizer.vocab_size
    if written > rows:
        raise GtxError(
            f"path={path}: its tokenizer has {written} tokens but its model {rows} (vocab_size in the model's config); "
            "give a model whose tokenizer and model were saved together"
        )


def check_features(model, layers, pattern, where: str) -> list[int | None]:
    """Each attention layer's sliding window (None: every earlier key), as transformers hands them
    to the attention in one forward of two tokens; one line refusing a feature gtx does not compute
    (``REFUSED``, or anything else it is handed), or a ``pattern`` that cannot apply within a window."""
    holder, training = model._holder, model.hf.training
    holder.seen = {}
    try:
        with torch.no_grad():
            model.hf.eval()(input_ids=torch.zeros(1, 2, dtype=torch.long), position_ids=torch.arange(2)[None])
    finally:
        seen, holder.seen = holder.seen, None
        model.hf.train(training)
    for module in layers:
        if module not in seen:
            raise GtxError(
                f"{where}: layer {module.layer_idx}'s attention does not call transformers' attention interface; it cannot be replaced"
            )
        for name, value in seen[module].items():
            if value is None or name in PASSED or name == "sliding_window":
                continue
            feature, field = REFUSED.get(name, (f"'{name}'", name))
            declared = getattr(model.hf.config, field, None)
            raise GtxError(
                f"{where}: {feature} ({field}{f'={declared}' if declared is not None else ''} in the model's config; layer "
                f"{module.layer_idx}) is an attention feature gtx does not compute; scores would not be the model's"
            )
    windows = [seen[m]["sliding_window"] for m in layers]
    for module, keys in zip(layers, windows):
        if keys is not None and (isinstance(keys, bool) or not isinstance(keys, int) or keys < 1):
            declared = getattr(model.hf.config, "sliding_window", keys)
            raise GtxError(
                f"{where}: sliding_window={json.dumps(declared)} in the model's config (layer {module.layer_idx}) is no "
                "window: give a whole number of keys from 1 up, or null for none"
            )
    for keys in sorted({w for w in windows if w is not None}):
        on = [i for i, w in enumerate(windows) if w == keys]
        try:
            check_window(pattern, keys)
        except GtxError as e:
            raise GtxError(
                f"{where}: the model's config declares a sliding window of {keys} keys (sliding_window; on layers "
                f"{', '.join(map(str, on))}), within which the pattern applies: {e}"
            ) from None
    return windows


def check_window(pattern: Pattern | None, keys: int) -> None:
    """``pattern`` can run within a window of ``keys`` keys: its selections choose among the windowed
    candidates (tried once on random queries and keys); PatternError otherwise."""
    if pattern is None:
        return
    windowed = within_window(pattern, keys)
    n = keys + 2
    edges = batch_edges(windowed, "dd", [n], [n])
    for part, e in ((windowed, edges), *zip(windowed.heads, edges.groups)):
        if part.select is not None:
            x = torch.randn(n, 1, 4, generator=torch.Generator().manual_seed(0))
            part.select(x, x, e)
