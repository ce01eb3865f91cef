"""A tiny pretrained-model folder, as ``save_pretrained`` writes one, made here without downloads: a
byte-level BPE tokenizer fitted to a little text and a small random model of a transformers family."""

from pathlib import Path

import torch

TEXT = "the quick brown fox jumps over the lazy dog; a needle hides in a haystack of filler text. " * 40


def save_tiny(folder: Path, family: str = "llama", vocab_size: int = 300, positions: int = 256, seed: int = 0) -> Path:
    """``folder`` holding config.json, model.safetensors and a tokenizer (transformers' fast tokenizer files)."""
    import tokenizers
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=vocab_size, min_frequency=1, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    n = len(tokenizer)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=n, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=positions, bos_token_id=0, eos_token_id=0)
    else:
        cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
        config = cls(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=positions)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
