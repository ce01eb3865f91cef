"""A tiny pretrained-model folder, as ``save_pretrained`` writes one, made here without downloads: a
byte-level BPE tokenizer fitted to a little text and a small random model of a transformers family."""

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


def save_tiny(
    folder: Path, family: str = "llama", vocab_size: int = 300, positions: int = 256, seed: int = 0, **config
) -> Path:
    """``folder`` holding config.json, model.safetensors and a tokenizer (transformers' fast tokenizer files);
    ``config``: settings of the family's transformers config beyond (or replacing) the tiny sizes."""
    import tokenizers
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=vocab_size, min_frequency=1, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    n = len(tokenizer)
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
        made = transformers.AutoConfig.for_model(
            family, vocab_size=n, max_position_embeddings=positions, **{**SIZES, **config}
        )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(made).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_bpc(folder: Path, tokenizer, windows) -> float:
    """Bits per byte of transformers' own model of ``folder`` (eager attention, with its own masks:
    windows, soft-capping, sinks) over ``windows`` (token lists, each read alone), as gtx's text task counts them."""
    import transformers

    own = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    nats, text = 0.0, []
    for window in windows:
        ids = torch.tensor(tokenizer.vocab.encode(window))
        with torch.no_grad():
            logits = own(input_ids=ids[None]).logits[0, :-1]
        nats += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
        text += window[1:]
    return nats / math.log(2) / tokenizer.n_bytes(text)
