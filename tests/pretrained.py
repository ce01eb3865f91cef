"""A tiny pretrained-model folder, as ``save_pretrained`` writes one, made here without downloads: a
byte-level BPE tokenizer fitted to a little text and a small random model of a transformers family."""

import json
import math
from pathlib import Path

import torch

TEXT = "the quick brown fox jumps over the lazy dog; a needle hides in a haystack of filler text. " * 40
# every family but gpt2 is built from these sizes: 2 layers of width 32, 4 query and 2 key/value heads of 8 dimensions
SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}

NEOX_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def save_tiny(
    folder: Path,
    family: str = "llama",
    vocab_size: int = 300,
    positions: int = 256,
    seed: int = 0,
    rows: int | None = None,
    dtype: torch.dtype = torch.float32,
    **config,
) -> Path:
    """``folder`` holding config.json, model.safetensors and a tokenizer (transformers' fast tokenizer files);
    ``rows``: the model's embedding rows where more than the tokenizer's ids (a padded vocabulary, as
    Qwen2's); ``dtype``: what the weights are saved in; ``config``: settings of the family's
    transformers config beyond (or replacing) the tiny sizes."""
    import tokenizers
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=vocab_size, min_frequency=1, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    n = rows or len(tokenizer)
    if family == "gpt2":
        made = transformers.GPT2Config(
            vocab_size=n,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_inner=64,
            n_positions=positions,
            bos_token_id=0,
            eos_token_id=0,
            **config,
        )
    else:
        # gpt_neox has as many key/value heads as query heads, each of hidden_size / heads dimensions
        sizes = {k: v for k, v in SIZES.items() if family != "gpt_neox" or k in NEOX_SIZES}
        made = transformers.AutoConfig.for_model(
            family, vocab_size=n, max_position_embeddings=positions, **{**sizes, **config}
        )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(made).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_bpc(folder: Path, tokenizer, windows, **load) -> float:
    """Bits per byte of transformers' own model of ``folder`` (eager attention, with its own masks:
    windows, soft-capping, sinks) over ``windows`` (token lists, each read alone), as gtx's text task
    counts them; ``load``: what ``from_pretrained`` takes beside (``gguf_file``)."""
    import transformers

    own = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", **load).eval()
    nats, tokens = reference_nats(own, [tokenizer.vocab.encode(window) for window in windows])
    return nats / math.log(2) / tokenizer.n_bytes([t for window in windows for t in window[1:]])


def reference_nats(own, windows) -> tuple[float, int]:
    """(nats, targets): the cross-entropy summed over the logits' every row that transformers' model
    ``own`` gives each window of ids (read alone, each token predicting the next), and how many it predicts."""
    nats, count = 0.0, 0
    for window in windows:
        ids = torch.tensor(window)
        with torch.no_grad():
            logits = own(input_ids=ids[None]).logits[0, :-1]
        nats += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
        count += len(ids) - 1
    return nats, count


def save_tiny_gguf(file: Path, seed: int = 0, quantized: bool = True, file_type: bool = True) -> Path:
    """``file``: a tiny Llama as a GGUF file, as llama.cpp writes one (its hyper-parameters, a byte-level
    BPE tokenizer of 300 tokens and random weights, the matrices quantized to Q8_0 or left F32; with
    ``file_type``, general.file_type naming which), made with the gguf package, without downloads.
    transformers' GGUF reader gives its model and tokenizer."""
    import gguf
    import numpy as np
    import tokenizers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=300, min_frequency=1, show_progress=False)
    model = json.loads(bpe._tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    dim, ff, heads, kv, layers = 32, 64, 4, 2, 2
    g = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(file), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(dim // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    kind = gguf.GGMLQuantizationType.Q8_0 if quantized else gguf.GGMLQuantizationType.F32
    if file_type:
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)

    def matrix(name, rows, cols):
        x = (g.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, kind) if quantized else x, raw_dtype=kind if quantized else None)

    def norm(name):
        w.add_tensor(name, (1 + 0.1 * g.standard_normal(dim)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), dim)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, rows, cols in (
            ("attn_q", dim, dim),
            ("attn_k", kv * dim // heads, dim),
            ("attn_v", kv * dim // heads, dim),
            ("attn_output", dim, dim),
            ("ffn_gate", ff, dim),
            ("ffn_up", ff, dim),
            ("ffn_down", dim, ff),
        ):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    norm("output_norm.weight")
    matrix("output.weight", len(tokens), dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return file
