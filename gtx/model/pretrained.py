"""A pretrained folder as it is (``save_pretrained``'s config, weights and tokenizer), for the hf
model plugin: what it holds (``pretrained_sizes``), its weights loaded and checked against the model
its config builds (``load_folder``), its tokenizer against its model (``check_vocab``), and the
attention features transformers hands each layer, refused where gtx does not compute them
(``check_features``, ``check_window``). Each refusal is one line naming the folder and the field."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from gtx.errors import GtxError
from gtx.graph.pattern import Pattern, within_window
from gtx.graph.tokens import batch_edges

# the folders' families tests/test_pretrained.py checks against transformers' own model (model_type in config.json)
CHECKED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gpt2")
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


def pretrained_sizes(folder: Path, t) -> dict:
    """The family and sizes (the hf model's settings) of the model saved in ``folder``, once the folder
    is checked to hold a config, weights and a tokenizer: what a run records and its attention is built
    for. ``t``: the transformers module. ValueError naming what is wrong."""
    where = f"path={folder}"
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{where} has no config.json; give a folder written by save_pretrained (config, weights and tokenizer)"
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
        raise ValueError(
            f"{where}: model_type {raw.get('model_type')!r} in config.json is not a family gtx checks against transformers' "
            f"own model ({', '.join(CHECKED)}); its attention may hold features gtx would not compute"
        )
    name, positions = next(((k, raw[k]) for k in POSITIONS if k in raw), (None, None))
    if name is None:
        raise ValueError(
            f"{where}: config.json names no positions ({' or '.join(POSITIONS)}); its model cannot say how long a text it reads"
        )
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ValueError(
            f"{where}: {name}={json.dumps(positions)} in config.json is not a positive whole number of positions"
        )
    # AutoConfig's attribute maps read every family's names (n_embd: hidden_size); it validates the sizes
    try:
        c = t.AutoConfig.from_pretrained(folder)
    except Exception as e:  # transformers' and huggingface_hub's validation: several lines, the reason last
        why = ([line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__])[-1]
        raise ValueError(f"{where}: transformers refuses its config.json: {why}") from None
    heads = c.num_attention_heads
    return {
        "family": c.model_type,
        "layers": c.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "dim": c.hidden_size,
        "dim_ff": getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size,
        "max_len": positions,
    }


def load_folder(t, path: str):
    """The folder's causal LM under gtx's attention; one line naming the weights where the folder's
    weights do not fit the model its config builds (missing, unexpected, another shape)."""
    from safetensors import SafetensorError  # transformers' own dependency

    verbosity = t.utils.logging.get_verbosity()
    t.utils.logging.set_verbosity_error()  # transformers' table of the weights that did not load: gtx's refusal says it in one line
    try:
        hf, info = t.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="gtx", dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except ValueError as e:  # transformers' words for a family that is no causal LM, or whose attention is its own code
        raise GtxError(
            f"path={path}: transformers cannot load it as a causal LM with gtx's attention: {str(e).splitlines()[0]}"
        ) from None
    except (SafetensorError, OSError, EOFError, pickle.UnpicklingError, RuntimeError) as e:  # the weights' files
        raise GtxError(
            f"path={path}: its weights cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "give the folder save_pretrained wrote, whole"
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
    return hf


def check_vocab(tokenizer, folder: str) -> None:
    """One line where the folder's tokenizer and model (``vocab_size`` in config.json) count different
    tokens: ids the text is written in past the model's embedding cannot be read (tokens added beside
    them, special ones, may be: text never holds them), and logits over ids the tokenizer never
    writes are no scores of its text."""
    try:
        model = json.loads((Path(folder) / "config.json").read_text()).get("vocab_size")
    except (ValueError, OSError, AttributeError):  # pretrained_sizes names what is wrong with it
        return
    if isinstance(model, bool) or not isinstance(model, int):
        return
    written, every = tokenizer.vocab_size, len(tokenizer)
    if written > model or every < model:
        raise GtxError(
            f"path={folder}: its tokenizer has {written if written > model else every} tokens but its model {model} "
            "(vocab_size in config.json); give a folder whose tokenizer and model were saved together"
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
