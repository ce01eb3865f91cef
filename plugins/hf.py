"""hf: Hugging Face transformers causal LMs whose every attention layer runs through gtx's ``Attention``.

    gtx run --task recall --model hf --set family=llama --pattern local:w=64
    gtx run --task text --model hf --set family=qwen2 --set kv_heads=2 --pattern moba:b=32,k=3
    gtx run --task text --model hf --set path=DIR --pattern local:w=256 --epochs 0   # a pretrained model, scored untrained

The model is built from transformers' own code (``AutoModelForCausalLM.from_config``), not copied:
gtx registers an attention function, ``"gtx"``, through transformers' ``AttentionInterface`` and
selects it with ``attn_implementation``. Each attention layer then hands its queries, keys and
values to gtx's ``Attention`` with the run's pattern: fixed patterns, head groups, biases,
selections and trainable methods alike. A batch's samples are fed packed, as one row of ``N`` tokens
with positions restarting at 0 per sample (RoPE and learned positions see each sample as alone);
the pattern's ``dd`` edges keep the samples apart. ``--set family`` builds a small randomly
initialised model of that family with the task's vocabulary (needs ``pip install -e '.[hf]'``);
``--set path=DIR`` loads a ``save_pretrained`` folder (config, weights, tokenizer) instead, and
tasks written in text (``text``, ``needle``) are then written with its tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gtx import GtxError, hookimpl, setting
from gtx.attention.model import GraphModel, Output
from gtx.attention.module import layer_attention
from gtx.data.vocab import ModelVocab, Tokenizer

FAMILIES = ("llama", "qwen2", "gpt2")
INSTALL = "pip install -e '.[hf]' (transformers)"
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, byte-level BPE
POSITIONS = ("max_position_embeddings", "n_positions")  # what config.json calls the positions a model has


@dataclass
class HFConfig:
    family: str = setting("llama", "a small random model of this transformers family: llama, qwen2 or gpt2")
    layers: int = setting(2, range="[1, inf)")
    heads: int = setting(4, "query heads", "[1, inf)")
    kv_heads: int = setting(0, "key/value heads (grouped-query attention: a divisor of heads); 0: as heads; gpt2 has none", "[0, inf)")
    dim: int = setting(64, "hidden size", "[1, inf)")
    dim_ff: int = setting(128, "MLP size", "[1, inf)")
    max_len: int = setting(4096, "positions the model has: the longest sequence it reads (path: the folder's)", "[1, inf)")
    path: str = setting("", "a save_pretrained folder (config.json, weights, tokenizer): that model, its weights and its tokenizer "
                            "instead of a random one of family (whose sizes are then unused)")
    train_params: str = setting("", "fine-tune only the parameters whose names match this regular expression "
                                    "(e.g. self_attn; gtx models show names); empty: all")

    def __post_init__(self):
        try:
            re.compile(self.train_params)
        except re.error as e:
            raise ValueError(f"train_params={self.train_params!r} is not a regular expression ({e})") from None
        if self.path:
            self.max_len = pretrained_positions(Path(self.path))
            return
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: choose {', '.join(FAMILIES)}")
        kv = self.kv_heads or self.heads
        if self.dim % self.heads or self.heads % kv:
            raise ValueError(f"heads={self.heads}, kv_heads={self.kv_heads}, dim={self.dim}: dim must be a multiple of heads, heads of kv_heads")
        if self.family == "gpt2" and self.kv_heads not in (0, self.heads):
            raise ValueError(f"kv_heads={self.kv_heads}: gpt2 has no grouped-query attention; leave kv_heads at 0")


def pretrained_positions(folder: Path) -> int:
    """The positions of the model saved in ``folder``, once the folder is checked to hold a config,
    weights and a tokenizer."""
    where = f"path={folder}"
    if not (folder / "config.json").is_file():
        raise ValueError(f"{where} has no config.json; give a folder written by save_pretrained (config, weights and tokenizer)")
    if not any(any(folder.glob(w)) for w in WEIGHTS):
        raise ValueError(f"{where} has no weights ({' or '.join(WEIGHTS)}); save the model there with save_pretrained")
    if not any((folder / t).is_file() for t in TOKENIZER):
        raise ValueError(f"{where} has no tokenizer ({', '.join(TOKENIZER)}); save the model's tokenizer there with save_pretrained")
    config = json.loads((folder / "config.json").read_text())
    positions = next((config[k] for k in POSITIONS if k in config), None)
    if not isinstance(positions, int):
        raise ValueError(f"{where}: config.json names no positions ({' or '.join(POSITIONS)}); its model cannot say how long a text it reads")
    return positions


class HFTokenizer(Tokenizer):
    """A transformers tokenizer saved beside its model, as gtx's tasks write with it."""

    def __init__(self, folder: str):
        self.name = folder
        self.hf = transformers().AutoTokenizer.from_pretrained(folder)
        self.hf.model_max_length = 1 << 62  # a task tokenizes whole splits; windows keep within the model's positions
        self.vocab = ModelVocab(self.hf.convert_ids_to_tokens(list(range(len(self.hf)))))

    def tokenize(self, text: str) -> list[str]:
        return self.hf.convert_ids_to_tokens(self.hf(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, tokens) -> str:
        return self.hf.convert_tokens_to_string(list(tokens))


def transformers():
    try:
        import transformers
    except ModuleNotFoundError:
        raise GtxError(f"model 'hf' needs Hugging Face transformers; install it: {INSTALL}") from None
    if "gtx" not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register("gtx", gtx_attention)
    return transformers


def hf_config(c: HFConfig, vocab_size: int):
    """The transformers config of a small random model of family ``c.family``."""
    t = transformers()
    if c.family == "gpt2":
        return t.GPT2Config(vocab_size=vocab_size, n_embd=c.dim, n_layer=c.layers, n_head=c.heads, n_inner=c.dim_ff, n_positions=c.max_len,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cls = t.LlamaConfig if c.family == "llama" else t.Qwen2Config
    return cls(vocab_size=vocab_size, hidden_size=c.dim, intermediate_size=c.dim_ff, num_hidden_layers=c.layers, num_attention_heads=c.heads,
               num_key_value_heads=c.kv_heads or c.heads, max_position_embeddings=c.max_len, tie_word_embeddings=True)


def gtx_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: query (1, H, N, D), key and value (1, H_kv, N, D)
    -> ((1, N, H, D), None). The layer's ``gtx`` attribute holds its gtx attention and the batch's edges."""
    attention, holder = module.gtx
    if query.shape[0] != 1 or holder.edges is None:
        raise GtxError("a model under attn_implementation='gtx' reads packed batches through gtx's hf model plugin (one row, gtx's edges)")
    groups = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = (query[0] * scale).transpose(0, 1)  # (N, H, D), pre-scaled as gtx's attention takes it
    k, v = (x[0].repeat_interleave(groups, 0).transpose(0, 1) for x in (key, value))  # grouped-query heads as repeat_kv orders them
    return attention(q, k, v, holder.edges)[None], None


class _Edges:
    edges = None


class HFModel(GraphModel):
    """A transformers causal LM over the ``dd`` edges of gtx's batches."""

    forms = ("lm",)

    @classmethod
    def tokenizer(cls, config: HFConfig) -> HFTokenizer | None:
        return HFTokenizer(config.path) if config.path else None

    def __init__(self, config: HFConfig, src_vocab, tgt_vocab, attention):
        super().__init__(attention)
        t = transformers()
        self.config = config
        if config.path:
            self.hf = t.AutoModelForCausalLM.from_pretrained(config.path, attn_implementation="gtx", dtype=torch.float32)
        else:
            self.hf = t.AutoModelForCausalLM.from_config(hf_config(config, len(tgt_vocab)), attn_implementation="gtx")
        if config.train_params:
            for name, p in self.hf.named_parameters():
                p.requires_grad_(re.search(config.train_params, name) is not None)
            if not any(p.requires_grad for p in self.hf.parameters()):
                raise GtxError(f"train_params={config.train_params!r} matches no parameter of {type(self.hf).__name__}; "
                               f"its names look like {next(iter(dict(self.hf.named_parameters())))}")
        layers = [m for m in self.hf.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]
        if not layers or not getattr(self.hf, "_supports_attention_backend", False):
            raise GtxError(f"{type(self.hf).__name__} does not call transformers' attention interface; its attention cannot be replaced")
        self.layer_attention = nn.ModuleList(layer_attention(attention) for _ in layers)
        self._holder = _Edges()
        for module, own in zip(layers, self.layer_attention):
            object.__setattr__(module, "gtx", (own, self._holder))  # not a submodule: layer_attention holds it

    def forward(self, batch) -> Output:
        self._holder.edges = batch.graph.edges["dd"]
        try:
            out = self.hf(input_ids=batch.tgt_in[None], position_ids=batch.tgt_pos[None], use_cache=False)
        finally:
            self._holder.edges = None
        return Output(out.logits[0])


@hookimpl
def register_models(register):
    register("hf", HFModel, config=HFConfig)
